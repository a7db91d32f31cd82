"""What this jax_smddp installation can do on this machine, and why not.

    python -m jax_smddp.doctor            # this machine
    python -m jax_smddp.doctor --job      # also the job's topology, in every process of a
                                          # jax.distributed job (as launched for training)
    python -m jax_smddp.doctor --json     # the same, as JSON
    python -m jax_smddp.doctor --settings # every setting (docs/settings.md)

From a program: ``jax_smddp.doctor.report(job=True)`` returns the rows, and
``print(jax_smddp.doctor.render(...))`` prints them. The exit code is 0 when
what the machine offers can be used: the extension matches the running jaxlib
and every requirement of ``JAX_SMDDP_REQUIRE`` is met; 2 when ``--job`` finds no
job to join (it then says what a job needs). A missing optional part
(libfabric, CUDA, GDRCopy) is shown with what it costs, not counted as a
failure unless required.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

OK, MISSING, INFO, FAIL = "ok", "missing", "info", "FAIL"


@dataclasses.dataclass
class Row:
  component: str
  status: str   # ok | missing (optional part absent) | info | FAIL (job cannot use it)
  detail: str


@dataclasses.dataclass
class Report:
  rows: list[Row]
  usable: bool  # exit code 0

  def to_json(self) -> dict:
    return {"usable": self.usable, "rows": [dataclasses.asdict(r) for r in self.rows]}


def _gib(n: int) -> str:
  return f"{n / 2**30:.1f} GiB"


def _versions(rows: list[Row]) -> bool:
  import jax
  import jaxlib.version
  import platform
  from jax_smddp import capabilities
  rows.append(Row("jax_smddp", INFO, f"jax_smddp {capabilities.version()} ({platform.system()} "
                  f"{platform.machine()}, Python {platform.python_version()})"))
  rows.append(Row("jax", INFO, f"jax {jax.__version__}, jaxlib {jaxlib.version.__version__}"))
  built = capabilities.build()
  same = built["jaxlib"] == jaxlib.version.__version__
  detail = f"built for jaxlib {built['jaxlib']} (XLA FFI API {built['ffi_api']})"
  if not same:
    detail += (f", but jaxlib {jaxlib.version.__version__} runs: rebuild jax_smddp against it, "
               "from its source checkout: python -m pip install --no-build-isolation --no-deps "
               "--force-reinstall . (add -e for a development install)")
  rows.append(Row("extension", OK if same else FAIL, detail))
  return same


def _cpu(rows: list[Row]) -> None:
  from jax_smddp import _native
  rows.append(Row("CPU backend", OK, f"engine loaded ({os.path.basename(_native.engine().__file__)}); "
                  f"collectives across devices, processes (shared memory) and hosts (libfabric)"))


def _cuda(rows: list[Row]) -> None:
  from jax_smddp import capabilities
  c = capabilities.cuda()
  if not c["built"]:
    rows.append(Row("CUDA backend", MISSING, c["error"] + "; GPU collectives lower to XLA's"))
    return
  if c["error"]:
    rows.append(Row("CUDA backend", MISSING, f"built; {c['error']}"))
    return
  major, minor = divmod(c["driver"] // 10, 100)
  rows.append(Row("CUDA backend", OK, f"built; driver API {major}.{minor}, {len(c['devices'])} GPU(s), "
                  f"stream memory operations {'yes' if c['stream_memops'] else 'no (flags by kernels)'}"))
  for i, d in enumerate(c["devices"]):
    if "error" in d:
      rows.append(Row(f"  GPU {i}", FAIL, d["error"]))
      continue
    mode = {0: "default", 1: "exclusive thread", 2: "prohibited", 3: "exclusive process"}.get(
        d["compute_mode"], str(d["compute_mode"]))
    rows.append(Row(f"  GPU {i}", OK if d["compute_mode"] in (0, 3) else FAIL,
                    f"{d['name']}, compute capability {d['compute_capability']}, "
                    f"{d['multiprocessors']} SMs, {_gib(d['memory_bytes'])}, "
                    f"{d['copy_engines']} copy engines, CUDA IPC "
                    f"{'yes' if d['unified_addressing'] else 'no (no unified addressing)'}, "
                    f"fd handles {'yes' if d['posix_fd_handles'] else 'no'}, compute mode {mode}"))
  m = capabilities.mps()
  rows.append(Row("  MPS", OK if m["running"] else INFO,
                  f"control daemon at {m['pipe']}" if m["running"] else
                  m["error"] + ": processes sharing a GPU should run under MPS"))


def _fabric(rows: list[Row]) -> None:
  from jax_smddp import capabilities
  f = capabilities.fabric()
  if not f["built"]:
    rows.append(Row("libfabric", MISSING, f["error"] + ": processes on other hosts cannot be "
                    "reached (one host still works)"))
    return
  where = f"built with headers from {f['include_dir']}" if f["include_dir"] else "built"
  if not f["loaded"]:
    rows.append(Row("libfabric", MISSING, f"{where}; {f['error']}"))
    return
  rows.append(Row("libfabric", OK, f"{f['path']} (API {f['version']}); {where}"))
  efa = "efa" in f["providers"]
  rows.append(Row("  providers", OK if f["providers"] else MISSING,
                  ", ".join(f["providers"]) or "none usable for reliable datagrams"))
  rows.append(Row("  efa", OK if efa else INFO,
                  "available: the default between hosts" if efa else
                  f"not available: between hosts jax_smddp uses {f['default_provider']} "
                  "(or JAX_SMDDP_FABRIC_PROVIDER)"))
  for e in f["env_defaults"]:
    whose = "jax_smddp's default" if e["set_by"] == "jax_smddp" else "set in the environment"
    rows.append(Row(f"  {e['name']}", INFO, f"{e['value']} ({whose})"))


def _gdrcopy(rows: list[Row]) -> None:
  from jax_smddp import capabilities
  g = capabilities.gdrcopy()
  rows.append(Row("GDRCopy", OK if not g["error"] else MISSING,
                  f"{g['library']} and the gdrdrv driver" if not g["error"] else
                  g["error"] + "; GPU step flags use mapped host memory instead"))


def _shm(rows: list[Row]) -> None:
  from jax_smddp import capabilities
  s = capabilities.shared_memory()
  if s["error"]:
    rows.append(Row("/dev/shm", FAIL, s["error"] + ": processes on one host cannot share memory"))
    return
  # Each pair of processes on a host maps two rings (JAX_SMDDP_SHM_RING_BYTES each way).
  rows.append(Row("/dev/shm", OK, f"{_gib(s['size_bytes'])}, {_gib(s['free_bytes'])} free"))


def _heap(rows: list[Row]) -> None:
  """How glibc's heap is kept for XLA's output buffers (JAX_SMDDP_HEAP_REUSE_BYTES)."""
  from jax_smddp import capabilities
  h = capabilities.heap_reuse()
  if h["bytes"] <= 0:
    rows.append(Row("host outputs", INFO, f"glibc's malloc policy left alone ({h['reason']}): "
                    "outputs above its mmap threshold are mapped afresh, and zeroed, every call"))
    return
  when = "since this process's first CPU collective" if h["applied"] else \
      "once this process sets up its first CPU collective"
  rows.append(Row("host outputs", OK, f"glibc keeps allocations up to {h['bytes'] / 2**20:g} MiB "
                  f"in its heap {when} (output buffers reused, not re-faulted)"))
  a = capabilities.malloc_arenas()
  if a["arenas"] > 0:
    rows.append(Row("malloc arenas", OK, f"at most {a['arenas']} since jax_smddp was imported "
                    "(XLA's device threads allocate from the heap kept above)"))
  else:
    rows.append(Row("malloc arenas", INFO, f"glibc's default ({a['reason']}): XLA's device threads "
                    "allocate from heaps of their own, which the policy above keeps when they empty "
                    "(M_TOP_PAD)"))


def _xla_swap(rows: list[Row]) -> None:
  """Whether XLA's own cross-process CPU collectives run on jax_smddp (xla_swap)."""
  from jax_smddp.swap import xla as xla_swap
  if not xla_swap.requested():
    rows.append(Row("XLA collectives", INFO, "gloo across processes (JAX_SMDDP_COLLECTIVES=xla "
                    "before Python starts runs them, jit/pjit included, on jax_smddp)"))
    return
  try:
    lib = xla_swap._check_library()
  except RuntimeError as e:
    rows.append(Row("XLA collectives", FAIL, str(e)))
    return
  rows.append(Row("XLA collectives", OK, f"on jax_smddp across processes (MPITRAMPOLINE_LIB={lib})"))


