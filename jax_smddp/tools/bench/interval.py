"""How far a row's speedup can be trusted: a bootstrap interval of the ratio of the two
implementations' medians, from the row's own calls.

On a shared or small machine a median of 20 calls moves by 10-20 % from one run to the next
for either library alone (docs/cpu_floor.md, "What one row can tell"), so a speedup of
0.9 or 1.1 may say nothing. The interval resamples each implementation's calls (with
replacement, each independently of the other: any timing, paired or not) and takes the
quantiles of lax median / smddp median over the resamples. An interval that contains 1.0 says
these calls cannot tell the two implementations apart at that size; more calls (``--iters``)
narrow it.

Beside each median the tables give the calls' 90th percentile (``p90_us``), and mark a row
whose p90 exceeds P90_MARK x its median: some of its calls took far longer than the typical one
(other load, or more busy threads than cores: docs/cpu_steadiness.md, "Helper threads"), and its
median, though still the figure to read, moves more from run to run."""

from __future__ import annotations

import numpy as np

__all__ = ["LEVEL", "P90_MARK", "add_p90", "p90", "spread", "speedup_interval", "undecided"]

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


P90_MARK = 1.5
IMPLS = ("smddp", "lax", "mpi4jax")


def p90(samples) -> float | None:
  """The 90th percentile of call times: linear between the two calls nearest rank
  0.9 x (calls - 1) of the sorted calls (numpy's default); None without calls."""
  ordered = sorted(float(t) for t in samples)
  if not ordered:
    return None
  rank = 0.9 * (len(ordered) - 1)
  low = int(rank)
  high = min(low + 1, len(ordered) - 1)
  return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def add_p90(r: dict) -> dict:
  """Each implementation of row `r` that ran gets ``p90_us``, from the row's calls
  (``samples_us``: one process's, or slowest_process's per-call slowest)."""
  for impl in IMPLS:
    calls = (r.get("samples_us") or {}).get(impl)
    if isinstance(r.get(impl), dict) and calls:
      r[impl]["p90_us"] = round(p90(calls), 1)
  return r


def spread(entry: dict) -> bool:
  """Whether an implementation's calls spread: its p90 above P90_MARK x its time (the median,
  or the processes' medians combined, with the p90s combined alike)."""
  p, t = entry.get("p90_us"), entry.get("time_us")
  return p is not None and bool(t) and p > P90_MARK * t
