"""The benchmark's core (:mod:`jax_smddp.tools.bench`): sizes, layouts, the
programs of each op, their inputs and checks, the timing loops, the driver
(:func:`run_benchmark`), the run's metadata and each row's model annotation."""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jax_smddp import calibration, capabilities, config, cost_model
from jax_smddp._startup import COLLECTIVES
from jax_smddp.tools.bench import nccl_tests
from jax_smddp.tools.sizes import format_size, parse_size  # noqa: F401 (the bench's names)
from jax_smddp.tools.bench.interval import add_p90, speedup_interval
from jax_smddp.tools.bench.meter import CpuMeter

log = logging.getLogger("jax_smddp.tools.bench")

OPS = COLLECTIVES
DEFAULT_OPS = OPS[:3]

# Large sizes run fewer iterations: a sample is cut when one implementation's
# calls would move more than this many bytes in all (keeps the default run short
# on small machines); never fewer than MIN_ITERS samples.
BYTES_BUDGET = 2 << 30
MIN_ITERS = 3
MEMCPY_BYTES = 64 << 20


# --------------------------------------------------------------------------- sizes

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
  host) or ``"HxPxD"`` (H simulated hosts, 2 to 32, x P processes x D devices)."""
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
  if not 2 <= parts[0] <= 32:
    raise argparse.ArgumentTypeError(
        f"layout {text!r}: 2 to 32 simulated hosts are supported (HxPxD)")
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

  # S and busbw as nccl-tests defines them: one definition (nccl_tests.py), the GPU bench's too.
  total = lambda op: (lambda n: nccl_tests.size_of(op, 1, n))
  bus = lambda op: (lambda n: nccl_tests.bus_factor(op, n))
  return {
      "all_gather": OpSpec(
          "all_gather",
          lambda x, a: smddp.all_gather(x, a, tiled=True),
          lambda x, a: jax.lax.all_gather(x, a, tiled=True),
          total_factor=total("all_gather"), bus_factor=bus("all_gather"),
          target="smddp_all_gather"),
      "reduce_scatter": OpSpec(
          "reduce_scatter",
          lambda x, a: smddp.psum_scatter(x, a, tiled=True),
          lambda x, a: jax.lax.psum_scatter(x, a, tiled=True),
          total_factor=total("reduce_scatter"), bus_factor=bus("reduce_scatter"),
          target="smddp_reduce_scatter"),
      "all_reduce": OpSpec(
          "all_reduce",
          lambda x, a: smddp.psum(x, a),
          lambda x, a: jax.lax.psum(x, a),
          total_factor=total("all_reduce"), bus_factor=bus("all_reduce"),
          target="smddp_all_reduce"),
      "all_to_all": OpSpec(
          "all_to_all",
          lambda x, a: smddp.all_to_all(x, a, 0, 0, tiled=True),
          lambda x, a: jax.lax.all_to_all(x, a, 0, 0, tiled=True),
          total_factor=total("all_to_all"), bus_factor=bus("all_to_all"),
          target="smddp_all_to_all"),
  }


# What the second column times (--baseline): JAX's own collective, or a second
# compiled copy of jax_smddp's program. Against itself a speedup's truth is 1.0,
# so what the rows read beside it is what this machine's noise alone gives.
BASELINES = {"lax": "jax.lax", "self": "jax_smddp again"}


def baseline_short(baseline: str) -> str:
  """The baseline's name in column headers ("lax us", "again us")."""
  return "lax" if baseline == "lax" else "again"


def build_programs(spec: OpSpec, mesh, baseline: str = "lax"):
  """The two jitted shard_map programs (smddp, baseline) for one op over mesh axis "x";
  the baseline is jax.lax's collective, or with `baseline` "self" a second, separately
  jitted program of jax_smddp's."""
  import jax
  from jax.sharding import PartitionSpec as P

  def program(collective):
    body = lambda x: collective(x, "x")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  return program(spec.smddp), program(spec.smddp if baseline == "self" else spec.lax)


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
  if count * dtype.itemsize != nbytes:
    raise ValueError(f"{nbytes} bytes per rank is no whole number of {dtype.name} elements "
                     f"({dtype.itemsize} bytes each)")
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
    if blocks.shape[1] % n:
      raise ValueError(f"all_to_all: {blocks.shape[1]} elements per rank do not split into "
                       f"{n} blocks (nccl-tests' sizes always do: nccl_tests.round_size)")
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


