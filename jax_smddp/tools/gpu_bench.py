"""GPU benchmark of jax_smddp's all_gather, reduce_scatter and all_reduce (and
all_to_all on request), nccl-tests style.

    python -m jax_smddp.tools.gpu_bench [--processes N] [--sizes 1M,16M,256M | -b 1M -e 256M -f 2]
                                  [--ops all_gather,reduce_scatter,all_reduce,all_to_all]
                                  [--json FILE] [--csv FILE] [--nccl-tests LOG]
                                  [--hosts H [--fabric-hmem 0,auto]] [--direct-reads 0,1]
    mpirun -n 8 python -m jax_smddp.tools.gpu_bench -b 1M -e 256M   # across a launched job
    srun -n 16 python -m jax_smddp.tools.gpu_bench -b 1M -e 256M

Every run first prints nccl-tests' table (jax_smddp.tools.bench.nccl_tests, the CPU
benchmark's definitions): size S and count as nccl-tests prints them, the out-of-place time,
algbw, busbw and #wrong (0: every answer was checked, and a wrong one stops the run), in-place
N/A (not run: in JAX in place is a donated, aliased input), then XLA's (NCCL) time, algbw,
busbw beside it where it ran (--processes 1, or a launched job with a GPU per process) and
speedup = XLA time / jax_smddp time. ``-b/-e/-f/-i`` give nccl-tests' rows for each op, of the
size S it prints (nccl_tests.round_size: a rank's block a whole 16 bytes, all_reduce's buffer as
given; a row nccl-tests prints at 0 bytes is left out here); ``--nccl-tests LOG`` (or OP:LOG)
puts a saved nccl-tests output beside it, matched by op and S. Under a launcher (Open MPI's
mpirun, Slurm's srun, or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID:
:mod:`jax_smddp.job`) every process of the job benchmarks the GPU its launcher gave it, once,
with the JAX_SMDDP_* settings it was started with (--modes, --fabric-hmem and --direct-reads
start processes of their own and are refused there); process 0 reports.

Layouts: ``--processes 1`` uses every local GPU in one process and times
JAX's default (XLA's NCCL) in the same run; ``--processes N`` (N > 1) starts N
processes that share GPU 0 (CUDA IPC between processes on one device), where
NCCL cannot run, so the reference is the device-to-device copy bandwidth
measured in the same run (by process 0 alone, the others idle at a barrier).
Each size runs in both data-movement modes (copy engines, and copy kernels
within JAX_SMDDP_GPU_MAX_BLOCKS blocks).

``--hosts H`` names the processes as H simulated hosts (JAX_SMDDP_HOST_ID),
so the groups cross hosts: the hierarchical algorithms and the network proxy
over libfabric (JAX_SMDDP_FABRIC_PROVIDER, e.g. shm). ``--fabric-hmem 0,auto``
times each setting of JAX_SMDDP_FABRIC_HMEM in the same run: network slots
staged through host memory, or in device memory where this libfabric can
register it; the "slots" column says which ran. ``--direct-reads 0,1`` times
each setting of JAX_SMDDP_GPU_DIRECT_READS in the same run: inputs staged
through the slots, or read in place by the peers (CUDA IPC of XLA's
buffers); the "direct" column says whether the calls did read in place.

Sizes are per rank shard: all_gather gathers n shards, reduce_scatter reduces
n-shard inputs to one shard, all_reduce reduces n-shard buffers, all_to_all
exchanges n-shard buffers; so every op handles S = n x size bytes per rank, as
nccl-tests counts them. Columns: time per call (median over groups of 5 calls
issued back to back and waited for once, as nccl-tests times; "synced us" is the
median of single calls each waited for, the latency a program that waits on
every call sees; "host us" is process 0's custom-call handler time per call on the host,
its buffer exchange with the peers and its enqueues), algbw = S / time, busbw = algbw x (n - 1) / n (x 2 for
all_reduce), and "moved" = n x busbw, bytes all ranks together received from
peers per second: the figure to compare with one device's copy bandwidth when
every rank shares that device's memory. "written/copy" counts instead the bytes
all ranks wrote to their outputs per second (n x S for all_gather, all_reduce
and all_to_all, S for reduce_scatter) against that copy rate: a protocol that
copies every byte of every output once, and nothing else, reaches 1.0, where
"moved/copy" is capped at (n - 1) / n by each rank's copy of its own shard. For
reduce_scatter and all_reduce, "read/copy" counts the bytes the ranks'
reductions read per second (n sources of size each, per rank) against the copy
rate, and "vs kernel" compares the call with one bare reduction kernel of the
same sources within the same block budget (JAX_SMDDP_GPU_MAX_BLOCKS, the
"blocks" column), timed by process 0 alone: what the budget allows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from jax_smddp import _collectives, capabilities
from jax_smddp.tools import launch
from jax_smddp.tools.bench import core, nccl_tests
from jax_smddp.tools.sizes import parse_size

OPS = _collectives.MODELLED
DEFAULT_OPS = OPS[:3]


PIPELINE = 5  # calls in flight between syncs when timing back to back


def _time(f, x, iters: int, depth: int = 1) -> float:
  """Median seconds per call: of single calls each waited for (depth 1: the
  latency a program that waits sees), or of `depth` calls issued back to back
  and waited for once (what the device sustains, as nccl-tests times), over
  at least 3 groups. The warm-up is a whole group: `depth` outputs alive at
  once grow XLA's memory pool (cudaMalloc) the first time, which a timed
  group must not pay (on an H200 it made back-to-back calls look 3-10x
  slower than waited-for ones, for whichever op of a run came first)."""
  ys = [f(x) for _ in range(depth)]
  ys[-1].block_until_ready()
  del ys
  times = []
  for _ in range(max(iters // depth, 3)):
    t0 = time.perf_counter()
    ys = [f(x) for _ in range(depth)]
    ys[-1].block_until_ready()
    times.append((time.perf_counter() - t0) / depth)
  return statistics.median(times)


def _bodies(op: str):
  """(jax_smddp body, jax.lax body) of `op` on a rank's flat f32 input: the CPU benchmark's
  calls over mesh axis "x", each rank's output one row."""
  ours, lax = core.op_calls()[op]
  return lambda v: ours(v, "x")[None], lambda v: lax(v, "x")[None]


