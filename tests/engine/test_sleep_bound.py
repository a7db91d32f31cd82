"""How long a waiting call across processes sleeps at a time (wait_polls.h, SleepBoundUs): its
floor (JAX_SMDDP_SLEEP_US, or the longer one of links that wake it on arrival) while the wait is
young, then an eighth of the time it has waited, at most 1 ms: a wait of milliseconds on peers
across a slow link wakes tens of times, not once per floor, and a wake the link's signal missed
adds at most about an eighth to the wait."""

from __future__ import annotations

import pytest

from helpers import engine_probes

probes = engine_probes()

pytestmark = pytest.mark.engine


def reference(floor_us: int, waited_us: int) -> int:
  return max(floor_us, min(1000, max(0, waited_us) // 8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("floor_us", [0, 50, 1000, 5000])
def test_the_sleep_bound_grows_with_the_wait(floor_us):
  waits = [0, 1, 399, 400, 401, 799, 800, 4000, 7999, 8000, 8008, 50_000, 10**9, -5]
  got = [probes.sleep_bound_us(floor_us, w) for w in waits]
  assert got == [reference(floor_us, w) for w in waits], (floor_us, got)
  # Never below the floor, never above the larger of the floor and 1 ms, and growing.
  assert all(floor_us <= g <= max(floor_us, 1000) for g in got)
  young = [probes.sleep_bound_us(floor_us, w) for w in range(0, 20_000, 100)]
  assert young == sorted(young)