def _nccl_swap(rows: list[Row]) -> None:
  """Whether XLA's GPU collectives run on jax_smddp (the NCCL API front end, nccl_swap):
  loaded in this process or why not, the real NCCL it forwards to, what it forwarded."""
  from jax_smddp import requirements
  from jax_smddp.swap import nccl as nccl_swap
  state, detail = nccl_swap.status()
  try:
    strict = "no-fallback" in (requirements.required() if os.environ.get(requirements.ENV) else ())
  except ValueError:  # an invalid setting: the settings and requirements rows say so
    strict = False
  status = {"active": OK, "ready": OK, "off": INFO, "blocked": FAIL,
            "missing": FAIL if strict else MISSING}[state]
  rows.append(Row("XLA GPU collectives", status, detail))


def _settings(rows: list[Row]) -> None:
  from jax_smddp import config
  try:
    config.validate()
  except ValueError as e:
    rows.append(Row("settings", FAIL, str(e)))
  set_here = sorted(k for k in os.environ if k.startswith("JAX_SMDDP_"))
  detail = ", ".join(f"{k}={os.environ[k]}" for k in set_here) or "none set (defaults)"
  rows.append(Row("settings", INFO, f"{detail}; timeout {config.timeout():g} s"))


def _requirements(rows: list[Row]) -> bool:
  from jax_smddp import requirements
  try:
    names = requirements.required()
  except ValueError as e:
    rows.append(Row("requirements", FAIL, str(e)))
    return False
  if not names:
    rows.append(Row("requirements", INFO, f"{requirements.ENV} unset: fallbacks are logged "
                    "at WARNING level and run"))
    return True
  failures = requirements.unmet(names)
  for name in names:
    why = dict(failures).get(name)
    rows.append(Row(f"require {name}", FAIL if why else OK, why or "met"))
  return not failures


