"""How far a row's speedup can be trusted: a bootstrap interval of the ratio of the two
implementations' medians, from the row's own calls.

On a shared or small machine a median of 20 calls moves by 10-20 % from one run to the next
for either library alone (docs/cpu_floor.md, "What one row can tell"), so a speedup of
0.9 or 1.1 may say nothing. The interval resamples each implementation's calls (with
replacement, each independently of the other: any timing, paired or not) and takes the
quantiles of lax median / smddp median over the resamples. An interval that contains 1.0 says
these calls cannot tell the two implementations apart at that size; more calls (``--iters``)
narrow it."""

from __future__ import annotations

import numpy as np

__all__ = ["LEVEL", "speedup_interval", "undecided"]

LEVEL = 0.9
_RESAMPLES = 2000


def speedup_interval(smddp_us, lax_us, level: float = LEVEL, resamples: int = _RESAMPLES,
                     seed: int = 0) -> list[float] | None:
  """[low, high]: the central `level` interval of lax median / smddp median over `resamples`
  bootstrap resamples of each list of call times (fixed `seed`: the same calls give the same
  interval). None with fewer than 2 calls of either."""
  s = np.asarray(smddp_us, dtype=np.float64)
  l = np.asarray(lax_us, dtype=np.float64)
  if s.size < 2 or l.size < 2:
    return None
  rng = np.random.default_rng(seed)
  ms = np.median(rng.choice(s, size=(resamples, s.size)), axis=1)
  ml = np.median(rng.choice(l, size=(resamples, l.size)), axis=1)
  low, high = np.quantile(ml / ms, [(1 - level) / 2, (1 + level) / 2])
  return [float(low), float(high)]


def undecided(r: dict) -> bool:
  """A row whose speedup interval contains 1.0: its calls cannot tell the two apart."""
  iv = r.get("speedup_interval")
  return bool(iv) and iv[0] <= 1.0 <= iv[1]