def count_wrong(dtype, got, want: np.ndarray) -> int:
  """Elements of this process's shards of jax array `got` that differ from `want` (nccl-tests'
  #wrong; floats within the tolerance of _check_arrays count as right)."""
  wrong = 0
  for shard in got.addressable_shards:
    have, ref = np.asarray(shard.data), want[shard.index]
    if have.shape != ref.shape:
      wrong += ref.size
    elif is_float(dtype):
      rtol = 1e-5 if to_dtype(dtype).itemsize >= 4 else 1e-2
      wrong += int(np.count_nonzero(~np.isclose(have.astype(np.float64), ref.astype(np.float64),
                                                rtol=rtol, atol=rtol)))
    else:
      wrong += int(np.count_nonzero(have != ref))
  return wrong


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


def interface_tx() -> dict[str, int]:
  """Bytes sent so far by each network interface of this process's namespace (loopback left
  out), from the kernel's counters: what the simulated hosts' NICs carried."""
  from jax_smddp.tools import netns
  return {name: c["tx"] for name, c in netns.interface_bytes().items()}


def settled_interface_tx(quiet_s: float = 0.02, limit_s: float = 2.0) -> dict[str, int]:
  """interface_tx() once the counters stopped moving for `quiet_s` (at most `limit_s`): a call
  returns once its sends are in the kernel's socket buffers, which drain onto a capped link
  after it; read this way, a window of calls counts its own bytes, not the previous window's
  tail."""
  last = interface_tx()
  deadline = time.monotonic() + limit_s
  while time.monotonic() < deadline:
    time.sleep(quiet_s)
    now = interface_tx()
    if now == last:
      break
    last = now
  return last


class _Sent:
  """Adds what each interface sent during a window of calls into `into` (a dict per fn);
  the counters read settled, outside the calls' spans. `barrier`: every process meets before
  each reading, so that no process of the host sends its part of the window's first call
  before the window opens (eager sends need no receiver) or its last after it closed."""

  def __init__(self, into: dict | None, barrier=None):
    self.into = into
    self.barrier = barrier

  def __enter__(self):
    if self.into is not None and self.barrier:
      self.barrier()
    self.before = settled_interface_tx() if self.into is not None else None
    if self.into is not None and self.barrier:
      self.barrier()  # no process starts before every host's counters are read
    return self

  def __exit__(self, *exc):
    if self.into is not None:
      if self.barrier:
        self.barrier()
      for name, tx in settled_interface_tx().items():
        self.into[name] = self.into.get(name, 0) + tx - self.before.get(name, tx)


def _timed_call(fn, x, samples: list, starts: list, cpu: list, sent: dict | None = None) -> None:
  """One synced call of fn(x): its wall time into `samples`, its start into `starts`
  (time.perf_counter(): CLOCK_MONOTONIC on Linux, one clock for every process of the
  machine), and the CPU time this process used meanwhile into `cpu` (time.process_time():
  every thread's, the kernel's work for them included; read outside the wall span). `sent`, if
  given, adds what each interface of this host sent meanwhile (_Sent: the host's other
  processes run the same calls, so this counts the host's traffic)."""
  with _Sent(sent):
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    t1 = time.perf_counter()
    cpu.append(time.process_time() - c0)
  samples.append(t1 - t0)
  starts.append(t0)


def _sent_for(sent, k):
  return sent[k] if sent is not None else None


def _lists(given, fns) -> list[list[float]]:
  return given if given is not None else [[] for _ in fns]


def time_alternating(fns, x, iters: int, warmup: int, barrier=None,
                     starts: list[list[float]] | None = None,
                     cpu: list[list[float]] | None = None,
                     sent: list[dict] | None = None) -> list[list[float]]:
  """Seconds per call of each fn(x), calls interleaved (a, b, a, b, ...), each synced;
  `barrier()`, if given, runs before each timed call (outside its span). `starts` and
  `cpu`, if given (a list per fn), get each timed call's start and the process's CPU
  seconds during it; `sent` (a dict per fn) the bytes each interface sent (_timed_call)."""
  for _ in range(warmup):
    for fn in fns:
      fn(x).block_until_ready()
  samples = [[] for _ in fns]
  starts, cpu = _lists(starts, fns), _lists(cpu, fns)
  for _ in range(iters):
    for k, (fn, out, began, used) in enumerate(zip(fns, samples, starts, cpu)):
      if barrier:
        barrier()
      _timed_call(fn, x, out, began, used, _sent_for(sent, k))
  return samples


