"""The GPU backend's dead-peer watchdog (xla_ffi/engine/stream_watchdog.cc)
and the shared flag blocks it releases (shared_block.cc), without a GPU: the
stream protocol runs on host threads with its flags in separate blocks, a
real child process stands for the process of one rank, and the test kills
it while the other ranks wait on that rank's flags."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jax_smddp import _native

ENGINE = _native.engine()
GATHER, SCATTER, ALL_REDUCE = 0, 1, 2
F32 = 8

pytestmark = pytest.mark.timeout(60)


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


def test_an_exited_process_is_reported_within_a_second():
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


@pytest.mark.parametrize("kind", [GATHER, SCATTER, ALL_REDUCE])
def test_ranks_waiting_on_a_dead_peer_are_released_and_told(kind):
  """Rank 2 of 4 never runs; its process dies 1 s in. The other ranks wait on
  its flags (with a 30 s deadline of their own) until the watchdog sets
  them: every live rank finishes all its calls within seconds, the group's
  error names rank 2 and its pid, and what the live ranks exchanged among
  themselves is still right."""
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
        [x.tobytes() for x in xs], out_bytes, 3, 30.0, absent, child.pid)
    elapsed = time.monotonic() - t0
  finally:
    child.kill()
    child.wait()
  assert elapsed < 5, elapsed
  assert f"rank {absent} (pid {child.pid})" in group_error and "exited" in group_error, group_error
  assert "Restart the job" in group_error
  for r, e in enumerate(errors):
    assert e == "", (r, e)  # released, not timed out
  if kind == GATHER:  # the live ranks' parts went through untouched
    for r in range(size):
      if r == absent:
        continue
      got = np.frombuffer(outs[r], np.float32).reshape(size, n)
      for q in range(size):
        if q != absent:
          np.testing.assert_array_equal(got[q], xs[q][0], err_msg=f"rank {r}, part {q}")


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
  prog = ("from jax_smddp import _native\n"
          f"b = _native.engine().SharedBlock.open({name!r}, 4096)\n" + code)
  out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
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
