"""`python -m jax_smddp.doctor --job` as a user types it: outside any job it says what a
job needs and exits 2 (no traceback); told the job on its command line, in every process,
it shows each process's topology."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

DOCTOR = [sys.executable, "-m", "jax_smddp.doctor", "--job"]


def _env() -> dict:
  # No launcher's variables: nothing jax.distributed could detect a job from.
  drop = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
          "KUBERNETES_SERVICE_HOST", "TPU_WORKER_ID")
  env = {k: v for k, v in os.environ.items()
         if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", [[], ["--coordinator", "127.0.0.1:1"]])
def test_outside_a_job_it_says_what_it_needs_and_exits_2(tmp_path, given):
  proc = subprocess.run(DOCTOR + given, cwd=tmp_path, env=_env(), capture_output=True,
                        text=True, timeout=100)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  err = " ".join(proc.stderr.split())
  assert "did not join a job" in err, err
  # What was missing, then every way of giving it.
  assert ("no launcher's variables" if not given else
          "give all three of --coordinator, --num-processes and --process-id") in err, err
  for way in ("srun", "mpirun", "--coordinator HOST:PORT", "JAX_COORDINATOR_ADDRESS",
              "JAX_NUM_PROCESSES", "--num-processes N", "--process-id I"):
    assert way in err, (way, err)


@pytest.mark.timeout(200)
def test_in_a_job_given_on_the_command_line_it_shows_the_topology(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  procs = [subprocess.Popen(DOCTOR + ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                      "2", "--process-id", str(i), "--json"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=180) for p in procs]
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out + err
    rows = {r["component"].strip(): r for r in json.loads(out)["rows"]}
    assert rows["job"]["detail"].startswith(f"process {i} of 2, 1 host(s), 4 devices"), rows
    assert rows["links"]["detail"] == f"process {i} -> {1 - i}: shared memory", rows