def time_blocks(fns, x, iters: int, warmup: int, block: int = 5,
                starts: list[list[float]] | None = None,
                cpu: list[list[float]] | None = None,
                sent: list[dict] | None = None) -> list[list[float]]:
  """Seconds per call of each fn(x), each synced, in blocks of `block` calls of one
  fn back to back (a x5, b x5, a x5, ...): a block is the steady state of one
  collective (every process in step), and the blocks' alternation spreads slow
  periods of the machine over both. `starts`, `cpu`, `sent`: as time_alternating's."""
  for fn in fns:
    for _ in range(warmup):
      fn(x).block_until_ready()
  samples = [[] for _ in fns]
  starts, cpu = _lists(starts, fns), _lists(cpu, fns)
  while len(samples[0]) < iters:
    k = min(block, iters - len(samples[0]))
    for j, (fn, out, began, used) in enumerate(zip(fns, samples, starts, cpu)):
      # A block's bytes, counted around the block, every process in it.
      with _Sent(_sent_for(sent, j), barrier=process_barrier):
        for _ in range(k):
          _timed_call(fn, x, out, began, used)
  return samples


_barriers = 0


def process_barrier() -> None:
  """Every process of the jax.distributed job meets here (its key-value store's barrier, not a
  collective of any library under test); nothing in a single process."""
  global _barriers
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    return
  _barriers += 1
  client.wait_at_barrier(f"jax_smddp_bench_{_barriers}", 60_000)


def time_barrier(fns, x, iters: int, warmup: int, barrier=process_barrier,
                 starts: list[list[float]] | None = None,
                 cpu: list[list[float]] | None = None,
                 sent: list[dict] | None = None) -> list[list[float]]:
  """As time_alternating, with every process meeting at a barrier before each timed call
  (outside its span): every call starts together, as a harness that synchronises its
  processes before each call times it; a call then waits for no late peer."""
  return time_alternating(fns, x, iters, warmup, barrier=barrier, starts=starts, cpu=cpu,
                          sent=sent)


def time_solo(fns, x, iters: int, warmup: int,
              starts: list[list[float]] | None = None,
              cpu: list[list[float]] | None = None,
              sent: list[dict] | None = None) -> list[list[float]]:
  """As time_blocks with one block per implementation: all of one fn's calls back to
  back, then all of the next's. Each library alone in its steady state, its threads
  still awake from the previous call; the other timings measure calls that follow
  another library's (docs/cpu_floor.md: cold and back-to-back calls)."""
  return time_blocks(fns, x, iters, warmup, block=max(1, iters), starts=starts, cpu=cpu,
                     sent=sent)


TIMINGS = {"blocks": time_blocks, "alternating": time_alternating, "barrier": time_barrier,
           "solo": time_solo}
# run_benchmark's default timing; parse_args sets it from --timing (multi-process
# workers parse the same options, so their run_benchmark follows it too).
_timing = "alternating"
# run_benchmark's default baseline; parse_args sets it from --baseline (as _timing).
_baseline = "lax"


def bandwidths(spec: OpSpec, nbytes: int, n: int, seconds: float) -> dict:
  """nccl-tests figures for one median time (`nbytes`: one rank's input)."""
  f = nccl_tests.figures(spec.name, nccl_tests.size_of(spec.name, nbytes, n), n, seconds)
  return {"time_us": f["time"], "algbw_gbs": f["algbw"], "busbw_gbs": f["busbw"]}


IN_PLACE_NOTE = ("N/A: not run. In JAX in place means a donated input aliased to the output; "
                 "jax_smddp's calls are timed out of place only")


def nccl_row(r: dict, n: int, dtype, processes: int = 1) -> dict:
  """Adds to result `r` nccl-tests' row fields under their names: size (S), count, type, redop,
  root, then jax_smddp's out-of-place time (us), algbw, busbw (GB/s) and #wrong (summed over
  the processes: "wrong"), in_place (N/A: IN_PLACE_NOTE), the baseline's time, algbw, busbw
  and #wrong ("baseline_*"), speedup, ranks and processes. Call it on merged rows."""
  op, itemsize = r["op"], to_dtype(dtype).itemsize
  size = nccl_tests.size_of(op, r["bytes_per_rank"], n)
  wrong = r.get("wrong") or {}
  r.update(nccl_tests.row_head(op, size, n, to_dtype(dtype), itemsize))
  r.update({"time": r["smddp"]["time_us"], "algbw": r["smddp"]["algbw_gbs"],
            "busbw": r["smddp"]["busbw_gbs"], "#wrong": wrong.get("smddp", 0),
            "min_time": r["smddp"].get("min_us"),
            "in_place_time": None, "in_place_algbw": None, "in_place_busbw": None,
            "in_place_#wrong": None, "in_place": {"time": None, "algbw": None, "busbw": None,
                                                  "#wrong": None, "note": IN_PLACE_NOTE},
            "baseline": BASELINES[r.get("baseline_name", "lax")],
            "baseline_time": r["lax"]["time_us"], "baseline_algbw": r["lax"]["algbw_gbs"],
            "baseline_busbw": r["lax"]["busbw_gbs"], "baseline_#wrong": wrong.get("lax", 0),
            "ranks": n, "processes": processes})
  r["smddp"]["#wrong"], r["lax"]["#wrong"] = r["#wrong"], r["baseline_#wrong"]
  return r


