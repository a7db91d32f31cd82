"""The job scripts of examples/ (examples/p4d_p5.sbatch) as a cluster's bash runs them:
shellcheck finds nothing, no array that may be empty is expanded as "${a[@]}" (under set -u bash
before 4.4, Amazon Linux 2's 4.2, stops on it: "unbound variable"; bash 5 does not, so a run here
cannot catch it), and a saved nccl-tests log whose NCCL log does not say it used EFA stops the
script before it starts anything. The script under a real Slurm and under mpirun:
tests/multiprocess/test_launchers.py."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_CI = os.environ.get("CI") == "true"
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "examples", "*.sbatch")) +
                 glob.glob(os.path.join(REPO, "examples", "*.sh")))
JOB_SCRIPT = os.path.join(REPO, "examples", "p4d_p5.sbatch")
SAMPLE_LOG = os.path.join(REPO, "tests", "tools", "data", "nccl_tests_all_gather_2ranks.log")

# ${a[@]} or ${a[*]} (quoted or not, sliced or not), but not ${#a[@]} (a count, safe) and not the
# guarded form ${a[@]+"${a[@]}"}, which expands to nothing when a is empty in every bash.
EXPANSION = re.compile(r"\$\{(\w+)\[[@*]\]")
GUARDED = re.compile(r'\$\{(\w+)\[@\]\+"\$\{\1\[@\]\}"\}')


def _shellcheck() -> str:
  path = shutil.which("shellcheck")
  if path is None:
    why = "shellcheck is not installed (scripts/system_packages.sh installs it: apt-get install shellcheck)"
    assert not IN_CI, why
    pytest.skip(why)
  return path


def unguarded_array_expansions(text: str) -> list[str]:
  """The lines (number: text) of a bash script that expand an array without the guard bash
  before 4.4 needs under set -u where the array may be empty; comment lines are left out."""
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("#"):
      continue
    if EXPANSION.search(GUARDED.sub("", line)):
      found.append(f"{number}: {line.strip()}")
  return found


def test_there_are_job_scripts():
  assert JOB_SCRIPT in SCRIPTS, SCRIPTS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_shellcheck_finds_nothing(script):
  run = subprocess.run([_shellcheck(), "--shell=bash", "--external-sources", script], cwd=REPO,
                       capture_output=True, text=True, timeout=100)
  assert run.returncode == 0, f"shellcheck {os.path.relpath(script, REPO)}:\n{run.stdout}{run.stderr}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_bash_before_4_4_expands_no_array_that_may_be_empty(script):
  with open(script) as f:
    text = f.read()
  bad = unguarded_array_expansions(text)
  assert not bad, (f"{os.path.relpath(script, REPO)}: under set -u bash < 4.4 (Amazon Linux 2) "
                   "stops at an empty array's \"${a[@]}\"; write ${a[@]+\"${a[@]}\"}:\n"
                   + "\n".join(bad))
  run = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
  assert run.returncode == 0, run.stderr


def test_the_array_check_tells_guarded_from_unguarded():
  """The check itself, on the forms it must tell apart."""
  assert unguarded_array_expansions('srun "${compare[@]}"\nx=${a[*]}\nfor i in ${b[@]:1}; do :; done') \
      == ['1: srun "${compare[@]}"', "2: x=${a[*]}", "3: for i in ${b[@]:1}; do :; done"]
  assert unguarded_array_expansions('srun ${compare[@]+"${compare[@]}"}\nn=${#a[@]}\n# "${c[@]}"') \
      == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tail,says", [
    ("", "nothing about its network"),
    ("node-01:41021:41100 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is tcp (found 1 nics)\n"
     "node-01:41021:41100 [0] NCCL INFO Using network Libfabric\n",
     "Selected provider is tcp"),
], ids=["no NCCL log", "tcp"])
def test_a_saved_baseline_not_run_over_efa_stops_the_job_before_it_starts(tmp_path, tail, says):
  """NCCL_TESTS_LOG without aws-ofi-nccl's "Selected provider is efa": the script exits
  non-zero naming the log, what NCCL used and what to do, and launches nothing."""
  log = tmp_path / "all_gather_perf.log"
  log.write_text(open(SAMPLE_LOG).read() + tail)
  hosts = tmp_path / "hosts"
  hosts.write_text("localhost slots=2\n")
  launched = tmp_path / "launched"
  mpirun = tmp_path / "mpirun"
  mpirun.write_text(f"#!/bin/sh\ntouch {launched}\n")
  mpirun.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_TESTS_"))}
  env.update(HOSTFILE=str(hosts), MPIRUN=str(mpirun), NCCL_TESTS_LOG=str(log),
             OUT=str(tmp_path / "out"), TASKS_PER_NODE="2")
  run = subprocess.run(["bash", JOB_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=100)
  assert run.returncode != 0, run.stdout + run.stderr
  assert f"ERROR: {log}: NCCL's INFO log does not say it used the efa provider" in run.stderr, \
      run.stderr
  assert says in run.stderr and "NCCL_TESTS_NEED_EFA=0" in run.stderr, run.stderr
  assert not launched.exists(), "the script launched tasks before it checked the saved log"


RECORDED = ("LD_LIBRARY_PATH", "PYTHONSAFEPATH", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
            "FI_EFA_FORK_SAFE", "FI_EFA_SET_CUDA_SYNC_MEMOPS", "NCCL_NET", "NCCL_NET_PLUGIN",
            "NCCL_BUFFSIZE", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_NVLS_CHUNKSIZE",
            "NCCL_NVLSTREE_MAX_CHUNKSIZE", "NCCL_NET_FORCE_FLUSH", "NCCL_DEBUG", "NCCL_DEBUG_FILE",
            "JAX_SMDDP_REQUIRE", "JAX_PLATFORMS")


def _dry_run(tmp_path, launcher: str, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
  """The job script with `launcher` (srun or mpirun) replaced by a stand-in that records its
  arguments and the settings it was given, one call per step, and launches nothing; nccl-tests'
  all_gather_perf is on PATH (never run), the EFA installer and aws-ofi-nccl in tmp_path."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  record = tmp_path / "calls"
  names = " ".join(RECORDED)
  fake = bin_dir / launcher
  fake.write_text("#!/bin/bash\n{ echo CALL; printf 'ARG %s\\n' \"$@\"\n"
                  f"  for v in {names}; do echo \"ENV $v=${{!v-<unset>}}\"; done; }} >>{record}\n")
  (bin_dir / "all_gather_perf").write_text("#!/bin/sh\nexit 0\n")
  for f in bin_dir.iterdir():
    f.chmod(0o755)
  for lib in ("efa/lib", "ofi-nccl/lib"):
    (tmp_path / lib).mkdir(parents=True)
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("SLURM_", "NCCL_", "FI_", "JAX_", "OMPI_", "PMIX_"))}
  base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", LD_LIBRARY_PATH="/site/lib",
              EFA_PREFIX=str(tmp_path / "efa"), OFI_NCCL_PREFIX=str(tmp_path / "ofi-nccl"),
              OUT=str(tmp_path / "out"), NCCL_TESTS_NEED_EFA="0", **env)
  run = subprocess.run(["bash", JOB_SCRIPT], cwd=REPO, env=base, capture_output=True, text=True,
                       timeout=100)
  calls = []
  for line in record.read_text().splitlines() if record.exists() else []:
    if line == "CALL":
      calls.append({"args": [], "env": {}})
    elif line.startswith("ARG "):
      calls[-1]["args"].append(line[4:])
    else:
      name, _, value = line[4:].partition("=")
      calls[-1]["env"][name] = value
  return run, calls


