"""The job this process belongs to, as its launcher describes it, and joining it.

Cluster jobs are started by a launcher, one process per GPU: Slurm's ``srun``,
Open MPI's ``mpirun`` (4 or 5), or anything that sets the job in the
environment. :func:`detect` reads what the launcher set, without importing jax
(a program must size its CPU devices in ``XLA_FLAGS`` before it imports jax);
:func:`initialize` joins the job with ``jax.distributed.initialize``. Every
process of the job must call it::

    from jax_smddp import job
    me = job.initialize()          # None outside a job of several processes
    # ... jax.process_count() == me.processes

Where each launcher's job is read from, first match wins:

``environment``  ``JAX_COORDINATOR_ADDRESS`` (process 0's host:port, the same in
                 every process) with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
                 ``JAX_LOCAL_RANK``/``JAX_LOCAL_SIZE`` when several processes share
                 a host (default: the process id / the count, as on one host).
``slurm``        ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
                 ``SLURM_STEP_TASKS_PER_NODE``; the coordinator is the step's first
                 node (``SLURM_STEP_NODELIST``) on a port derived from the job and
                 step ids.
``openmpi``      ``mpirun``: ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/
                 ``_LOCAL_SIZE``. The coordinator is on mpirun's host (as JAX's own
                 Open MPI support assumes: process 0 runs there): Open MPI 4 names it
                 in ``OMPI_MCA_orte_hnp_uri``; Open MPI 5 sets no such variable (so
                 JAX's detection misses it) and its ``PMIX_NAMESPACE`` reads
                 ``prterun-<host>-<pid>@<job>``; a job whose processes all run on
                 one host uses 127.0.0.1. The port is derived from the job's id.

``JAX_COORDINATOR_PORT`` replaces a derived port; ``JAX_COORDINATOR_ADDRESS``
replaces a derived address in any launcher's job (where process 0 does not run
on mpirun's host, say).

On GPUs, a process whose host has at least as many visible GPUs as the job has
processes there takes the GPU of its local rank (``local_device_ids``), unless
``JAX_LOCAL_DEVICE_IDS`` says otherwise; where there are fewer (processes
sharing one GPU, or a launcher that already gave each its own through
``CUDA_VISIBLE_DEVICES``) it keeps what it sees. On CPU each process makes its
own devices: :func:`cpu_device_flag` is its share of a mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib

# A port in the ephemeral range's top 4096, derived from the job's id, as JAX's launchers do.
_PORT_BASE, _PORT_SPAN = 65536 - 4096, 4096


@dataclasses.dataclass(frozen=True)
class Job:
  """A job of `processes` processes; this one is `process`, the `local_rank`-th of the
  `local_size` on its host. `launcher`: environment, slurm or openmpi."""
  launcher: str
  coordinator: str
  processes: int
  process: int
  local_rank: int
  local_size: int

  @property
  def lead(self) -> bool:
    """Whether this process reports (process 0)."""
    return self.process == 0


class JobError(RuntimeError):
  """A launcher's job that cannot be joined as described (what is wrong, what to set)."""


def _int(environ, name: str) -> int:
  try:
    return int(environ[name])
  except (KeyError, ValueError):
    raise JobError(f"jax_smddp.job: {name}={environ.get(name)!r} is not a number; a launcher's "
                   "job needs the process count and this process's index") from None


def _port(environ, job_id: str) -> int:
  if environ.get("JAX_COORDINATOR_PORT"):
    return _int(environ, "JAX_COORDINATOR_PORT")
  return _PORT_BASE + zlib.crc32(job_id.encode()) % _PORT_SPAN


def first_host(nodelist: str) -> str:
  """The first host of a Slurm host list: ``node[003-005,009],gpu7`` -> ``node003``."""
  m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
  prefix, ranges = m.group(1), m.group(2)
  if not ranges:
    return prefix
  return prefix + re.split(r"[,-]", ranges)[0]