def sum_wrong(per_process: list[list[dict]], rows: list[dict]) -> list[dict]:
  """Each of `rows` gets the wrong elements of every process's shards, summed ("wrong")."""
  for r, prows in zip(rows, zip(*per_process)):
    counts = {impl: [(q.get("wrong") or {}).get(impl, 0) for q in prows]
              for impl in ("smddp", "lax")}
    r["wrong"] = {impl: None if None in c else sum(c) for impl, c in counts.items()}  # -c 0
  return rows


def slowest_process(per_process: list[list[dict]], n: int) -> list[dict]:
  """Rows whose times are each call's slowest process: `per_process` holds every process's
  rows (the same ops and sizes in the same order, as every worker times the same calls);
  call k of an implementation took max over the processes of their k-th sample, and the
  row's time is the median of those (its min_us their minimum). Process 0's row otherwise,
  with each process's own median kept ("process_medians_us"); the phases and "mean_us" stay
  process 0's."""
  specs = op_specs()
  out = []
  for rows in zip(*per_process):
    r = copy.deepcopy(rows[0])
    spec = specs[r["op"]]
    r["process_medians_us"] = {}
    for impl in r["samples_us"]:
      calls = [max(row["samples_us"][impl][k] for row in rows)
               for k in range(min(len(row["samples_us"][impl]) for row in rows))]
      if not calls:  # a baseline not run (0 bytes)
        continue
      t = statistics.median(calls) / 1e6
      r[impl] = {**r[impl], **bandwidths(spec, r["bytes_per_rank"], n, t), "min_us": min(calls)}
      r["samples_us"][impl] = calls
      r["process_medians_us"][impl] = [row[impl]["time_us"] for row in rows]
    r["speedup"] = r["lax"]["time_us"] / r["smddp"]["time_us"] if r["lax"]["time_us"] else None
    if "mpi4jax" in r:
      r["vs_mpi4jax"] = r["mpi4jax"]["time_us"] / r["smddp"]["time_us"]
    r["statistic"] = "slowest process per call"
    out.append(add_p90(r))  # of the slowest calls
  return out


def after_arrival(per_process: list[list[dict]], rows: list[dict]) -> list[dict]:
  """Adds to each of `rows` (process 0's, or slowest_process's: the same ops and sizes in the
  same order as every process's) each implementation's calls timed from the last process's
  start to the last process's end ("after_arrival": "time_us" their median, "skew_us" the
  median of how far apart the processes started, "samples_us"), with
  "after_arrival_speedup" and its bootstrap range ("after_arrival_interval"), and, where the
  workers kept it, the CPU time the processes used per call ("cpu_us": the median over calls of
  their sum; beside the machine's cores it tells a call that ran the machine flat out, where
  the ranking is the scheduler's as much as either library's). The processes'
  start times share one clock (time.perf_counter, CLOCK_MONOTONIC: the benchmark's processes,
  simulated hosts included, run on one machine). Timed so, a call leaves out the wait for a
  peer that came late, which the previous call (of either library) and the scheduler decide,
  and keeps all that the library does once every process is in it."""
  for r, prows in zip(rows, zip(*per_process)):
    if not all("starts_us" in q for q in prows) or not all(r["samples_us"].values()):
      continue  # a baseline not run (0 bytes) has no calls
    aa = {}
    for impl in r["samples_us"]:
      spans, skews = [], []
      for k in range(min(len(q["starts_us"][impl]) for q in prows)):
        began = [q["starts_us"][impl][k] for q in prows]
        ended = max(q["starts_us"][impl][k] + q["samples_us"][impl][k] for q in prows)
        spans.append(round(ended - max(began), 1))
        skews.append(round(max(began) - min(began), 1))
      aa[impl] = {"time_us": statistics.median(spans), "skew_us": statistics.median(skews),
                  "samples_us": spans}
      if all("cpu_us" in q for q in prows):
        used = [sum(q["cpu_us"][impl][k] for q in prows)
                for k in range(min(len(q["cpu_us"][impl]) for q in prows))]
        aa[impl]["cpu_us"] = round(statistics.median(used), 1)
    r["after_arrival"] = aa
    r["after_arrival_speedup"] = aa["lax"]["time_us"] / aa["smddp"]["time_us"]
    r["after_arrival_interval"] = speedup_interval(aa["smddp"]["samples_us"],
                                                   aa["lax"]["samples_us"])
  return rows


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