def _steps(calls: list[dict]) -> dict:
  """The calls by step: doctor, nccl-tests, bench, example."""
  keys = {"jax_smddp.doctor": "doctor", "all_gather_perf": "nccl-tests",
          "jax_smddp.tools.bench": "bench", "examples/fsdp_train.py": "example"}
  return {keys[k]: c for c in calls for k in keys if k in c["args"]}


def _efa_environment(env: dict, tmp_path, p5: bool):
  assert env["LD_LIBRARY_PATH"] == f"{tmp_path}/efa/lib:{tmp_path}/ofi-nccl/lib:/site/lib", env
  assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == \
      ("efa", "1", "1"), env
  assert (env["NCCL_NET"], env["NCCL_NET_PLUGIN"]) == ("AWS Libfabric", "ofi"), env
  assert (env["NCCL_BUFFSIZE"], env["NCCL_P2P_NET_CHUNKSIZE"]) == ("8388608", "524288"), env
  p5_only = (env["NCCL_NVLS_CHUNKSIZE"], env["NCCL_NVLSTREE_MAX_CHUNKSIZE"],
             env["NCCL_NET_FORCE_FLUSH"])
  assert p5_only == (("524288", "524288", "0") if p5 else ("<unset>",) * 3), env
  assert (env["JAX_SMDDP_REQUIRE"], env["JAX_PLATFORMS"], env["PYTHONSAFEPATH"]) == \
      ("efa,cuda", "cuda", "1"), env