def tasks_on_node(tasks_per_node: str, node: int) -> int:
  """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``4(x2),3``: 4 on nodes 0 and 1, 3 on node 2)
  read for node `node`."""
  left = node
  for item in tasks_per_node.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
    if m is None:
      raise JobError(f"jax_smddp.job: cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    count, repeat = int(m.group(1)), int(m.group(2) or 1)
    if left < repeat:
      return count
    left -= repeat
  raise JobError(f"jax_smddp.job: SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} has no node "
                 f"{node}")


def _environment(environ) -> Job | None:
  if not environ.get("JAX_COORDINATOR_ADDRESS") or "JAX_NUM_PROCESSES" not in environ:
    return None
  if "JAX_PROCESS_ID" not in environ:
    raise JobError("jax_smddp.job: JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES are set but "
                   "JAX_PROCESS_ID is not: give every process its index, 0 to N-1")
  processes = _int(environ, "JAX_NUM_PROCESSES")
  process = _int(environ, "JAX_PROCESS_ID")
  local_size = _int(environ, "JAX_LOCAL_SIZE") if "JAX_LOCAL_SIZE" in environ else processes
  local_rank = _int(environ, "JAX_LOCAL_RANK") if "JAX_LOCAL_RANK" in environ else process
  return Job("environment", environ["JAX_COORDINATOR_ADDRESS"], processes, process, local_rank,
             local_size)


def _slurm(environ) -> Job | None:
  if "SLURM_PROCID" not in environ or "SLURM_STEP_NODELIST" not in environ:
    return None  # (sbatch's batch script itself has no step: it is not a task of one)
  processes = _int(environ, "SLURM_NTASKS" if "SLURM_NTASKS" in environ else "SLURM_NPROCS")
  job_id = f"{environ.get('SLURM_JOB_ID', '')}.{environ.get('SLURM_STEP_ID', '')}"
  host = first_host(environ["SLURM_STEP_NODELIST"])
  local_size = (tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], _int(environ, "SLURM_NODEID"))
                if "SLURM_STEP_TASKS_PER_NODE" in environ and "SLURM_NODEID" in environ
                else processes)
  coordinator = environ.get("JAX_COORDINATOR_ADDRESS") or f"{host}:{_port(environ, job_id)}"
  return Job("slurm", coordinator, processes, _int(environ, "SLURM_PROCID"),
             _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0, local_size)


def _openmpi(environ) -> Job | None:
  if "OMPI_COMM_WORLD_SIZE" not in environ or "OMPI_COMM_WORLD_RANK" not in environ:
    return None
  processes = _int(environ, "OMPI_COMM_WORLD_SIZE")
  local_size = (_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
                if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ else processes)
  hnp = environ.get("OMPI_MCA_orte_hnp_uri", "")  # Open MPI 4: "<jobid>.0;tcp://ip,ip:port"
  namespace = environ.get("PMIX_NAMESPACE", "")    # Open MPI 5: "prterun-<host>-<pid>@<job>"
  job_id = hnp.split(";")[0] or namespace
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    coordinator = environ["JAX_COORDINATOR_ADDRESS"]
  else:
    if local_size == processes:
      host = "127.0.0.1"
    elif m := re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", hnp):
      host = m.group(1) or m.group(2)
    elif m := re.fullmatch(r"prterun-(.+)-\d+@\d+", namespace):
      host = m.group(1)
    else:
      raise JobError(
          "jax_smddp.job: this Open MPI job spans hosts and its environment does not name "
          "mpirun's host (no OMPI_MCA_orte_hnp_uri, PMIX_NAMESPACE="
          f"{namespace!r}): set JAX_COORDINATOR_ADDRESS=<process 0's host>:<port> for every "
          "process (mpirun -x JAX_COORDINATOR_ADDRESS=...)")
    coordinator = f"{host}:{_port(environ, job_id)}"
  return Job("openmpi", coordinator, processes, _int(environ, "OMPI_COMM_WORLD_RANK"),
             _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
             if "OMPI_COMM_WORLD_LOCAL_RANK" in environ else 0, local_size)


