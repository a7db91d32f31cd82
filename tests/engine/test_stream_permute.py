"""collective_permute's stream bodies (xla_ffi/algorithms/stream_permute.cc), the GPU
protocol on host threads (HostStreamOps): a ring and a partial permutation (ranks that
receive nothing get zeros), and pbroadcast's fan-out (every rank's source is one rank),
staged through small slots (several steps), read in place (direct), alternating, and as
CUDA graphs replay them, against numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

ENGINE = engine_probes()
DTYPES = {np.dtype(name if name != "bfloat16" else ml_dtypes.bfloat16): code
          for name, code in ENGINE.dtypes().items()}
PERMUTE = ENGINE.plan_kinds()["collective_permute"]

pytestmark = pytest.mark.timeout(60)


def perms(size):
  return {"ring": [(i, (i + 1) % size) for i in range(size)],
          "partial": [(0, size - 1), (size - 1, 1)] if size > 2 else [(1, 0)],
          "none": []}


def run(xs, perm, **kw):
  sources = [-1] * len(xs)
  for s, d in perm:
    sources[d] = s
  return run_sources(xs, sources, **kw)


def run_sources(xs, sources, *, slot, direct=0, replayable=0, calls=3, flag_blocks=False):
  """Each rank r's output after `calls` calls whose rank r reads rank sources[r]'s input."""
  dtype = xs[0].dtype
  nbytes = xs[0].nbytes
  outs = ENGINE.stream_probe(PERMUTE, DTYPES[dtype], 0, 1, nbytes, 0, slot,
                             [x.tobytes() for x in xs], nbytes, calls, flag_blocks=flag_blocks,
                             direct=direct, replayable=replayable, sources=sources)
  return [np.frombuffer(o, dtype=dtype).reshape(xs[0].shape) for o in outs]


def expected(xs, perm):
  want = [np.zeros_like(x) for x in xs]
  for s, d in perm:
    want[d] = xs[s]
  return want


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("perm_name", ["ring", "partial", "none"])
@pytest.mark.parametrize("mode", ["staged", "direct", "alternating", "replayed"])
def test_permute_is_numpys(mode, perm_name, size, dtype):
  if size == 1 and perm_name == "partial":
    pytest.skip("a group of one has no partial permutation but none")
  perm = perms(size)[perm_name] if size > 1 else ([(0, 0)] if perm_name == "ring" else [])
  rng = np.random.default_rng(size)
  xs = [rng.integers(-100, 100, size=(7, 33)).astype(dtype) for _ in range(size)]
  kw = {"staged": {}, "direct": {"direct": 1}, "alternating": {"direct": 2},
        "replayed": {"replayable": 2}}[mode]
  # 256-byte slots: a 7 x 33 block of 4 bytes takes several steps, reusing the slots.
  got = run(xs, perm, slot=256, flag_blocks=size == 3, **kw)
  for r, (g, w) in enumerate(zip(got, expected(xs, perm))):
    np.testing.assert_array_equal(g, w, err_msg=f"rank {r}")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("size,source", [(1, 0), (2, 1), (3, 0), (4, 2)])
@pytest.mark.parametrize("mode", ["staged", "direct", "alternating", "replayed"])
def test_every_rank_reads_the_broadcast_source(mode, size, source, dtype):
  rng = np.random.default_rng(size * 10 + source)
  xs = [rng.integers(-100, 100, size=(7, 33)).astype(dtype) for _ in range(size)]
  kw = {"staged": {}, "direct": {"direct": 1}, "alternating": {"direct": 2},
        "replayed": {"replayable": 2}}[mode]
  got = run_sources(xs, [source] * size, slot=256, flag_blocks=size == 3, **kw)
  for r, g in enumerate(got):
    np.testing.assert_array_equal(g, xs[source], err_msg=f"rank {r}")
