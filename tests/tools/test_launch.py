"""The launcher of multi-process jobs (jax_smddp.tools.launch), without jax."""

import os
import signal
import subprocess
import sys
import time

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


_LAUNCHER = """
import sys
from jax_smddp.tools import launch
launch.run_job([sys.argv[2]], 2, 1, script=sys.argv[1], timeout=120)
"""

_SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[-5], str(os.getpid())), "w").close()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(") ")[1][0] != "Z"
  except OSError:
    return False


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_the_workers_go_with_a_launcher_stopped_by_a_signal(tmp_path, sig):
  """`timeout`, a scheduler or Ctrl-C stopping the launcher (the benchmark's parent) must not leave
  its workers running: they have their own sessions, so no terminal signal reaches them."""
  (tmp_path / "launcher.py").write_text(_LAUNCHER)
  (tmp_path / "sleeper.py").write_text(_SLEEPER)
  pids = tmp_path / "pids"
  pids.mkdir()
  launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"),
                               str(tmp_path / "sleeper.py"), str(pids)])
  deadline = time.monotonic() + 60
  while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  workers = [int(p) for p in os.listdir(pids)]
  assert len(workers) == 2 and all(_alive(p) for p in workers), workers
  launcher.send_signal(getattr(signal, sig))
  launcher.wait(timeout=30)
  deadline = time.monotonic() + 10
  while any(_alive(p) for p in workers) and time.monotonic() < deadline:
    time.sleep(0.05)
  left = [p for p in workers if _alive(p)]
  for p in left:
    os.kill(p, signal.SIGKILL)
  assert not left, f"workers {left} outlived a launcher stopped by {sig}"