def _job(rows: list[Row]) -> None:
  import jax
  import jax_smddp
  from jax_smddp import distributed
  if jax.process_count() == 1:
    rows.append(Row("job", INFO, "one process (start it as a jax.distributed job for the topology)"))
    return
  jax_smddp.initialize()
  topo = jax_smddp.topology()
  hosts = distributed.host_of_process() or []
  order = list(dict.fromkeys(hosts))
  rows.append(Row("job", OK, f"process {topo['process']} of {topo['processes']}, "
                  f"{len(order)} host(s), {jax.device_count()} devices "
                  f"({jax.local_device_count()} here)"))
  per_host = [[p for p, h in enumerate(hosts) if h == host] for host in order]
  for i, procs in enumerate(per_host):
    rows.append(Row(f"  host {i}", INFO, f"{order[i]}: processes {procs}"))
  equal = len({len(p) for p in per_host}) == 1
  if len(order) > 1:
    rails = (f"{len(per_host[0])} rails: same-rank processes of each host exchange between hosts"
             if equal and len(per_host[0]) >= 2 else
             "direct routes (hosts hold different numbers of processes, or one each)")
    rows.append(Row("  routes", INFO, rails))
  me = topo["process"]
  links = [f"{q}: shared memory" for q in topo["shared_memory_peers"]]
  links += [f"{q}: libfabric {topo['fabric_provider']}" for q in topo["network_peers"]]
  rows.append(Row("  links", INFO, f"process {me} -> " + (", ".join(links) or "none")))
  if topo.get("nics"):
    named = ", ".join(f"{n['name']} ({n['node']})" for n in topo["nics"])
    striped = (f"; its messages to other hosts striped over {len(topo['nics'])} "
               "(JAX_SMDDP_FABRIC_STRIPE_BYTES)" if len(topo["nics"]) > 1 else "")
    rows.append(Row("  nics", INFO, f"process {me}: {named}, chosen by "
                    f"{topo['nics_chosen_by']} (JAX_SMDDP_NICS){striped}"))
  polls = topo["wait_polls"]
  rows.append(Row("  waiting", INFO,
                  ("oversubscribed: more of the job's processes on this machine than cores, "
                   if topo["oversubscribed"] else "") +
                  f"a waiting call polls {polls['spin']} times, yields until {polls['yield']}, "
                  "then sleeps (JAX_SMDDP_SPIN, JAX_SMDDP_YIELD)"))


