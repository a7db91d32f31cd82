"""The benchmark across a launched job: ``mpirun -n 2 python -m jax_smddp.tools.bench ...`` (or
srun, or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID; :mod:`jax_smddp.job`).

Every process of the job is a worker, as the processes :mod:`jax_smddp.tools.launch` starts for
a layout are (:mod:`jax_smddp.tools.bench_worker`): it joins the job, runs
:func:`~jax_smddp.tools.bench.core.run_benchmark` over a 1-D mesh of every device of the job and
hands its rows to process 0 through jax.distributed's key-value store; process 0 merges them as
the layouts' driver does (slowest process, after arrival, #wrong summed), prints the tables and
writes the outputs. Nothing is started: no layout, no namespaces, no processes of its own.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

from jax_smddp.tools import bench_worker
from jax_smddp.tools.bench import core
from jax_smddp.tools.bench.options import iters_warmup, selected_sizes
from jax_smddp.tools.bench.report import report_multi_process

_KEY = "jax_smddp/bench/results/{}"
_WAIT_MS = 3_600_000  # process 0 waits for the others' rows as long as they run


def on_gpu() -> bool:
  """JAX_PLATFORMS names CUDA: each process benchmarks the GPU its launcher gave it."""
  return bool(re.search(r"\b(cuda|gpu)\b", os.environ.get("JAX_PLATFORMS", "").lower()))


def unsupported(args, job) -> str | None:
  """Why these options cannot run across `job`; None if they can."""
  where = f"this process is one of the {job.processes} processes of a {job.launcher} job"
  if getattr(args, "layout_given", False):
    return (f"--layout {args.layout.spec} starts processes of its own, but {where}: drop "
            "--layout (the job's processes are the layout), or run without the launcher")
  for flag, given in (("--compare-in-process", args.compare_in_process),
                      ("--mpi4jax", args.mpi4jax)):
    if given:
      return f"{flag} needs a layout the benchmark starts itself, but {where}: drop {flag}"
  if on_gpu() and args.devices not in (None, 1):
    return (f"--devices {args.devices}: on GPUs each process of the job benchmarks the one GPU "
            "its launcher gave it; drop --devices")
  return None


def _set_cpu_devices(args, job) -> str:
  """XLA_FLAGS for this process's CPU devices (--devices per process, default 1), unless the
  user's XLA_FLAGS already chooses a count (kept, with the rest of their flags)."""
  from jax_smddp import job as job_mod
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in flags:
    return "XLA_FLAGS"
  per = args.devices or 1
  item = job_mod.cpu_device_flag(per * job.processes, job)
  os.environ["XLA_FLAGS"] = f"{flags} {item}".strip()
  return "--devices" if args.devices else "default"


def _layout(job, per_process: int) -> core.Layout:
  hosts = job.processes // job.local_size if job.processes % job.local_size == 0 else 1
  return core.Layout(hosts, job.processes // hosts, per_process)


def run(args, job, logs: list[dict]) -> int:
  """This process's part of the benchmark across `job`; process 0 reports. Returns the exit
  status (a process that fails exits at once: its peers may be waiting in a collective)."""
  from jax_smddp import job as job_mod

  gpu = on_gpu()
  if not gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    chosen = _set_cpu_devices(args, job)
  import jax
  if not gpu:
    bench_worker.use_gloo(job.coordinator)  # the jax.lax baseline across CPU processes
  job_mod.initialize(job)
  import jax_smddp as smddp

  lead = job.process == 0
  try:
    devices = jax.devices()
    local = jax.local_devices()
    if len(devices) != len(local) * job.processes:
      raise RuntimeError(f"the job's processes have different device counts ({len(devices)} "
                         f"devices in all, {len(local)} here): give every process the same "
                         "--devices (or XLA_FLAGS device count, or GPUs)")
    layout = _layout(job, len(local))
    iters, warmup = iters_warmup(args)
    sizes = selected_sizes(args)
    memcpy_gbs = core.memcpy_bandwidth() if lead else 0.0
    if lead:
      kind = "GPU" if gpu else "CPU"
      note = "" if gpu else {"default": " (the default; --devices sets it)",
                             "--devices": " (--devices)",
                             "XLA_FLAGS": " (from your XLA_FLAGS)"}[chosen]
      print(f"# {job.launcher} job: {job.processes} processes ({job.local_size} on this host), "
            f"{len(local)} {kind} device{'s' if len(local) > 1 else ''} each{note}, "
            f"{len(devices)} ranks; {len(args.ops)} ops x {len(sizes)} sizes ...", flush=True)
    rows = core.run_benchmark(args.ops, sizes, dtype=args.dtype, iters=iters, warmup=warmup,
                              devices=devices, check=args.check > 0)
    from jax_smddp._jax_internals import jax_distributed as distributed
    client = distributed.global_state.client
    client.key_value_set(_KEY.format(job.process), json.dumps(rows))
    topology = smddp.topology()
    if lead:
      per_process = [rows] + [json.loads(client.blocking_key_value_get(_KEY.format(p), _WAIT_MS))
                              for p in range(1, job.processes)]
      _report(args, job, layout, per_process, memcpy_gbs, topology, logs, gpu)
    client.wait_at_barrier("jax_smddp/bench/reported", _WAIT_MS)
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    print(f"error: process {job.process} of the {job.launcher} job: {type(e).__name__}: {e}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # peers waiting in a collective: do not wait for jax.distributed's shutdown
  smddp.shutdown()
  jax.distributed.shutdown()
  return 0


def _report(args, job, layout, per_process, memcpy_gbs, topology, logs, gpu) -> None:
  meta = core.metadata(layout, args.dtype, memcpy_gbs, topology=topology, baseline=args.baseline)
  meta["layout"]["backend"] = "gpu" if gpu else "cpu"
  meta["job"] = {"launcher": job.launcher, "processes": job.processes,
                 "local_size": job.local_size, "coordinator": job.coordinator,
                 "devices_per_process": layout.devices_per_process, "ranks": layout.devices,
                 "platform": "gpu" if gpu else "cpu"}
  if gpu:
    meta["lax_cpu_collectives"] = None
    meta["lax_collectives"] = "NCCL (XLA's GPU collectives)"
  report_multi_process(args, layout, per_process, meta, logs,
                       lax_note=" (NCCL)" if gpu else " (gloo)")
