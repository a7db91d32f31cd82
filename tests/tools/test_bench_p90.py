"""Each row's p90 beside its median (issue 69): the calls' 90th percentile per implementation,
taken over the processes as the median is, and a mark in the table where it exceeds 1.5x the
median. References: numpy's percentile (linear interpolation), and the rule written out."""

import numpy as np
import pytest

from jax_smddp.tools import bench
from jax_smddp.tools.bench import nccl_flags

pytestmark = pytest.mark.timeout(60)


def test_p90_is_numpys_linear_percentile():
  rng = np.random.default_rng(69)
  for calls in list(range(1, 41)) + [100, 257]:
    samples = list(100 * (1 + rng.exponential(0.5, calls)))  # a long tail of slow calls
    assert bench.p90(samples) == pytest.approx(np.percentile(samples, 90)), calls
  assert bench.p90([7.0]) == 7.0
  assert bench.p90([]) is None
  # 20 calls: rank 0.9 x 19 = 17.1 of the sorted calls, a tenth of the way from 18th to 19th.
  assert bench.p90(list(range(20, 0, -1))) == pytest.approx(18.1)


def _row(smddp, lax, op="all_reduce"):
  return {"op": op, "bytes_per_rank": 1 << 20, "iters": len(smddp), "engine": True,
          "smddp": {"time_us": float(np.median(smddp)), "algbw_gbs": 1.0, "busbw_gbs": 1.0,
                    "min_us": min(smddp)},
          "lax": {"time_us": float(np.median(lax)), "algbw_gbs": 1.0, "busbw_gbs": 1.0,
                  "min_us": min(lax)},
          "speedup": float(np.median(lax) / np.median(smddp)),
          "samples_us": {"smddp": list(smddp), "lax": list(lax)}}


def _p90_cells(line: str) -> list[str]:
  """A table row's two p90 cells (after jax_smddp's time, after the baseline's)."""
  cells = line.split()
  return [cells[2], cells[6]]


def test_a_row_whose_p90_exceeds_one_and_a_half_medians_is_marked():
  steady = [100.0] * 17 + [120.0] * 3  # p90 = 120: 1.2x the median
  spread = [100.0] * 16 + [400.0] * 4  # p90 = 400: 4x the median
  at_mark = [100.0] * 17 + [150.0] * 3  # p90 = 150: 1.5x exactly, not above it
  r = bench.add_p90(_row(spread, steady))
  assert r["smddp"]["p90_us"] == pytest.approx(np.percentile(spread, 90))
  assert r["lax"]["p90_us"] == pytest.approx(np.percentile(steady, 90))
  assert bench.spread(r["smddp"]) and not bench.spread(r["lax"])
  assert _p90_cells(bench.table_row(r)) == ["400.0!", "120.0"]
  r = bench.add_p90(_row(steady, at_mark))
  assert r["lax"]["p90_us"] == 150.0 and not bench.spread(r["lax"])
  assert _p90_cells(bench.table_row(r)) == ["120.0", "150.0"]
  # Just above the mark.
  r = bench.add_p90(_row(steady, [100.0] * 17 + [151.0] * 3))
  assert _p90_cells(bench.table_row(r)) == ["120.0", "151.0!"]
  # A baseline not run (a 0-byte row): no p90, no mark.
  r = _row(steady, steady)
  r["lax"] = {"time_us": None, "algbw_gbs": None, "busbw_gbs": None}
  r["samples_us"]["lax"], r["speedup"] = [], None
  bench.add_p90(r)
  assert "p90_us" not in r["lax"] and _p90_cells(bench.table_row(r))[1] == "-"
  # The header says what p90 and the mark are; its columns put each p90 beside its time.
  head = bench.table_header("all_reduce", 4).splitlines()
  assert any("90th percentile" in h and "! = p90 above 1.5x the median" in h for h in head)
  columns = head[-1].split()
  assert columns[1:3] == ["smddp", "us"] and columns[3] == "p90" and columns[8] == "p90"


def _process_rows(p90s: list[float]) -> list[list[dict]]:
  """Every process's row of one size, each with its own median 100 us and p90."""
  return [[{"op": "all_reduce", "bytes_per_rank": 1 << 20,
            "smddp": {"time_us": 100.0, "min_us": 90.0, "p90_us": p},
            "lax": {"time_us": 200.0, "min_us": 190.0, "p90_us": 2 * p}, "samples_us": {}}]
          for p in p90s]


@pytest.mark.parametrize("average,want", [(0, 110.0), (1, 170.0), (2, 110.0), (3, 290.0)])
def test_the_p90_is_taken_over_the_processes_as_the_median(average, want):
  """-a 0-3: process 0's p90, the processes' mean, least or largest, as their medians."""
  (r,) = nccl_flags.over_processes(_process_rows([110.0, 290.0, 150.0, 130.0]), 8, average)
  assert r["smddp"]["p90_us"] == pytest.approx(want)
  assert r["lax"]["p90_us"] == pytest.approx(2 * want)
  assert bench.spread(r["smddp"]) == (want > 150.0)


def test_the_slowest_process_rows_p90_is_of_the_slowest_calls():
  p0 = [bench.add_p90(_row([100.0] * 10, [200.0] * 10, op="all_gather"))]
  p1 = [bench.add_p90(_row([100.0] * 8 + [300.0, 500.0], [200.0] * 10, op="all_gather"))]
  (r,) = bench.slowest_process([p0, p1], n=2)
  slowest = [100.0] * 8 + [300.0, 500.0]
  assert r["smddp"]["p90_us"] == pytest.approx(np.percentile(slowest, 90))  # 320
  assert r["lax"]["p90_us"] == 200.0
  assert bench.spread(r["smddp"]) and not bench.spread(r["lax"])
