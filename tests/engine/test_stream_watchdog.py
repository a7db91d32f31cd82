"""The GPU backend's dead-peer watchdog (xla_ffi/engine/stream_watchdog.cc)
and the shared flag blocks it releases (shared_block.cc), without a GPU: the
stream protocol runs on host threads with its flags in separate blocks, a
real child process stands for the process of one rank, and the test kills
it while the other ranks wait on that rank's flags."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

ENGINE = engine_probes()
GATHER, SCATTER, ALL_REDUCE = (ENGINE.plan_kinds()[k] for k in (
    "all_gather", "reduce_scatter", "all_reduce"))
F32 = ENGINE.dtypes()["float32"]

pytestmark = pytest.mark.timeout(60)
# Children import the installed package, not a source checkout in the working directory.
OUTSIDE = tempfile.gettempdir()


def sleeper() -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def kill_later(proc: subprocess.Popen, seconds: float) -> threading.Timer:
  t = threading.Timer(seconds, proc.kill)
  t.start()
  return t


def test_a_live_process_is_not_reported():
  child = sleeper()
  try:
    assert ENGINE.watch_process(child.pid, 0.5) == ""
  finally:
    child.kill()
    child.wait()


def test_an_exited_process_is_reported_within_a_second(capfd):
  child = sleeper()
  try:
    kill_later(child, 0.3)
    t0 = time.monotonic()
    why = ENGINE.watch_process(child.pid, 20.0)
    elapsed = time.monotonic() - t0
  finally:
    child.kill()
    child.wait()
  assert f"rank 1 (pid {child.pid})" in why and "exited" in why, why
  assert elapsed < 1.5, elapsed
  assert why in capfd.readouterr().err  # said at once: a blocked stream may never raise it


def test_an_orderly_close_fails_the_group_without_alarm(capfd):
  """A peer that marks its block closed (a normal exit, or released groups)
  fails the group at once, alive or not, and prints nothing: the end of
  every job would otherwise print a death notice."""
  block = ENGINE.SharedBlock.create(4096, 1)
  child = subprocess.Popen([sys.executable, "-c",
                            "import sys, time\nimport _smddp_testing\n"
                            f"b = _smddp_testing.SharedBlock.open({block.name!r}, 4096)\n"
                            "time.sleep(0.5)\nb.mark_closed()\ntime.sleep(120)"],
                           cwd=OUTSIDE)
  try:
    t0 = time.monotonic()
    why = ENGINE.watch_process(child.pid, 20.0, block)
    elapsed = time.monotonic() - t0
    assert child.poll() is None  # still running: the flag alone did it
  finally:
    child.kill()
    child.wait()
  assert "closed the group" in why and f"rank 1 (pid {child.pid})" in why, why
  assert elapsed < 10, elapsed
  assert "closed the group" not in capfd.readouterr().err


# Steps from 0 (a young job), and just short of 2^32: flags compare cyclically,
# as CUDA's stream memory operations do, so "released" is not UINT32_MAX (a
# GPU stream waiting for step 5 never sees UINT32_MAX as reached: found on an
# H100, where such streams stayed blocked) but a distance ahead of the steps.
@pytest.mark.parametrize("first_step", [0, 1 << 31, (1 << 32) - 2], ids=["from-0", "mid", "wrapping"])
@pytest.mark.parametrize("kind,direct,replayable",
                         [(GATHER, 0, 0), (SCATTER, 0, 0), (ALL_REDUCE, 0, 0), (GATHER, 1, 0),
                          (SCATTER, 1, 0), (ALL_REDUCE, 1, 0), (GATHER, 0, 1), (SCATTER, 0, 1),
                          (ALL_REDUCE, 0, 1)],
                         ids=["all_gather", "reduce_scatter", "all_reduce", "all_gather-direct",
                              "reduce_scatter-direct", "all_reduce-direct", "all_gather-replayable",
                              "reduce_scatter-replayable", "all_reduce-replayable"])
def test_ranks_waiting_on_a_dead_peer_are_released_and_told(kind, direct, replayable, first_step):
  """Rank 2 of 4 never runs (staged, reading buffers in place: "direct", or as calls
  captured into CUDA graphs run: "replayable", waiting on tokens); its process dies 1 s in.
  The other ranks wait on
  its flags (with a 30 s deadline of their own) until the watchdog sets
  them (all of the group's: the output of a failed group is undefined):
  every live rank finishes all its calls within seconds, and the group's
  error names rank 2 and its pid."""
  size, absent, n = 4, 2, 1000
  rng = np.random.default_rng(kind)
  if kind == GATHER:
    xs = [rng.standard_normal((1, n)).astype(np.float32) for _ in range(size)]
    out_bytes = size * n * 4
    args = dict(outer=1, inner=n * 4, count=0)
  elif kind == SCATTER:
    xs = [rng.standard_normal((1, size, n)).astype(np.float32) for _ in range(size)]
    out_bytes = n * 4
    args = dict(outer=1, inner=n, count=0)
  else:
    xs = [rng.standard_normal(n * size).astype(np.float32) for _ in range(size)]
    out_bytes = n * size * 4
    args = dict(outer=0, inner=0, count=n * size)
  child = sleeper()
  try:
    kill_later(child, 1.0)
    t0 = time.monotonic()
    errors, group_error, outs = ENGINE.stream_watch_probe(
        kind, F32, 0, args["outer"], args["inner"], args["count"], 1024,
        [x.tobytes() for x in xs], out_bytes, 3, 30.0, absent, child.pid, direct=direct,
        first_step=first_step, replayable=replayable)
    elapsed = time.monotonic() - t0
  finally:
    child.kill()
    child.wait()
  assert elapsed < 5, elapsed
  assert f"rank {absent} (pid {child.pid})" in group_error and "exited" in group_error, group_error
  assert "Restart the job" in group_error
  for r, e in enumerate(errors):
    assert e == "", (r, e)  # released, not timed out


def test_without_the_watchdog_the_same_wait_times_out():
  """The control: a rank that never arrives, with its process alive, is not
  released (the ranks time out after their own 1 s deadline)."""
  child = sleeper()
  try:
    xs = [np.ones((1, 100), np.float32) * q for q in range(3)]
    errors, group_error, _ = ENGINE.stream_watch_probe(
        GATHER, F32, 0, 1, 400, 0, 1024, [x.tobytes() for x in xs], 3 * 400, 1, 1.0, 1, child.pid)
  finally:
    child.kill()
    child.wait()
  assert group_error == ""
  assert "timed out" in errors[0] and "timed out" in errors[2], errors


def _open_in_child(name: str, code: str) -> str:
  prog = ("import _smddp_testing\n"
          f"b = _smddp_testing.SharedBlock.open({name!r}, 4096)\n" + code)
  out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       cwd=OUTSIDE)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip()


def test_shared_block_is_shared_and_leaves_nothing_in_dev_shm():
  block = ENGINE.SharedBlock.create(4096, 2)
  path = "/dev/shm" + block.name
  assert block.owner_pid == os.getpid() and block.bytes == 4096
  assert os.stat(path).st_mode & 0o077 == 0  # only this user
  assert _open_in_child(block.name, "b.store(3, 77); print(b.owner_pid)") == str(os.getpid())
  assert block.load(3) == 77
  assert os.path.exists(path)  # one of two openers left
  assert _open_in_child(block.name, "print(b.load(3))") == "77"
  assert not os.path.exists(path)  # the last opener removed the name
  block.store(0, 5)
  assert block.load(0) == 5


def test_shared_block_errors_say_what_is_wrong():
  block = ENGINE.SharedBlock.create(4096, 1)
  with pytest.raises(RuntimeError, match="unexpected size"):
    ENGINE.SharedBlock.open(block.name, 8192)
  with pytest.raises(RuntimeError, match="not a jax_smddp shared-memory block name"):
    ENGINE.SharedBlock.open("/etc/passwd", 4096)
  name = block.name
  del block  # the creator removes a name nobody opened
  assert not os.path.exists("/dev/shm" + name)
  with pytest.raises(RuntimeError, match="does not exist"):
    ENGINE.SharedBlock.open(name, 4096)


# The GPU call log (xla_ffi/engine/call_log.cc): records are
# (rank, kind, dtype, op, outer, inner, count), each its rank's next call.
def gather(rank, inner=4096, dtype=F32):
  return (rank, GATHER, dtype, 0, 1, inner, 0)


def test_call_log_accepts_ranks_that_agree_in_any_interleaving():
  rng = np.random.default_rng(0)
  program = [gather(0, inner=4096 * (i % 3 + 1)) for i in range(200)]  # > 64 entries: ring wraps
  progress = [0, 0, 0]
  records = []
  while min(progress) < len(program):
    r = int(rng.integers(3))
    if progress[r] < len(program):
      records.append((r,) + program[progress[r]][1:])
      progress[r] += 1
  assert ENGINE.call_log_probe(3, records) == [""] * len(records)


@pytest.mark.parametrize("first", [0, 1])
def test_call_log_reports_a_different_call_naming_both(first):
  """Rank 1's third call gathers a different size: whichever of the two ranks
  logs its third call second fails, naming both calls."""
  second = 1 - first
  calls = {0: [gather(0), gather(0), gather(0, inner=4096)],
           1: [gather(1), gather(1), gather(1, inner=2048)]}
  records = calls[first][:2] + calls[second][:2] + [calls[first][2], calls[second][2]]
  got = ENGINE.call_log_probe(2, records)
  assert got[:5] == [""] * 5, got
  assert "disagree on call #2" in got[5], got[5]
  assert "1 x 4096 bytes per rank" in got[5] and "1 x 2048 bytes per rank" in got[5], got[5]
  assert f"rank {second} runs" in got[5] and f"but rank {first} runs" in got[5], got[5]


def test_call_log_reports_a_different_collective_and_reduction():
  got = ENGINE.call_log_probe(2, [(0, SCATTER, F32, 0, 2, 64, 0), (1, SCATTER, F32, 1, 2, 64, 0)])
  assert got[0] == "" and "reduce_scatter of float32 (2 x 64 elements per rank out, sum)" in got[1] \
      and "max" in got[1], got
  got = ENGINE.call_log_probe(2, [(0, ALL_REDUCE, F32, 0, 0, 0, 100), (1, GATHER, F32, 0, 1, 400, 0)])
  assert "all_gather of float32" in got[1] and "all_reduce of float32 (100 elements, sum)" in got[1], got


def test_call_log_never_reports_a_peer_too_far_ahead():
  """A rank more than 64 calls ahead has overwritten the entries its peer
  would compare with: not checked, and not reported."""
  ahead = [gather(0, inner=8) for _ in range(100)]
  behind = [gather(1, inner=8) for _ in range(100)]
  assert ENGINE.call_log_probe(2, ahead + behind) == [""] * 200
