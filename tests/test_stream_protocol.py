"""The stream-ordered protocol of the GPU backend (staging slots, posted and
consumed flags, tiling), run on host threads through the same C++ algorithms
(xla_ffi/engine/stream_algorithms.cc) with host memory instead of a stream,
against numpy. Small slots force every tiling path: whole rows per step,
pieces of one row, and slots reused within and across calls."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jax_smddp import _native

ENGINE = _native.engine()
DTYPES = {np.dtype(np.int32): 3, np.dtype(np.float16): 6, np.dtype(ml_dtypes.bfloat16): 7,
          np.dtype(np.float32): 8, np.dtype(np.float64): 9}
OPS = {"sum": 0, "max": 1, "min": 2}
GATHER, SCATTER, ALL_REDUCE, ALL_TO_ALL = 0, 1, 2, 3

pytestmark = pytest.mark.timeout(60)


def inputs(size, shape, dtype, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(size):
    if np.issubdtype(np.dtype(dtype), np.integer):
      out.append(rng.integers(-1000, 1000, size=shape).astype(dtype))
    else:
      out.append(rng.standard_normal(shape).astype(dtype))
  return out


def combine(blocks, op, dtype):
  """Reference reduction: sources in rank order, 16-bit floats in f32, one rounding."""
  wide = np.float32 if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) \
      else dtype
  acc = blocks[0].astype(wide)
  for b in blocks[1:]:
    b = b.astype(wide)
    acc = acc + b if op == "sum" else (np.maximum(acc, b) if op == "max" else np.minimum(acc, b))
  return acc.astype(dtype)


def probe(kind, xs, out_shape, dtype, *, op="sum", outer=1, inner=0, count=0, slot=4096, calls=3):
  outs = ENGINE.stream_probe(kind, DTYPES[np.dtype(dtype)], OPS[op], outer, inner, count, slot,
                             [x.tobytes() for x in xs],
                             int(np.prod(out_shape)) * np.dtype(dtype).itemsize, calls)
  return [np.frombuffer(o, dtype=dtype).reshape(out_shape) for o in outs]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("outer,inner,slot", [(1, 300, 4096), (5, 37, 256), (3, 1000, 512),
                                              (4, 64, 1 << 20)])
def test_all_gather(size, outer, inner, slot):
  xs = inputs(size, (outer, inner), np.float32, seed=size * 7 + inner)
  want = np.stack(xs, axis=1)  # [outer, size, inner]
  for r, got in enumerate(probe(GATHER, xs, want.shape, np.float32, outer=outer, inner=inner * 4,
                                slot=slot)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("outer,inner,slot", [(1, 300, 4096), (5, 37, 256), (2, 1000, 512)])
def test_all_to_all(size, outer, inner, slot):
  xs = inputs(size, (outer, size, inner), np.int32, seed=size + inner)
  for r, got in enumerate(probe(ALL_TO_ALL, xs, (outer, size, inner), np.int32, outer=outer,
                                inner=inner * 4, slot=slot)):
    want = np.stack([xs[q][:, r, :] for q in range(size)], axis=1)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.float32, "max"), (np.int32, "min"),
                                      (ml_dtypes.bfloat16, "sum"), (np.float16, "sum"),
                                      (np.float64, "sum")])
@pytest.mark.parametrize("outer,inner,slot", [(1, 333, 1024), (6, 21, 512), (2, 2048, 1 << 16)])
def test_reduce_scatter(size, dtype, op, outer, inner, slot):
  xs = inputs(size, (outer, size, inner), dtype, seed=size * 3 + inner)
  for r, got in enumerate(probe(SCATTER, xs, (outer, inner), dtype, op=op, outer=outer,
                                inner=inner, slot=slot)):
    want = combine([x[:, r, :] for x in xs], op, dtype)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "max"),
                                      (ml_dtypes.bfloat16, "sum")])
@pytest.mark.parametrize("count,slot", [(1001, 1024), (3, 256), (10000, 1 << 20), (4096, 256)])
def test_all_reduce(size, dtype, op, count, slot):
  xs = inputs(size, (count,), dtype, seed=size + count)
  want = combine(xs, op, dtype)
  for r, got in enumerate(probe(ALL_REDUCE, xs, (count,), dtype, op=op, count=count, slot=slot)):
    np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


def test_many_calls_reuse_slots_safely():
  """Forty calls through two slots: a rank that overwrote a slot before its
  peers read it would corrupt later calls' results."""
  xs = inputs(4, (8, 4, 100), np.float32, seed=1)
  for r, got in enumerate(probe(SCATTER, xs, (8, 100), np.float32, outer=8, inner=100, slot=256,
                                calls=40)):
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], "sum", np.float32))
