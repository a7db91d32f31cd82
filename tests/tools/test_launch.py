"""The launcher of multi-process jobs (jax_smddp.tools.launch), without jax."""

import os
import sys

import pytest

from jax_smddp.tools import launch

# Process 1 prints far more than a pipe holds (64 KiB), then a RESULT line, then lets
# process 0 finish; process 0 waits for it, as jax.distributed's shutdown does.
_SCRIPT = """
import json, os, sys, time
i, n, marker = int(sys.argv[-4]), int(sys.argv[-3]), sys.argv[-5]
if i == 1:
  for k in range(4096):
    print("x" * 255, flush=False)
  print("RESULT " + json.dumps({"ok": True, "rows": list(range(50000))}), flush=True)
  open(marker, "w").close()
else:
  deadline = time.monotonic() + 60
  while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.01)
  print("RESULT " + json.dumps({"ok": os.path.exists(marker)}), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_process_with_much_output_does_not_stall_the_job(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_SCRIPT)
  procs = launch.run_job([str(tmp_path / "marker")], 2, 1, script=str(script), timeout=30)
  assert [p.returncode for p in procs] == [0, 0], launch.describe(procs)
  assert procs[0].result == {"ok": True}
  assert procs[1].result["rows"] == list(range(50000))
  assert procs[1].output.count("x" * 255) == 4096


@pytest.mark.timeout(120)
def test_a_job_past_its_deadline_is_killed_and_says_so(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text("import time\ntime.sleep(60)\n")
  procs = launch.run_job([], 2, 1, script=str(script), timeout=2)
  assert [p.returncode for p in procs] == [-9, -9]  # SIGKILL
  assert all("killed after the job's 2 s deadline" in p.output for p in procs)


@pytest.mark.timeout(120)
def test_an_interpreter_given_by_a_relative_path_is_found(tmp_path, monkeypatch):
  """The processes run in the temporary directory: a relative interpreter path (as
  sys.executable is when python was found through a relative PATH entry) must still work."""
  script = tmp_path / "worker.py"
  script.write_text('print("RESULT {\\"ok\\": true}")\n')
  here = os.path.dirname(sys.executable)
  monkeypatch.chdir(here)
  python = os.path.join(".", os.path.basename(sys.executable))
  procs = launch.run_job([], 2, 1, script=str(script), timeout=60, python=python)
  assert [p.returncode for p in procs] == [0, 0], launch.describe(procs)
  assert all(p.result == {"ok": True} for p in procs)