def _input_shards(op: str, n: int) -> int:
  """A rank's input in shards (a rank's block to one peer): 1 for all_gather, n otherwise."""
  return n ** -_collectives.spec(op).block_power


def _output_shards(op: str, n: int) -> int:
  """A rank's output in shards: n, or 1 for reduce_scatter."""
  return _collectives.output_bytes(op, _input_shards(op, n), n)


def _input(op: str, rank: int, n: int, local: int):
  """Rank `rank`'s input of `local` elements: r + 1 everywhere, or for all_to_all block k (for
  rank k) holds 1000 (k + 1) + r + 1, so a block from the wrong rank or for
  the wrong rank shows."""
  import numpy as np
  if op == "all_to_all":
    return np.repeat(1000 * np.arange(1, n + 1, dtype=np.float32) + rank + 1, local // n)
  return np.full((local,), rank + 1, np.float32)


def _rows(op: str, args, n: int) -> list[tuple[int, int]]:
  """(a rank's input elements, nccl-tests' size S) of each row of `op`: with -b/-e/-f/-i
  nccl-tests' rows (nccl_tests.round_size; 0-byte rows left out: XLA cannot lower a collective
  of nothing), else each --sizes shard (all_gather's input; n of them the others')."""
  if args.sweep:
    sizes = [s for s in nccl_tests.row_sizes(op, args.sweep, n, 4) if s]
    return [(nccl_tests.input_bytes(op, s, n) // 4, s) for s in sizes]
  local = [shard // 4 * _input_shards(op, n) for shard in args.sizes]
  return [(c, nccl_tests.size_of(op, 4 * c, n)) for c in local]


def _alone(args, tag: str, measure):
  """measure(), run by process 0 alone (None elsewhere): the processes share the
  GPU, and a reference timed by all of them at once would see each a share of
  it, so the others wait at a barrier, their GPU work done, until process 0 has
  measured."""
  if args.nprocs == 1:
    return measure()
  from jax_smddp import distributed
  client = distributed._client()
  client.wait_at_barrier(f"jax_smddp/gpu_bench/{tag}/idle", 120_000)
  result = measure() if args.process == 0 else None
  client.wait_at_barrier(f"jax_smddp/gpu_bench/{tag}/measured", 120_000)
  return result


def _copy_reference(ext, nbytes: int, args, tag: str):
  """The device-to-device copy rate for `nbytes`, measured by process 0 alone
  (None elsewhere, and on CPU)."""
  return _alone(args, f"{tag}/copy", lambda: ext.copy_bandwidth(0, nbytes, 10) if ext else None)


def _reduce_reference(ext, size: int, n: int, args, tag: str):
  """Seconds one bare reduction kernel takes to combine `n` sources of `size`
  bytes (what each rank of reduce_scatter and all_reduce reduces) within the
  same block budget (JAX_SMDDP_GPU_MAX_BLOCKS), timed by process 0 alone like
  the copy reference (None elsewhere, and on CPU)."""
  if ext is None:
    return None
  blocks = ext.settings()["max_blocks"]
  return _alone(args, f"{tag}/reduce", lambda: ext.reduce_seconds(0, size, n, blocks, 10))


def worker(args) -> dict:
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import jax_smddp
  from jax_smddp import _native, config
  if getattr(args, "job", None) is not None:
    from jax_smddp import job as job_mod
    job_mod.initialize(args.job)  # the GPU the launcher gave this process
  elif args.nprocs > 1:
    jax.distributed.initialize(args.coordinator, args.nprocs, args.process, local_device_ids=[0])
  if args.hosts > 1:
    jax_smddp.initialize()  # the links between the simulated hosts
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  ext = _native.cuda_engine() if jax.default_backend() == "gpu" else None
  rows = []
  for op in args.ops:
    ours_body, lax_body = _bodies(op)
    ours = jax.jit(jax.shard_map(ours_body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    lax = jax.jit(jax.shard_map(lax_body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for local, nccl_size in _rows(op, args, n):  # a rank's input in elements, nccl-tests' S
      size = 4 * local // _input_shards(op, n)  # "size": one shard of it (bytes)
      # Built shard by shard: a device_put of a global value would check it
      # across processes with XLA's collectives, which cannot run two ranks on one GPU.
      # Rank r's input is r + 1 everywhere: a misplaced block or a missing rank shows.
      x = jax.make_array_from_callback(
          (n * local,), sharding,
          lambda idx, op=op, local=local: _input(op, (idx[0].start or 0) // local, n, local))
      wrong = _check(op, ours(x), n, local)  # every local rank's output is back: its GPU is idle
      copy_Bps = _copy_reference(ext, size * n, args, f"{op}/{size}")
      before = dict(ext.counters()) if ext else {}
      row = {"op": op, "bytes_per_rank": size, "size": nccl_size, "ranks": n,
             "mode": config.value("JAX_SMDDP_GPU_COPIES"),
             "smddp_s": _time(ours, x, args.iters, PIPELINE),
             "synced_s": _time(ours, x, args.iters), "copy_Bps": copy_Bps, "#wrong": wrong}
      after = dict(ext.counters()) if ext else {}
      row["direct_calls"] = (after["direct_reads"] - before["direct_reads"]) if ext else 0
      calls = after.get("handler_calls", 0) - before.get("handler_calls", 0)
      # This process's handlers' host time per call (the exchange with the peers and the
      # enqueues), over the timed calls of both timings.
      row["host_s"] = (after["handler_ns"] - before["handler_ns"]) / calls / 1e9 if calls else None
      if _collectives.reduces(op):
        row["max_blocks"] = ext.settings()["max_blocks"] if ext else None
        row["reduce_ref_s"] = _reduce_reference(ext, size, n, args, f"{op}/{size}")
      if args.nprocs == 1 or getattr(args, "job", None) is not None:  # NCCL can run here
        row["xla_s"] = _time(lax, x, args.iters, PIPELINE)
      if args.hosts > 1:
        chosen = jax_smddp.gpu.groups_across_hosts().values() if ext else []
        row["hosts"] = args.hosts
        row["slots"] = ("device" if any(g["device_slots"] for g in chosen) else "host") \
            if chosen else "-"
      rows.append(row)
  return {"ok": True, "rows": rows,
          "counters": jax_smddp.gpu.counters() if ext else {},
          "direct_staged_because": jax_smddp.gpu.direct_reads_staged_because() if ext else ""}


def _expected(op: str, rank: int, n: int, local: int):
  """Rank `rank`'s output for the inputs of _input (`local` elements each)."""
  import numpy as np
  if op == "all_gather":
    return np.repeat(np.arange(1, n + 1, dtype=np.float32), local)
  if op == "all_to_all":  # block q came from rank q, which filled it for this rank
    return np.repeat(1000 * (rank + 1) + np.arange(1, n + 1, dtype=np.float32), local // n)
  # a reduction: every element n (n + 1) / 2, the sum of the ranks' r + 1
  return np.full((_collectives.output_bytes(op, local, n),), n * (n + 1) / 2, np.float32)


def _check(op: str, y, n: int, local: int) -> int:
  """The benchmark times right answers only: every local rank's output once. Returns the wrong
  elements (nccl-tests' #wrong), 0 unless it raises."""
  import numpy as np
  for shard in y.addressable_shards:
    rank = shard.index[0].start or 0
    got, want = np.asarray(shard.data)[0], _expected(op, rank, n, local)
    if not np.array_equal(got, want):
      bad = np.flatnonzero(got != want)
      raise AssertionError(f"{op}: rank {rank} output differs from the reference at {bad.size} "
                           f"of {want.size} elements (first {bad[:5]})")
  return 0


def _op(row: dict) -> str:
  """A row's op: rows written before the GPU bench ran other ops were all_gather's."""
  return row.get("op", "all_gather")


def _busbw(op: str, n: int, alg: float) -> float:
  return alg * nccl_tests.bus_factor(op, n)


def nccl_figures(r: dict, key: str = "smddp_s") -> dict:
  """A row's size S, count, type, redop, root, time (us), algbw and busbw as nccl-tests
  prints them (nccl_tests.py): each rank's input is its shard (all_gather) or n shards, so
  S = n x shard for every op; `key` the time (smddp_s, or xla_s)."""
  op, n = _op(r), r["ranks"]
  inp = _input_shards(op, n) * r["bytes_per_rank"]
  size = r.get("size") or nccl_tests.size_of(op, inp, n)  # the worker's: nccl-tests' S
  return {**nccl_tests.row_head(op, size, n, "float32", 4),
          **nccl_tests.figures(op, size, n, r[key])}


def nccl_rows(rows: list[dict], processes: int) -> list[dict]:
  """The rows with nccl-tests' fields (nccl_tests.CSV_COLUMNS' names) added, for the table,
  the JSON and the CSV."""
  for r in rows:
    r.update(nccl_figures(r))
    r.update({"#wrong": r.get("#wrong", 0), "processes": processes, "min_time": None,
              "in_place_time": None, "in_place_algbw": None, "in_place_busbw": None,
              "in_place_#wrong": None})
    if r.get("xla_s"):
      base = nccl_figures(r, "xla_s")
      r.update({"baseline": "XLA (NCCL)", "baseline_time": base["time"],
                "baseline_algbw": base["algbw"], "baseline_busbw": base["busbw"],
                "baseline_#wrong": None, "speedup": r["xla_s"] / r["smddp_s"]})
  return rows


def nccl_report(rows: list[dict], baseline: str = "XLA (NCCL)") -> str:
  """nccl-tests' table of every op and mode: out of place, in place (N/A), XLA's."""
  out = []
  for key in dict.fromkeys((_op(r), r.get("mode")) for r in rows):
    sel = [r for r in rows if (_op(r), r.get("mode")) == key]
    out.append(f"# {key[0]} ({nccl_tests.NAMES[key[0]][0]}), mode {key[1]}: {sel[0]['ranks']} "
               "ranks; nccl-tests' columns (in place N/A: not run)")
    out.append(nccl_tests.header(["out-of-place", "in-place", baseline], [("speedup", "", 7)]))
    for r in sel:
      base = ({"time": r["baseline_time"], "algbw": r["baseline_algbw"],
               "busbw": r["baseline_busbw"]} if r.get("baseline_time") else None)
      speed = f"{r['speedup']:.2f}" if r.get("speedup") else "N/A"
      out.append(nccl_tests.row(r, [r, None, base], [(speed, 7)]))
  return "\n".join(out)


def _slots(row: dict) -> str:
  """Across hosts: the JAX_SMDDP_FABRIC_HMEM setting and where the network
  slots were (host: staged, device: registered with libfabric)."""
  if row.get("hosts", 1) == 1:
    return "-"
  return f"{row.get('fabric_hmem', '0')}:{row.get('slots', '-')}"


def _direct(row: dict) -> str:
  """JAX_SMDDP_GPU_DIRECT_READS and whether the timed calls read in place."""
  return f"{row.get('direct_reads', '0')}:{'in place' if row.get('direct_calls') else 'staged'}"


def reduction_ratios(r: dict) -> tuple[float | None, float | None]:
  """For reduce_scatter and all_reduce: (read/copy, vs kernel). Every rank's
  reduction reads n sources of `bytes_per_rank` (its shard of every rank's
  input), so all ranks read n^2 x size per call: read/copy is that per second
  against the device's copy rate; "vs kernel" is the time one bare reduction
  kernel of the same sources and block budget took (alone) over the call's
  time: 1.0 when the collective costs no more than its reduction."""
  if not _collectives.reduces(_op(r)):
    return None, None
  n, t = r["ranks"], r["smddp_s"]
  read = n * n * r["bytes_per_rank"] / t
  copy = r.get("copy_Bps") or 0
  ref = r.get("reduce_ref_s")
  return (read / copy if copy else None), (ref / t if ref else None)


def metrics(r: dict) -> dict:
  """The figures of a row against its references (None where one is missing),
  stored beside it in the JSON: moved/copy, written/copy, read/copy, vs kernel."""
  op, n, t = _op(r), r["ranks"], r["smddp_s"]
  alg = r["bytes_per_rank"] * n / t
  moved = _busbw(op, n, alg) * n
  written = alg * _output_shards(op, n)  # output bytes, all ranks
  copy = r.get("copy_Bps") or 0
  read, vs_kernel = reduction_ratios(r)
  return {"moved_per_copy": moved / copy if copy else None,
          "written_per_copy": written / copy if copy else None,
          "read_per_copy": read, "vs_kernel": vs_kernel}


def _ratio(v: float | None) -> str:
  return "-" if v is None else f"{v:.2f}"


def report(rows: list[dict]) -> str:
  out = [f"{'op':>14} {'size/rank':>10} {'ranks':>5} {'mode':>7} {'time us':>9} {'algbw GB/s':>10} "
         f"{'busbw':>8} {'moved':>8} {'copy GB/s':>9} {'moved/copy':>10} {'written/copy':>12} "
         f"{'read/copy':>9} {'vs kernel':>9} {'blocks':>6} "
         f"{'XLA busbw':>9}"
         f"{'hosts':>6} {'hmem:slots':>11} {'direct':>10} {'synced us':>9} {'host us':>7}"]
  for r in rows:
    op, n, t = _op(r), r["ranks"], r["smddp_s"]
    alg = r["bytes_per_rank"] * n / t / 1e9
    bus = _busbw(op, n, alg)
    moved = bus * n
    written = alg * _output_shards(op, n)  # output bytes, all ranks
    copy = (r["copy_Bps"] or 0) / 1e9
    xla = ""
    if "xla_s" in r:
      xla = f"{_busbw(op, n, r['bytes_per_rank'] * n / r['xla_s'] / 1e9):9.1f}"
    read, vs_kernel = reduction_ratios(r)
    out.append(f"{op:>14} {r['bytes_per_rank'] >> 10:>9}K {n:>5} {r['mode']:>7} {t * 1e6:>9.1f} "
               f"{alg:>10.1f} {bus:>8.1f} {moved:>8.1f} {copy:>9.1f} "
               f"{moved / copy if copy else 0:>10.2f} {written / copy if copy else 0:>12.2f} "
               f"{_ratio(read):>9} {_ratio(vs_kernel):>9} {r.get('max_blocks') or '-':>6} "
               f"{xla:>9}"
               f"{r.get('hosts', 1):>6} {_slots(r):>11} {_direct(r):>10} "
               f"{r['synced_s'] * 1e6 if r.get('synced_s') else 0:>9.1f} "
               f"{r['host_s'] * 1e6 if r.get('host_s') else 0:>7.1f}")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--sizes", default="1M,4M,16M,64M,256M",
                 help="each rank's shard (S = n x shard for every op); -b/-e replace it")
  p.add_argument("-b", "--min-bytes", default=None,
                 help="smallest size S as nccl-tests counts it (nccl-tests' -b)")
  p.add_argument("-e", "--max-bytes", default=None, help="largest size S (nccl-tests' -e)")
  p.add_argument("-f", "--step-factor", type=int, default=2,
                 help="multiplicative step between sizes (nccl-tests' -f; 1: steps of -i)")
  p.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20,
                 help="the step between sizes when -f is 1 (nccl-tests' -i)")
  p.add_argument("--csv", default=None,
                 help="one CSV line per op, size and variant with nccl-tests' columns")
  p.add_argument("--nccl-tests", action="append", default=[], metavar="LOG",
                 help="a saved nccl-tests output (or OP:LOG), as run or as a launcher kept it "
                      "(mpirun --tag-output, srun --label), to match by op and size S: busbw "
                      "and time ratios, ours / theirs; repeatable")
  p.add_argument("--sweep", default=None, help=argparse.SUPPRESS)  # workers: the S list
  p.add_argument("--ops", default=",".join(DEFAULT_OPS))
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--modes", default="engine,kernel")
  p.add_argument("--json", default=None)
  p.add_argument("--timeout", type=float, default=500)
  p.add_argument("--hosts", type=int, default=1, help="simulated hosts the processes are split into")
  p.add_argument("--fabric-hmem", default="0",
                 help="JAX_SMDDP_FABRIC_HMEM settings to time across hosts, e.g. 0,auto")
  p.add_argument("--direct-reads", default="1",
                 help="JAX_SMDDP_GPU_DIRECT_READS settings to time, e.g. 0,1 (default 1, the "
                      "library's)")
  # cpu: the same processes and programs on CPU devices (checks this script without a GPU)
  p.add_argument("--platform", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args, rest = p.parse_known_args(argv)
  args.sizes = [parse_size(s) for s in args.sizes.split(",")]
  if args.min_bytes or args.max_bytes:  # nccl-tests' sweep of S: the shards follow from n
    lo = parse_size(args.min_bytes or args.max_bytes)
    hi = parse_size(args.max_bytes or args.min_bytes)
    if lo > hi or args.step_factor < 1:
      p.error("-b must not exceed -e, and -f must be >= 1")
    args.sweep = nccl_tests.sweep(lo, hi, args.step_factor, args.stepbytes)
  elif args.sweep:
    args.sweep = [int(v) for v in args.sweep.split(",")]
  args.ops = [o.strip() for o in args.ops.split(",")]
  unknown = [o for o in args.ops if o not in OPS]
  if unknown:
    p.error(f"unknown --ops {unknown}; choose from {', '.join(OPS)}")
  if args.hosts < 1 or args.processes % args.hosts:
    p.error(f"--hosts {args.hosts} does not divide --processes {args.processes}")
  if args.worker:
    args.process, args.nprocs, args.coordinator = int(rest[0]), int(rest[1]), rest[2]
    try:
      print("RESULT " + json.dumps(worker(args)), flush=True)
    except Exception:  # reported to the launcher
      import traceback
      print("RESULT " + json.dumps({"ok": False, "error": traceback.format_exc()[-3000:]}), flush=True)
      return 1
    return 0
  try:
    logs = [table for spec in args.nccl_tests for table in nccl_tests.read_logs(spec)]
  except nccl_tests.LogError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from jax_smddp import job as job_mod
  job = job_mod.detect()
  if job is not None and job.processes > 1:
    return run_in_job(p, args, job, logs)
  rows = []
  hosts = [{"JAX_SMDDP_HOST_ID": f"bench-host{i * args.hosts // args.processes}"}
           for i in range(args.processes)] if args.hosts > 1 else None
  hmem = args.fabric_hmem.split(",") if args.hosts > 1 else [None]
  direct_settings = args.direct_reads.split(",")
  if any(d not in ("0", "1") for d in direct_settings):
    p.error(f"--direct-reads takes 0 and 1, not {args.direct_reads}")
  variants = [(mode, setting, direct) for mode in args.modes.split(",") for setting in hmem
              for direct in direct_settings]
  for mode, setting, direct in variants:
    env = {"JAX_PLATFORMS": args.platform, "JAX_SMDDP_GPU_COPIES": mode,
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_SMDDP_GPU_DIRECT_READS": direct}
    if setting is not None:
      env["JAX_SMDDP_FABRIC_HMEM"] = setting
    forwarded = ["--worker", "--sizes", ",".join(str(s) for s in args.sizes), "--iters",
                 str(args.iters), "--ops", ",".join(args.ops), "--hosts", str(args.hosts),
                 "--processes", str(args.processes)]
    if args.sweep:
      forwarded += ["--sweep", ",".join(map(str, args.sweep))]
    procs = launch.run_job(forwarded, args.processes, 1, script=["-m", "jax_smddp.tools.gpu_bench"],
                           timeout=args.timeout, env=env, per_process_env=hosts)
    if not all(q.result and q.result.get("ok") for q in procs):
      print(launch.describe(procs), file=sys.stderr)
      return 1
    for row in procs[0].result["rows"]:
      if setting is not None:
        row["fabric_hmem"] = setting
      row["direct_reads"] = direct
      row.update(metrics(row))
      rows.append(row)
    label = mode if setting is None else f"{mode}, JAX_SMDDP_FABRIC_HMEM={setting}"
    label += f", JAX_SMDDP_GPU_DIRECT_READS={direct}"
    print(f"mode {label}: counters {procs[0].result['counters']}")
    if direct == "1" and procs[0].result.get("direct_staged_because"):
      print(f"  direct reads staged because: {procs[0].result['direct_staged_because']}")
  finish(args, rows, args.processes, logs)
  return 0


def finish(args, rows: list[dict], processes: int, logs: list[dict], meta: dict | None = None):
  """nccl-tests' table, the engine's table, the --nccl-tests comparison, the JSON and CSV."""
  nccl_rows(rows, processes)
  print(nccl_report(rows, "XLA (NCCL)" if args.platform == "cuda" else "XLA (CPU)"))
  print(report(rows))
  pairs = nccl_tests.compare(rows, logs) if logs else []
  for op in args.ops:
    table = nccl_tests.comparison_table(op, pairs)
    if table:
      print(table)
  # meta: run-wide facts (the job, versions) beside the rows
  meta = {"jax_smddp": capabilities.version(), **(meta or {})}
  if pairs:
    meta["nccl_tests"] = pairs
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"processes": processes, "hosts": args.hosts, "meta": meta, "rows": rows}, f,
                indent=1)
  if args.csv:
    nccl_tests.write_csv(args.csv, rows)


def run_in_job(p, args, job, logs) -> int:
  """This process's part of the benchmark across a launched job: the GPU its launcher gave it,
  the settings it was started with; process 0 reports."""
  import os
  for flag, value, default in (("--modes", args.modes, "engine,kernel"),
                               ("--fabric-hmem", args.fabric_hmem, "0"),
                               ("--direct-reads", args.direct_reads, "1")):
    if value != default:
      p.error(f"{flag} starts processes of its own, but this process is one of the "
              f"{job.processes} processes of a {job.launcher} job: set the JAX_SMDDP_* "
              "variable in the job's environment instead")
  if args.hosts != 1:
    p.error(f"--hosts lays out processes of its own; this {job.launcher} job has "
            f"{job.processes} (--processes is ignored in a job)")
  os.environ.setdefault("JAX_PLATFORMS", args.platform)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.platform == "cpu" and "xla_force_host_platform_device_count" not in \
      os.environ.get("XLA_FLAGS", ""):
    from jax_smddp import job as job_mod
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               + job_mod.cpu_device_flag(job.processes, job)).strip()
  args.job, args.process, args.nprocs, args.coordinator = job, job.process, job.processes, None
  try:
    result = worker(args)
  except Exception as e:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    print(f"error: process {job.process} of the {job.launcher} job: {type(e).__name__}: {e}",
          file=sys.stderr, flush=True)
    os._exit(1)  # peers waiting in a collective: do not wait for jax.distributed's shutdown
  if job.lead:
    from jax_smddp import config
    rows = result["rows"]
    for row in rows:
      row["direct_reads"] = config.value("JAX_SMDDP_GPU_DIRECT_READS")
      row.update(metrics(row))
    print(f"# {job.launcher} job: {job.processes} processes, process 0's times; counters "
          f"{result['counters']}")
    finish(args, rows, job.processes, logs,
           {"job": {"launcher": job.launcher, "processes": job.processes,
                    "local_size": job.local_size, "coordinator": job.coordinator}})
  import jax
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