LAUNCHERS = (("environment", _environment), ("slurm", _slurm), ("openmpi", _openmpi))


def detect(environ=None) -> Job | None:
  """The job the launcher started this process in (None when no launcher's variables are
  set). Reads the environment only: no jax import, nothing joined. Raises JobError when a
  launcher's variables are there but do not describe a job that can be joined."""
  environ = os.environ if environ is None else environ
  for _, read in LAUNCHERS:
    found = read(environ)
    if found is not None:
      if not 0 <= found.process < found.processes or not 0 <= found.local_rank < found.local_size:
        raise JobError(f"jax_smddp.job: the {found.launcher} job says process {found.process} "
                       f"of {found.processes}, local rank {found.local_rank} of "
                       f"{found.local_size}: not a process of that job")
      return found
  return None


def local_env(processes: int, process: int, coordinator: str) -> dict:
  """The environment of process `process` of a job of `processes` on this host, as a local
  launcher (the example's --processes, the tests) sets it for :func:`detect`."""
  return {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(processes),
          "JAX_PROCESS_ID": str(process), "JAX_LOCAL_RANK": str(process),
          "JAX_LOCAL_SIZE": str(processes)}


def cpu_device_flag(mesh_devices: int, job: Job | None) -> str:
  """The ``XLA_FLAGS`` item that gives this process its share of a mesh of `mesh_devices`
  CPU devices (all of them outside a job)."""
  share = mesh_devices if job is None else max(mesh_devices // job.processes, 1)
  return f"--xla_force_host_platform_device_count={share}"


def _visible_gpus(environ) -> int:
  """GPUs this process could see, counted without initializing CUDA."""
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
  try:
    return len(os.listdir("/proc/driver/nvidia/gpus"))
  except OSError:
    return 0


def local_device_ids(job: Job, environ=None) -> list[int] | None:
  """The GPU this process takes (its local rank) where its host has one for each of the
  job's processes there; None (keep what it sees) on CPU, where JAX_LOCAL_DEVICE_IDS is
  set, or where processes share GPUs or each sees only its own."""
  environ = os.environ if environ is None else environ
  platforms = environ.get("JAX_PLATFORMS", "").lower()
  if environ.get("JAX_LOCAL_DEVICE_IDS") or (platforms and not
                                             re.search(r"\b(cuda|gpu)\b", platforms)):
    return None
  if job.local_size > 1 and _visible_gpus(environ) >= job.local_size:
    return [job.local_rank]
  return None


def initialize(job: Job | None = None, *, timeout_s: int | None = None) -> Job | None:
  """Joins `job` (default: :func:`detect`'s) with ``jax.distributed.initialize``; returns
  it, or None when there is no job of several processes to join (nothing is done). Call it
  in every process, before the first use of jax's devices."""
  job = detect() if job is None else job
  if job is None or job.processes < 2:
    return job
  import jax
  kwargs = {} if timeout_s is None else {"initialization_timeout": int(timeout_s)}
  try:
    # "deactivate": JAX's own detection would otherwise give a process under srun or Open MPI
    # 4 the GPU of its local rank even where it sees only its own, or shares one.
    jax.distributed.initialize(coordinator_address=job.coordinator,
                               num_processes=job.processes, process_id=job.process,
                               local_device_ids=local_device_ids(job),
                               cluster_detection_method="deactivate", **kwargs)
  except Exception as e:
    raise JobError(
        f"jax_smddp.job: process {job.process} of {job.processes} ({job.launcher}) could not "
        f"join the job at coordinator {job.coordinator}: {type(e).__name__}: {e}. Every process "
        "must start, and process 0 must be able to listen on that address (set "
        "JAX_COORDINATOR_ADDRESS=<process 0's host>:<free port> to choose it).") from e
  return job
