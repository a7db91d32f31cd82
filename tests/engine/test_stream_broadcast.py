"""pbroadcast's fan-out (every rank's source is one rank) through collective_permute's stream
bodies (xla_ffi/algorithms/stream_permute.cc), the GPU protocol on host threads
(HostStreamOps): staged through small slots (several steps), read in place (direct),
alternating, and as CUDA graphs replay them, against numpy."""

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


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("size,source", [(1, 0), (2, 1), (3, 0), (4, 2)])
@pytest.mark.parametrize("mode", ["staged", "direct", "alternating", "replayed"])
def test_every_rank_reads_the_source(mode, size, source, dtype):
  rng = np.random.default_rng(size * 10 + source)
  xs = [rng.integers(-100, 100, size=(7, 33)).astype(dtype) for _ in range(size)]
  kw = {"staged": {}, "direct": {"direct": 1}, "alternating": {"direct": 2},
        "replayed": {"replayable": 2}}[mode]
  # 256-byte slots: a 7 x 33 block of 4 bytes takes several steps, reusing the slots.
  outs = ENGINE.stream_probe(PERMUTE, DTYPES[np.dtype(dtype)], 0, 1, xs[0].nbytes, 0, 256,
                             [x.tobytes() for x in xs], xs[0].nbytes, 3, flag_blocks=size == 3,
                             sources=[source] * size, **kw)
  for r, o in enumerate(outs):
    got = np.frombuffer(o, dtype=dtype).reshape(xs[0].shape)
    np.testing.assert_array_equal(got, xs[source], err_msg=f"rank {r}")
