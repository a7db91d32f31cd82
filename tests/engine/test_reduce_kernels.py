"""The host reduction's two copies (xla_ffi/algorithms/reduce_kernels.h): the
baseline one and the one built for AVX2, which Reduce() uses where the CPU has
AVX2. Both must give the same bits as a sequential numpy reference, for every
dtype and op, with NaNs, tails that no vector width divides, and up to 9
sources."""

import numpy as np
import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

_testing = engine_probes()
ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = _testing.dtypes()
OPS = _testing.reduce_ops()
NUMPY = {"int8": np.int8, "uint8": np.uint8, "int32": np.int32, "uint32": np.uint32,
         "int64": np.int64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
         "float32": np.float32, "float64": np.float64}


FLOATS = {"float16", "bfloat16", "float32", "float64"}


def sources(name, n, count, rng):
  dt = np.dtype(NUMPY[name])
  if name in FLOATS:
    x = rng.standard_normal((n, count)) * 1000
    x[:, ::17] = np.inf * np.sign(x[:, ::17])
    x[0, 5::29] = np.nan
    return x.astype(dt)
  info = np.iinfo(dt)
  return rng.integers(info.min, info.max, (n, count), dtype=dt, endpoint=True)


def _nan_max(a, b):  # the engine's max: NaN wins, the accumulated one first
  return np.where(np.isnan(a), a, np.where(np.isnan(b), b, np.where(a > b, a, b)))


def _nan_min(a, b):
  return np.where(np.isnan(a), a, np.where(np.isnan(b), b, np.where(a < b, a, b)))


def reference(x, op):
  """Sources combined in order, as the engine specifies."""
  if x.dtype.name in ("float16", "bfloat16"):  # accumulated in float32, rounded once
    acc = x.astype(np.float32)
  elif x.dtype.kind == "i" and op == "sum":  # two's-complement wrap-around
    acc = x.view(np.dtype(f"u{x.dtype.itemsize}"))
  else:
    acc = x
  out = acc[0].copy()
  with np.errstate(over="ignore", invalid="ignore"):  # infinities and NaNs are part of the data
    out = _combine(out, acc[1:], op)
  if out.dtype.itemsize == x.dtype.itemsize and out.dtype.kind in "iu":
    return out.view(x.dtype)
  return out.astype(x.dtype)


def _combine(out, rows, op):
  for row in rows:
    if op == "sum":
      out = out + row
    elif out.dtype.kind == "f":
      out = _nan_max(out, row) if op == "max" else _nan_min(out, row)
    else:
      out = np.maximum(out, row) if op == "max" else np.minimum(out, row)
  return out


@pytest.mark.parametrize("name", sorted(NUMPY))
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_both_copies_give_the_reference_bits(name, op):
  rng = np.random.default_rng(7)
  for n in (1, 2, 3, 4, 8, 9):
    for count in (1, 7, 31, 100, 16384 + 37):
      x = sources(name, n, count, rng)
      want = reference(x, op)
      args = (x.tobytes(), n, DTYPES[name], OPS[op])
      baseline = _testing.reduce(*args, "baseline")
      got = np.frombuffer(baseline, dtype=x.dtype)
      # NaN payloads aside (numpy's conversions pick their own), the reference's bits.
      floats = name in FLOATS
      nan = np.isnan(want.astype(np.float64)) if floats else np.zeros(count, bool)
      if floats:
        assert np.array_equal(np.isnan(got.astype(np.float64)), nan), (name, op, n, count)
      assert got[~nan].tobytes() == want[~nan].tobytes(), (name, op, n, count)
      for path in ("auto", "avx2"):  # the other copies: exactly the baseline's bytes
        other = _testing.reduce(*args, path)
        if other is None:
          assert path == "avx2"  # this CPU or build has no AVX2 copy
          continue
        assert other == baseline, (name, op, n, count, path)