@pytest.mark.timeout(120)
def test_under_slurm_every_step_is_bound_and_has_the_efa_environment(tmp_path):
  """Two p5 nodes of 8 tasks and 192 CPUs: each step is one srun with GPUs left visible and 24
  CPUs per task in blocks bound to their NUMA node, nccl-tests under PMIx with NCCL's INFO log
  to a file per process and SYNC_MEMOPS off (for it only), the p5 settings in every step."""
  run, calls = _dry_run(tmp_path, "srun", SLURM_JOB_ID="7", SLURM_NTASKS="16",
                        SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="8",
                        SLURM_CPUS_ON_NODE="192", INSTANCE_TYPE="p5.48xlarge")
  assert run.returncode == 0, run.stdout + run.stderr
  steps = _steps(calls)
  assert list(steps) == ["doctor", "nccl-tests", "bench", "example"], calls
  for name, call in steps.items():
    assert {"--gpu-bind=none", "--cpus-per-task=24", "--distribution=block:block",
            "--cpu-bind=ldoms"} <= set(call["args"]), (name, call["args"])
    _efa_environment(call["env"], tmp_path, p5=True)
  nccl = steps["nccl-tests"]
  assert "--mpi=pmix" in nccl["args"] and all("--mpi" not in a for s in ("doctor", "bench",
                                                                       "example")
                                              for a in steps[s]["args"]), calls
  assert (nccl["env"]["NCCL_DEBUG"], nccl["env"]["FI_EFA_SET_CUDA_SYNC_MEMOPS"]) == ("INFO", "0")
  assert nccl["env"]["NCCL_DEBUG_FILE"] == f"{tmp_path}/out/nccl_debug/%h.%p.log"
  assert steps["bench"]["env"]["FI_EFA_SET_CUDA_SYNC_MEMOPS"] == "<unset>", steps["bench"]
  bench = steps["bench"]["args"]
  assert bench[bench.index("--nccl-tests") + 1] == f"{tmp_path}/out/all_gather_perf.log", bench
  example = steps["example"]["args"]
  assert example[example.index("--mesh") + 1] == "16" and example[example.index("--batch") + 1] \
      == "32", example
  # The stand-in wrote no NCCL log: NCCL_TESTS_NEED_EFA=0 warns and goes on.
  assert "WARNING: nccl-tests on this job: NCCL's INFO log does not say" in run.stderr, run.stderr


@pytest.mark.timeout(120)
def test_without_slurm_mpirun_runs_every_step_over_the_hostfile_with_the_environment(tmp_path):
  """Two p4d hosts in a hostfile: each step is one mpirun of 16 tasks, 4 per NUMA node bound to
  it, passing on (-x) every setting the script made and the paths; no p5 settings."""
  hosts = tmp_path / "hosts"
  hosts.write_text("# p4d nodes\nnode-a slots=8\n  node-b slots=8\n\n")
  run, calls = _dry_run(tmp_path, "mpirun", HOSTFILE=str(hosts), INSTANCE_TYPE="p4d.24xlarge",
                        MPIRUN_ARGS="--mca pml ^ucx")
  assert run.returncode == 0, run.stdout + run.stderr
  steps = _steps(calls)
  assert list(steps) == ["doctor", "nccl-tests", "bench", "example"], calls
  for name, call in steps.items():
    args = call["args"]
    assert args[:9] == ["--mca", "pml", "^ucx", "--hostfile", str(hosts), "-n", "16",
                        "--map-by", "ppr:4:numa"] and args[9:11] == ["--bind-to", "numa"], args
    passed = {args[i + 1] for i, a in enumerate(args) if a == "-x"}
    assert {"PATH", "LD_LIBRARY_PATH", "PYTHONSAFEPATH", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
            "FI_EFA_FORK_SAFE", "NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_BUFFSIZE",
            "NCCL_P2P_NET_CHUNKSIZE", "JAX_SMDDP_REQUIRE", "JAX_PLATFORMS"} <= passed, (name, args)
    _efa_environment(call["env"], tmp_path, p5=False)
  assert {"NCCL_DEBUG", "NCCL_DEBUG_FILE", "FI_EFA_SET_CUDA_SYNC_MEMOPS"} <= \
      {a for a in steps["nccl-tests"]["args"]}, steps["nccl-tests"]
  example = steps["example"]["args"]
  assert example[example.index("--mesh") + 1] == "16", example


@pytest.mark.timeout(60)
def test_a_hostfile_without_hosts_is_named(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("# nodes to come\n\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  run = subprocess.run(["bash", JOB_SCRIPT], cwd=REPO, env={**env, "HOSTFILE": str(hosts)},
                       capture_output=True, text=True, timeout=30)
  assert run.returncode == 2 and f"no tasks: HOSTFILE={hosts} names no host" in run.stderr, \
      (run.returncode, run.stderr)
