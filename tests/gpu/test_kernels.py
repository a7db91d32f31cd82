"""The GPU data movers without JAX: the stream algorithms run on one GPU with
CudaStreamOps (every rank a thread with its own stream and region), in each
copy and flag mode and SM budget, against numpy. Isolates the kernels, copy
engines and stream memory operations from XLA. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import ml_dtypes

from jax_smddp import _native
from test_stream_protocol import DTYPES, OPS, combine, inputs

EXT = _native.cuda_engine()
pytestmark = [pytest.mark.skipif(EXT is None or EXT.device_count() == 0, reason="no GPU"),
              pytest.mark.timeout(120)]

MODES = [("engine", "memops", 8), ("kernel", "memops", 1), ("kernel", "kernel", 8),
         ("engine", "kernel", 2)]


def selftest(kind, xs, out_shape, dtype, mode, *, op="sum", outer=1, inner=0, count=0,
             slot=4096, calls=3):
  copies, flags, blocks = mode
  outs = EXT.stream_selftest(0, kind, DTYPES[np.dtype(dtype)], OPS[op], outer, inner, count, slot,
                             [x.tobytes() for x in xs],
                             int(np.prod(out_shape)) * np.dtype(dtype).itemsize, calls, copies,
                             flags, blocks)
  return [np.frombuffer(o, dtype=dtype).reshape(out_shape) for o in outs]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("outer,inner,slot", [(1, 300_000, 1 << 20), (5, 37, 256), (3, 1000, 4096)])
def test_gather_and_exchange(mode, size, outer, inner, slot):
  xs = inputs(size, (outer, inner), np.float32, seed=size + inner)
  for got in selftest(0, xs, (outer, size, inner), np.float32, mode, outer=outer, inner=inner * 4,
                      slot=slot):
    np.testing.assert_array_equal(got, np.stack(xs, axis=1))
  xs = inputs(size, (outer, size, inner), np.int32, seed=size * 2 + inner)
  for r, got in enumerate(selftest(3, xs, (outer, size, inner), np.int32, mode, outer=outer,
                                   inner=inner * 4, slot=slot)):
    np.testing.assert_array_equal(got, np.stack([x[:, r, :] for x in xs], axis=1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "max"),
                                      (ml_dtypes.bfloat16, "sum"), (np.float16, "min")])
def test_reductions(mode, size, dtype, op):
  xs = inputs(size, (3, size, 2000), dtype, seed=size)
  for r, got in enumerate(selftest(1, xs, (3, 2000), dtype, mode, op=op, outer=3, inner=2000,
                                   slot=8192)):
    np.testing.assert_array_equal(got, combine([x[:, r, :] for x in xs], op, dtype))
  xs = inputs(size, (100_003,), dtype, seed=size + 1)
  want = combine(xs, op, dtype)
  for got in selftest(2, xs, (100_003,), dtype, mode, op=op, count=100_003, slot=65536):
    np.testing.assert_array_equal(got, want)


def test_copy_engine_mode_launches_no_copy_kernel():
  before = dict(EXT.counters())
  xs = inputs(4, (1, 10_000), np.float32, seed=9)
  selftest(0, xs, (1, 4, 10_000), np.float32, ("engine", "memops", 8), outer=1, inner=40_000)
  after = EXT.counters()
  assert after["copy_kernels"] == before["copy_kernels"]
  assert after["engine_copies"] > before["engine_copies"]
  if EXT.have_stream_memops():
    assert after["flag_kernels"] == before["flag_kernels"]
