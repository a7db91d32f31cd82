"""The engine's one description of each collective (xla_ffi/common/collective.h, read as
jax_smddp._collectives) against jax.lax, the reference: a rank's output bytes from its input
bytes as jax.lax's twin gives them (8 CPU devices), whether its values are combined, and the
arithmetic the cost model and the benchmarks take from it (nccl-tests' busbw factors)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
from jax.sharding import PartitionSpec as P

from jax_smddp import _collectives
from helpers import mesh_1d, shard

N = 8
# jax.lax's twin of each collective, on a rank's 1-D shard of axis "x".
TWINS = {
    "all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
    "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
    "all_reduce": lambda x: jax.lax.psum(x, "x"),
    "all_to_all": lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
    "collective_permute": lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % N) for i in range(N)]),
}


def test_every_collective_has_a_twin_here():
  assert set(TWINS) == set(_collectives.NAMES)


@pytest.mark.parametrize("op", sorted(TWINS))
def test_sizes_and_reduction_are_jax_laxs(op):
  per_rank = 4 * N  # elements
  mesh = mesh_1d()
  f = jax.jit(jax.shard_map(TWINS[op], mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = np.ones((N * per_rank,), np.float32)
  y = np.asarray(f(shard(x, mesh, P("x"))))
  out_per_rank = y.size // N
  assert _collectives.output_bytes(op, 4 * per_rank, N) == 4 * out_per_rank
  assert _collectives.input_bytes(op, 4 * out_per_rank, N) == 4 * per_rank
  assert _collectives.reduces(op) == bool((y == N).all()), y[:4]  # ones summed over the ranks
  assert _collectives.reduces(op) != bool((y == 1).all())


def test_nccl_tests_bus_factors():
  # nccl-tests' doc/PERFORMANCE.md: (n-1)/n, all_reduce 2(n-1)/n; a permutation's sendrecv 1.
  for n in (1, 2, 8):
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
      assert _collectives.bus_factor(op, n) == (n - 1) / n
    assert _collectives.bus_factor("all_reduce", n) == 2 * (n - 1) / n
    assert _collectives.bus_factor("collective_permute", n) == 1.0


def test_blocks():
  # What one rank sends one other: all_gather its whole input, a permutation too, the others
  # one n-th of it.
  assert [_collectives.block_bytes(op, 800, 8) for op in _collectives.NAMES] == [
      800, 100, 100, 100, 800]


def test_an_unknown_name_is_refused_with_the_known_ones():
  with pytest.raises(ValueError, match="all_gather, reduce_scatter"):
    _collectives.spec("broadcast")