def interhost_bytes_per_host(op: str, nbytes: int, layout: "Layout") -> int:
  """Bytes each host must receive from the other hosts for one call, at
  least, where every host combines its own ranks' data first (n ranks, H
  hosts, nbytes per rank's input): all_gather the other hosts' shards,
  reduce_scatter and all_to_all the other hosts' parts of its ranks' outputs,
  all_reduce a reduce_scatter and an all_gather of the host-summed vector."""
  n, hosts = layout.devices, layout.hosts
  local = n // hosts
  return {"all_gather": (n - local) * nbytes,
          "reduce_scatter": (hosts - 1) * nbytes // hosts,
          "all_reduce": 2 * (hosts - 1) * nbytes // hosts,
          "all_to_all": local * nbytes * (hosts - 1) // hosts}[op]


def ring_bytes_per_host(op: str, nbytes: int, layout: "Layout") -> int | None:
  """Bytes the busiest host sends for one call of a ring over all n ranks in rank order (gloo's
  algorithm under jax.lax on CPU; a host's ranks are consecutive, so one ring edge leaves each
  host): all_gather n - 1 blocks of nbytes, reduce_scatter n - 1 of nbytes / n, all_reduce
  both. None where gloo's algorithm is not a ring (all_to_all) or one host holds every rank.
  Measured exceptions (docs/between_hosts.md, "Bytes on the wire"): gloo's reduce_scatter
  over 4 one-process hosts sends nbytes, not 3/4 of it, from two of the hosts."""
  n = layout.devices
  if layout.hosts < 2:
    return None
  return {"all_gather": (n - 1) * nbytes,
          "reduce_scatter": (n - 1) * nbytes // n,
          "all_reduce": 2 * (n - 1) * nbytes // n}.get(op)


def link_us(op: str, nbytes: int, layout: "Layout", link_gbs: float,
            burst_bytes: int = 0) -> float:
  """The link reference of one call between hosts: interhost_bytes_per_host at
  the link's measured rate each way (jax_smddp.tools.link_probe). With `burst_bytes` (what a
  capped link's full token buckets pass at the interface's own speed: netns.BURST_BYTES per
  NIC) the least time a call can take, less those bytes: a bucket refills while the link idles
  between calls, so a call of a few buckets' bytes may beat the plain reference by that much
  (calls back to back of 1 MiB and more per host ran at the plain reference, 0.98-1.03)."""
  sent = interhost_bytes_per_host(op, nbytes, layout)
  return max(sent - burst_bytes, 0) / (link_gbs * 1e9) * 1e6


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

# distributed.call_phases()'s phases: the first four add up to the call, the last two are parts
# of agree and body.
PHASES = ("local", "queue", "agree", "body", "wait", "sleep")


def call_phases(op: str) -> dict:
  """This process's jax_smddp.distributed.call_phases() for `op` ({} before any call)."""
  from jax_smddp import distributed
  return distributed.call_phases().get(op, {})


def phase_means(before: dict, after: dict) -> dict | None:
  """Per call between two call_phases(op) readings: the calls, each phase in us, the sleeps;
  None if no call was counted in between."""
  calls = after.get("calls", 0) - before.get("calls", 0)
  if calls <= 0:
    return None
  out = {"calls": calls}
  for k in PHASES:
    out[f"{k}_us"] = (after[f"{k}_s"] - before.get(f"{k}_s", 0)) / calls * 1e6
  out["sleeps"] = (after["sleeps"] - before.get("sleeps", 0)) / calls
  out["inline"] = (after.get("inline_calls", 0) - before.get("inline_calls", 0)) / calls
  return out


def _us(seconds: list[float]) -> list[float]:
  """Times in seconds as the JSON keeps them: microseconds, to 0.1."""
  return [round(t * 1e6, 1) for t in seconds]


def run_benchmark(ops, sizes, *, dtype="float32", iters: int = 20, warmup: int = 3,
                  devices=None, report: Callable[[dict], None] | None = None,
                  timing: str | None = None, mpi4jax: bool = False,
                  baseline: str | None = None, interfaces: bool = False,
                  check: bool = True) -> list[dict]:
  """Benchmarks `ops` at each size in `sizes` (nccl-tests' -b/-e/-f/-i sweep): one row per size,
  of the size S nccl-tests prints for it (nccl_tests.round_size: all_gather's whole output,
  the others' per-rank input, each op's blocks rounded as nccl-tests rounds them; a size
  rounded to one already run runs again, as nccl-tests does); returns one dict per row as in
  the JSON "results" list ("bytes_per_rank": one rank's input). `check` False (-c 0) skips the
  answers' check ("wrong" None). `devices` defaults to all CPU devices.
  `report` is called with each result as it is ready (e.g. to print a row).
  `mpi4jax`: also time mpi4jax (the job runs under mpirun, one device per
  process), alternating with the others ("mpi4jax", "vs_mpi4jax").
  `baseline` (BASELINES; default --baseline's): what the "lax" entries time.
  `interfaces`: count the bytes each network interface of this process's namespace sent
  during each implementation's timed calls ("sent_per_call": {impl: {interface: bytes per
  call}}; the host's, as its other processes run the same calls meanwhile).

  Raises AssertionError if a jax_smddp result differs from jax.lax's.
  """
  import jax

  timing = timing or _timing
  baseline = baseline or _baseline
  devices = list(devices if devices is not None else jax.devices("cpu"))
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  specs = op_specs()
  unknown = [op for op in ops if op not in specs]
  if unknown:
    raise ValueError(f"unknown ops {unknown}; choose from {list(specs)}")
  results = []
  meter = CpuMeter()
  across = jax.process_count() > 1  # calls that cross processes: their phases are counted
  for op in ops:
    spec = specs[op]
    smddp_fn, lax_fn = build_programs(spec, mesh, baseline)
    mpi_fn = build_mpi4jax_program(op, mesh) if mpi4jax else None
    fns = (smddp_fn, lax_fn) + ((mpi_fn,) if mpi_fn is not None else ())
    itemsize = to_dtype(dtype).itemsize
    per_rank = [nccl_tests.input_bytes(op, size, n)
                for size in nccl_tests.row_sizes(op, sizes, n, itemsize)]
    for nbytes in per_rank:
      x = make_input(nbytes, n, dtype, mesh)
      want = numpy_reference(op, host_input(nbytes, n, dtype), n) if check else None
      where = f"jax_smddp {op} ({format_size(nbytes)}/rank, {to_dtype(dtype).name})"
      got = smddp_fn(x)
      # nccl-tests' #wrong (None: not checked, -c 0); a wrong answer still stops
      wrong = count_wrong(dtype, got, want) if check else None
      if wrong:
        bad = wrong_shards(dtype, got, want)
        raise AssertionError(f"{where} differs from numpy in {wrong} elements of this "
                             "process's shards: " + "; ".join(bad))
      if mpi_fn is not None and check:
        mpi_bad = wrong_shards(dtype, mpi_fn(x), want)
        if mpi_bad:
          raise AssertionError(f"mpi4jax {op} ({format_size(nbytes)}/rank) differs from numpy: "
                               + "; ".join(mpi_bad))
      # nccl-tests' rounding can leave a row 0 bytes, which jax.lax's all_gather and
      # reduce_scatter cannot lower: the row's baseline is then not run (N/A).
      run = [fn for fn in fns if fn is smddp_fn or nbytes or _lowers(fn, x)]
      got_lax = lax_fn(x) if lax_fn in run else None
      lax_wrong = count_wrong(dtype, got_lax, want) if check and got_lax is not None else None
      lax_bad = wrong_shards(dtype, got_lax, want) if lax_wrong else []
      if lax_bad and baseline == "self":
        raise AssertionError(f"{where}, its second program, differs from numpy: "
                             + "; ".join(lax_bad))
      if lax_bad:
        log.warning("jax.lax %s (%s/rank) differs from numpy (JAX's answer is wrong; jax_smddp's "
                    "is right): %s", op, format_size(nbytes), "; ".join(lax_bad))
      k = iters_for(n * nbytes * spec.total_factor(n), iters)
      for _ in range(warmup):  # here, so that the phases count the timed calls alone
        for fn in run:
          fn(x).block_until_ready()
      before = meter.read()
      phases = call_phases(op) if across else None
      starts, cpu = [[] for _ in run], [[] for _ in run]
      sent = [{} for _ in run] if interfaces else None
      samples = TIMINGS[timing](run, x, k, 0, starts=starts, cpu=cpu, sent=sent)
      after = meter.read()
      if lax_fn not in run:  # N/A: no samples
        for lists, empty in ((samples, []), (starts, []), (cpu, []), (sent, {})):
          if lists is not None:
            lists.insert(1, empty)
      t_smddp, t_lax = (statistics.median(s) if s else None for s in samples[:2])
      result = {
          "op": op, "bytes_per_rank": nbytes, "iters": k, "warmup": warmup,
          "engine": uses_engine(smddp_fn, x, spec.target),
          "baseline_engine": uses_engine(lax_fn, x, spec.target) if t_lax else None,
          "smddp": {**bandwidths(spec, nbytes, n, t_smddp), "min_us": min(samples[0]) * 1e6},
          "lax": {**bandwidths(spec, nbytes, n, t_lax), "min_us": min(samples[1]) * 1e6}
                 if t_lax else {"time_us": None, "algbw_gbs": None, "busbw_gbs": None},
          "speedup": t_lax / t_smddp if t_lax else None,
          "lax_wrong": bool(lax_bad),
          "wrong": {"smddp": wrong, "lax": lax_wrong},  # this process's shards
          "baseline_name": baseline,
          "timing": timing,
          "other_load": {"cores": round(CpuMeter.other_cores(before, after), 3),
                         "seconds": round(after[0] - before[0], 4)},
          "samples_us": {"smddp": _us(samples[0]), "lax": _us(samples[1])},
          "starts_us": {"smddp": _us(starts[0]), "lax": _us(starts[1])},
          "cpu_us": {"smddp": _us(cpu[0]), "lax": _us(cpu[1])},
      }
      if sent is not None:
        names = ("smddp", "lax", "mpi4jax")
        result["sent_per_call"] = {names[j]: {i: round(b / k) for i, b in sorted(d.items())}
                                   for j, d in enumerate(sent)}
      if phases is not None:  # the timed calls'; process 0's when printed
        result["smddp_phases"] = phase_means(phases, call_phases(op))
        result["smddp"]["mean_us"] = statistics.mean(samples[0]) * 1e6
      if mpi_fn is not None and mpi_fn in run:
        t_mpi = statistics.median(samples[2])
        result["mpi4jax"] = {**bandwidths(spec, nbytes, n, t_mpi), "min_us": min(samples[2]) * 1e6}
        result["vs_mpi4jax"] = t_mpi / t_smddp
        result["samples_us"]["mpi4jax"] = _us(samples[2])
        result["starts_us"]["mpi4jax"] = _us(starts[2])
        result["cpu_us"]["mpi4jax"] = _us(cpu[2])
      results.append(add_p90(result))
      if report:
        report(result)
      del x
  return results


def _lowers(fn, x) -> bool:
  try:
    fn.lower(x)
    return True
  except Exception:  # noqa: BLE001 (a lowering error of any kind; mpi4jax's has no lower)
    return False


def metadata(layout: "Layout | int", dtype: str, memcpy_gbs: float,
             topology: dict | None = None, baseline: str = "lax") -> dict:
  """Machine, software and layout of this run (`layout`: a Layout, or a device
  count for one process)."""
  import jax
  import jaxlib
  if isinstance(layout, int):
    layout = Layout(1, 1, layout)
  meta = {
      "machine": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
      "jax_smddp": capabilities.version(),
      "layout": layout.as_dict(),
      "dtype": to_dtype(dtype).name,
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "memcpy_gbs": memcpy_gbs,
      "baseline": baseline,
      "jax_smddp_settings": config.non_default(),  # the JAX_SMDDP_* settings not at default
      "definitions": {
          "bytes_per_rank": "input buffer bytes of one rank",
          "time_us": "median wall time of one jitted call incl. block_until_ready "
                     "(process 0's, in multi-process layouts)",
          "algbw_gbs": "S / time; S = n*bytes_per_rank for all_gather, bytes_per_rank "
                       "otherwise (nccl-tests' size)",
          "busbw_gbs": "algbw * (n-1)/n, or * 2(n-1)/n for all_reduce",
          "size": "nccl-tests' size S in bytes: all_gather's whole output (n x one rank's "
                  "input), reduce_scatter's whole input (n x one rank's output), all_reduce's "
                  "buffer, all_to_all's buffer of one rank (nccl_tests.py)",
          "count": "nccl-tests' count: all_gather one rank's input elements, reduce_scatter one "
                   "rank's output elements, all_reduce the buffer's, all_to_all one rank's "
                   "block for one peer",
          "type, redop, root": "nccl-tests' names: float/half/double/bfloat16/int32...; sum or "
                               "none; -1",
          "time, algbw, busbw": "jax_smddp's out-of-place time_us, algbw_gbs, busbw_gbs under "
                                "nccl-tests' names",
          "#wrong": "output elements of jax_smddp's answer (checked once against numpy, every "
                    "process's shards summed) that differ; a wrong answer stops the run",
          "in_place": "N/A (None): JAX's in place is a donated input aliased to the output; "
                      "not run",
          "baseline_time, baseline_algbw, baseline_busbw, baseline_#wrong": "the same of the "
                                                                            "baseline",
          "busbw_vs_nccl_tests, time_vs_nccl_tests": "with --nccl-tests: our busbw / theirs, "
                                                     "our time / theirs (same op and S)",
          "baseline": "what the \"lax\" entries time: jax.lax's collective (gloo across "
                      "processes), or \"self\": a second compiled copy of jax_smddp's program "
                      "(its speedups show the noise alone)",
          "baseline_engine": "whether the baseline's program calls jax_smddp",
          "speedup": "lax (baseline) time / smddp time",
          "speedup_interval": "[low, high]: the 90 % bootstrap interval of the speedup, "
                              "resampling each implementation's calls (containing 1.0: these "
                              "calls cannot tell the two apart)",
          "memcpy_us": "the bytes one process writes (its devices' outputs) at memcpy_gbs, "
                       "the single-thread np.copyto bandwidth: a reference, not a limit",
          "vs_memcpy": "memcpy_us / smddp time (above 1: faster than np.copyto, as "
                       "streaming stores can be)",
          "min_us": "fastest of the timed calls (the least disturbed by other load)",
          "p90_us": "90th percentile of the timed calls, taken over the processes as time_us; "
                    "the table marks it ! above 1.5 x time_us",
          "samples_us": "every timed call, in order (process 0's)",
          "starts_us": "each timed call's start, time.perf_counter() in us (one clock for the "
                       "machine's processes)",
          "cpu_us": "each timed call's CPU time in this process, time.process_time() in us "
                    "(every thread, the kernel's work for them included)",
          "after_arrival": "multi-process layouts: each call timed from the last process's start "
                           "to the last process's end (time_us, their median; samples_us), and "
                           "skew_us, the median of how far apart the processes started, and "
                           "cpu_us, the median over calls of the CPU time all processes used; "
                           "after_arrival_speedup and after_arrival_interval from those",
          "other_load": "cores: CPUs kept busy by anything but this benchmark job (other "
                        "users, steal) on average while the point was timed, from /proc",
          "link": "layouts of several hosts: the link between the simulated hosts measured "
                  "raw in the same run (jax_smddp.tools.link_probe: TCP sockets, both ways at "
                  "once), each_way_gbs",
          "link_us": "the bytes each host must receive from the others "
                     "(interhost_bytes_per_host: its own ranks' data combined first) at the "
                     "link's rate each way",
          "vs_link": "link_us / time: the fraction of the link a call used (1: at the link's "
                     "rate)",
          "link_floor_us": "capped links: link_us less what full token buckets pass at once "
                           "(meta link_burst_bytes), the least time a call can take",
      },
  }
  if layout.multi_process:
    meta["lax_cpu_collectives"] = "gloo"
    meta["fabric_provider"] = (topology or {}).get("fabric_provider")
    meta["topology"] = topology
  return meta


# --------------------------------------------------------------------------- model

def model_layout(layout: "Layout"):
  """The plain model layout (the tuner caches choices by it)."""
  return cost_model.Layout(layout.hosts, layout.processes_per_host, layout.devices_per_process)


def annotate(r: dict, layout: "Layout", predict: bool = False, machine=None,
             memcpy_gbs: float | None = None, link_gbs: float | None = None,
             burst_bytes: int = 0) -> dict:
  """Adds the tuner's choice for this call ("choice": what
  jax_smddp.tuning.choose answers for this op, size and layout), with
  `memcpy_gbs` the memcpy reference ("memcpy_us"; smddp "vs_memcpy" = memcpy_us /
  time), with `link_gbs` (layouts of several hosts) the link reference
  ("link_us"; "vs_link" = link_us / time, for jax_smddp and jax.lax), the
  bytes the busiest host sends by the model, for jax_smddp's algorithms and gloo's ring
  ("predicted_sent": {"smddp", "lax"}, layouts of several hosts), the speedup's
  bootstrap interval from the row's calls ("speedup_interval", interval.py) and, with
  `predict`, the cost model's prediction ("prediction"; smddp "predicted_us")."""
  from jax_smddp import tuning
  samples = r.get("samples_us") or {}
  if samples.get("smddp") and samples.get("lax"):
    r["speedup_interval"] = speedup_interval(samples["smddp"], samples["lax"])
  if memcpy_gbs:
    r["memcpy_us"] = memcpy_us(r["op"], r["bytes_per_rank"], layout, memcpy_gbs)
    r["smddp"]["vs_memcpy"] = r["memcpy_us"] / r["smddp"]["time_us"]
  if layout.hosts > 1:
    r["predicted_sent"] = {"smddp": interhost_bytes_per_host(r["op"], r["bytes_per_rank"], layout),
                           "lax": ring_bytes_per_host(r["op"], r["bytes_per_rank"], layout)}
  if link_gbs and layout.hosts > 1:
    r["link_us"] = link_us(r["op"], r["bytes_per_rank"], layout, link_gbs)
    if burst_bytes:
      r["link_floor_us"] = link_us(r["op"], r["bytes_per_rank"], layout, link_gbs, burst_bytes)
    r["smddp"]["vs_link"] = r["link_us"] / r["smddp"]["time_us"]
    r["lax"]["vs_link"] = r["link_us"] / r["lax"]["time_us"] if r["lax"]["time_us"] else None
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