def report(job: bool = False) -> Report:
  """Every row of the doctor's table; `job`: also the jax.distributed job's
  topology (initializes jax_smddp's links, as the first collective would)."""
  rows: list[Row] = []
  usable = _versions(rows)
  _cpu(rows)
  _cuda(rows)
  _fabric(rows)
  _gdrcopy(rows)
  _shm(rows)
  _heap(rows)
  _xla_swap(rows)
  _nccl_swap(rows)
  _settings(rows)
  usable = _requirements(rows) and usable
  usable = usable and not any(r.status == FAIL for r in rows)
  if job and usable:
    _job(rows)
  return Report(rows, usable)


def render(r: Report) -> str:
  width = max(len(row.component) for row in r.rows)
  lines = ["jax_smddp doctor"]
  for row in r.rows:
    lines.append(f"{row.component:<{width}}  {row.status:<7}  {row.detail}")
  lines.append("usable here" if r.usable else
               "NOT usable as configured: see the FAIL rows")
  return "\n".join(lines)


JOB_NEEDS = (
    "--job shows the job's topology, so it runs in every process of a job: either the "
    "process was started by a launcher (Slurm's srun, Open MPI's mpirun; jax_smddp.job reads "
    "their variables), or each process is told the job: --coordinator HOST:PORT "
    "--num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
    "JAX_PROCESS_ID), the same coordinator (process 0's address) and N everywhere, I from 0 "
    "to N-1. Without --job the doctor checks this process alone.")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_smddp.doctor", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--job", action="store_true",
                      help="also show the job's topology: run in every process of a job "
                           "(started by srun or mpirun, or given by --coordinator/"
                           "--num-processes/--process-id or their JAX_* variables); outside "
                           "one it says what it needs and exits 2")
  parser.add_argument("--coordinator", help="jax.distributed coordinator address (host:port)")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
  parser.add_argument("--settings", action="store_true",
                      help="print every setting as the docs' table (docs/settings.md), generated "
                           "from the registry, and exit")
  parser.add_argument("--test-settings", action="store_true",
                      help="print the test-only settings' table (docs/architecture.md, Tests) "
                           "and exit")
  args = parser.parse_args(argv)
  if args.settings or args.test_settings:
    from jax_smddp import config
    sys.stdout.write(config.markdown(tests=args.test_settings))
    return 0
  if args.job:
    from jax_smddp import job
    try:
      if args.coordinator or args.num_processes is not None or args.process_id is not None:
        if None in (args.coordinator, args.num_processes, args.process_id):
          raise job.JobError("give all three of --coordinator, --num-processes and "
                             "--process-id, or none (a launcher's job)")
        # (its place on its host unknown: it keeps the GPUs it sees)
        found = job.Job("arguments", args.coordinator, args.num_processes, args.process_id, 0, 1)
      else:
        found = job.detect()
      if found is None:
        raise job.JobError("no launcher's variables (srun, mpirun) and no JAX_COORDINATOR_ADDRESS "
                           "with JAX_NUM_PROCESSES and JAX_PROCESS_ID in the environment")
      job.initialize(found, timeout_s=60)
    except Exception as e:  # noqa: BLE001: any way of not joining a job is this message
      print(f"python -m jax_smddp.doctor --job: this process did not join a job "
            f"({type(e).__name__}: {e}).\n{JOB_NEEDS}", file=sys.stderr)
      return 2
  r = report(job=args.job)
  print(json.dumps(r.to_json(), indent=1) if args.json else render(r))
  return 0 if r.usable else 1


if __name__ == "__main__":
  sys.exit(main())
