"""The benchmark's core (:mod:`jax_smddp.tools.bench`): sizes, layouts, the programs of each
op, the driver (:func:`run_benchmark`), the rows' merging and the run's metadata. Its
neighbours: checks.py (inputs and numpy's answers), timing.py (the timing loops), model.py
(the layout, each row's memcpy and link references and the model's annotation); their names
are this module's too (the bench's names)."""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import platform
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jax_smddp import _collectives, capabilities, config
from jax_smddp.tools.bench import nccl_tests
from jax_smddp.tools.sizes import format_size, parse_size  # noqa: F401 (the bench's names)
from jax_smddp.tools.bench.interval import add_p90, speedup_interval
from jax_smddp.tools.bench.meter import CpuMeter
from jax_smddp.tools.bench.checks import (  # noqa: F401 (the bench's names)
    check_result, count_wrong, host_input, is_float, make_input, numpy_reference, to_dtype,
    wrong_shards)
from jax_smddp.tools.bench.model import (  # noqa: F401 (the bench's names)
    MEMCPY_BYTES, Layout, annotate, interhost_bytes_per_host, link_us, memcpy_bandwidth, memcpy_us,
    model_layout, model_meta, output_bytes_per_process, ring_bytes_per_host)
from jax_smddp.tools.bench.timing import (  # noqa: F401 (the bench's names)
    TIMINGS, interface_tx, process_barrier, settled_interface_tx, time_alternating, time_barrier,
    time_blocks, time_solo)

log = logging.getLogger("jax_smddp.tools.bench")

OPS = _collectives.MODELLED
DEFAULT_OPS = OPS[:3]

# Large sizes run fewer iterations: a sample is cut when one implementation's
# calls would move more than this many bytes in all (keeps the default run short
# on small machines); never fewer than MIN_ITERS samples.
BYTES_BUDGET = 2 << 30
MIN_ITERS = 3
# Untimed calls per implementation and row (-w): a CPU process's heap grows to a size's
# working set over its first calls, each growth a call on fresh, page-faulting memory
# (scripts/call_faults.py --op all_reduce --bytes 16M --calls 150, 2x2: most of them among
# the first 8 calls).
WARMUP = 10


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


def op_calls() -> dict[str, tuple[Callable, Callable]]:
  """How each benchmarked op is called, (jax_smddp's, jax.lax's), each (x, axis_name) -> y per
  shard; the rest is the collective's description. The GPU bench's calls too (imports jax)."""
  import jax
  import jax_smddp as smddp

  calls = {
      "all_gather": (lambda x, a: smddp.all_gather(x, a, tiled=True),
                     lambda x, a: jax.lax.all_gather(x, a, tiled=True)),
      "reduce_scatter": (lambda x, a: smddp.psum_scatter(x, a, tiled=True),
                         lambda x, a: jax.lax.psum_scatter(x, a, tiled=True)),
      "all_reduce": (lambda x, a: smddp.psum(x, a), lambda x, a: jax.lax.psum(x, a)),
      "all_to_all": (lambda x, a: smddp.all_to_all(x, a, 0, 0, tiled=True),
                     lambda x, a: jax.lax.all_to_all(x, a, 0, 0, tiled=True)),
  }
  return calls


def op_specs() -> dict[str, OpSpec]:
  """The benchmarked ops (imports jax: call after XLA_FLAGS is set)."""
  # S and busbw as nccl-tests defines them: one definition (nccl_tests.py), the GPU bench's too.
  total = lambda op: (lambda n: nccl_tests.size_of(op, 1, n))
  bus = lambda op: (lambda n: nccl_tests.bus_factor(op, n))
  calls = op_calls()
  return {op: OpSpec(op, *calls[op], total_factor=total(op), bus_factor=bus(op),
                     target="smddp_" + op) for op in OPS}


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


def uses_engine(program, x, target: str) -> bool:
  """True if the lowered program calls the plugin (not a jax.lax fallback)."""
  return target in program.lower(x).as_text()


# --------------------------------------------------------------------------- timing

def iters_for(bytes_per_call: int, iters: int) -> int:
  """`iters`, cut for large sizes so one implementation moves <= BYTES_BUDGET."""
  return max(min(iters, MIN_ITERS), min(iters, BYTES_BUDGET // max(1, bytes_per_call)))


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


def run_benchmark(ops, sizes, *, dtype="float32", iters: int = 20, warmup: int = WARMUP,
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
      moved = n * nbytes * spec.total_factor(n)
      k, w = iters_for(moved, iters), iters_for(moved, warmup)
      marks = []  # once jax_smddp is warmed up: the phases then count the timed calls alone

      def ready(j):
        if j == 0:
          marks.append((meter.read(), call_phases(op) if across else None))
      starts, cpu = [[] for _ in run], [[] for _ in run]
      sent = [{} for _ in run] if interfaces else None
      samples = TIMINGS[timing](run, x, k, w, starts=starts, cpu=cpu, sent=sent,
                                ready=ready)
      after = meter.read()
      before, phases = marks[0]
      if lax_fn not in run:  # N/A: no samples
        for lists, empty in ((samples, []), (starts, []), (cpu, []), (sent, {})):
          if lists is not None:
            lists.insert(1, empty)
      t_smddp, t_lax = (statistics.median(s) if s else None for s in samples[:2])
      result = {
          "op": op, "bytes_per_rank": nbytes, "iters": k, "warmup": w,
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
