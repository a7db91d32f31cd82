"""The engine's timer (xla_ffi/engine/scheduler.cc), through _smddp_testing.

Every collective call adds a deadline and cancels it when it ends; the timer
thread is not woken for each (it looks on its own every 200 ms while calls
come). These tests check that deadlines still fire on time: a near deadline
added while the thread sleeps far ahead wakes it, cancelled deadlines never
fire, and a burst of add-and-cancel leaves later deadlines on time.
"""

import os

import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

_testing = engine_probes()

# Slack for a loaded 2-core machine; the timer thread's own tick is 200 ms,
# so a deadline that waited for the tick instead of waking the thread would
# typically be 100+ ms late and often miss it.
LATE_MS = 90


def test_first_deadline_wakes_an_idle_timer_thread():
  (fired,) = _testing.timer_probe([40.0], [False], 3000.0)
  assert 40.0 <= fired < 40.0 + LATE_MS, fired


def test_near_deadline_behind_a_far_one_fires_on_time():
  fired = _testing.timer_probe([10_000.0, 30.0], [True, False], 3000.0)
  assert fired[0] == -1.0  # cancelled: never runs
  assert 30.0 <= fired[1] < 30.0 + LATE_MS, fired


def test_cancelled_deadlines_never_fire():
  fired = _testing.timer_probe([5.0, 10.0, 20.0], [True, False, True], 500.0)
  assert fired[0] == -1.0 and fired[2] == -1.0
  assert 10.0 <= fired[1] < 10.0 + LATE_MS, fired


@pytest.mark.parametrize("delay_ms", [15.0, 120.0, 450.0])
def test_deadlines_after_a_burst_of_calls_fire_on_time(delay_ms):
  # A burst like a stream of collective calls: each adds and cancels its own.
  burst = _testing.timer_probe([60_000.0] * 2000, [True] * 2000, 0.0)
  assert burst == [-1.0] * 2000
  fired = _testing.timer_probe([delay_ms, delay_ms + 5.0], [False, False], delay_ms + 3000.0)
  for want, got in zip([delay_ms, delay_ms + 5.0], fired):
    assert want <= got < want + LATE_MS, fired


def _on(cpu):
  """Moves the calling thread onto `cpu` and gives it every CPU back: it stays there until the
  kernel moves it, which nothing idle does at once."""
  allowed = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {cpu})
  os.sched_setaffinity(0, allowed)
  return allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_helper_leaves_the_core_of_the_thread_it_helps():
  # A helper woken onto the core of the last arrival it helps shares that core while others
  # idle (1x8 all_gather on this 2-core VM: 2 in 5 calls at one core's speed).
  cpu = min(os.sched_getaffinity(0))
  for _ in range(20):  # the kernel may move this thread off `cpu` before the guard looks
    allowed = _on(cpu)
    inside, mask_inside = _testing.off_cpu_probe(cpu)
    if set(mask_inside) != allowed:
      break
  assert inside != cpu and inside in allowed
  assert set(mask_inside) == allowed - {cpu}
  assert os.sched_getaffinity(0) == allowed  # its own mask back once the call's bodies are done


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_thread_a_helper_starts_keeps_every_core():
  # A worker thread the engine starts while a helper is kept off a core (a completion it posts
  # with no worker idle) inherits the helper's narrowed mask unless the engine resets it: it then
  # ran every later helper and device program it got on one core (1x8 all_reduce on this 2-core
  # VM: 1 in 4 calls at one core's speed).
  cpu = min(os.sched_getaffinity(0))
  for _ in range(20):  # the kernel may move this thread off `cpu` before the guard looks
    allowed = _on(cpu)
    tasks = 2 * len(allowed) + 4  # more than the engine keeps idle: some threads start here
    guarded, masks = _testing.off_cpu_spawn_probe(cpu, tasks)
    if set(guarded) == allowed - {cpu}:
      break
  assert set(guarded) == allowed - {cpu}, guarded  # the guard narrowed this thread's mask
  assert len(masks) == tasks
  assert all(set(m) == allowed for m in masks), masks
  assert os.sched_getaffinity(0) == allowed


def test_a_helper_elsewhere_or_with_one_core_stays_put():
  allowed = os.sched_getaffinity(0)
  cpu = min(allowed)
  other = max(allowed)
  if other != cpu:  # on another core already: its mask is left alone
    _on(other)
    inside, mask_inside = _testing.off_cpu_probe(cpu)
    assert set(mask_inside) == allowed and os.sched_getaffinity(0) == allowed
  os.sched_setaffinity(0, {cpu})  # nowhere else to go: it stays
  try:
    inside, mask_inside = _testing.off_cpu_probe(cpu)
    assert inside == cpu and mask_inside == [cpu] and os.sched_getaffinity(0) == {cpu}
  finally:
    os.sched_setaffinity(0, allowed)
