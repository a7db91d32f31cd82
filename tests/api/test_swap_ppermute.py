"""jax.lax.ppermute swapped onto the engine (JAX_SMDDP_COLLECTIVES=all, jax_smddp.use):
cyclic and partial permutations and their gradients exactly as jax.lax's own, and the
cases the engine does not take left on XLA with a warning naming why."""

import logging

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from jax_smddp import requirements
from helpers import mesh_1d, mesh_2d, shard

N = 8
RING = tuple((i, (i + 1) % N) for i in range(N))
PARTIAL = ((0, 3), (3, 5), (6, 0), (7, 6))  # ranks 1, 2, 4, 7 receive nothing: zeros


def _both(f, *args):
  """(unswapped answers, swapped answers, swapped compiled text)."""
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  with smddp.use("all"):
    text = f.lower(*args).compile().as_text()
    got = jax.tree_util.tree_map(np.asarray, f(*args))
  return want, got, text


def _exact(got, want):
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("perm", [RING, PARTIAL], ids=["ring", "partial"])
def test_ppermute_runs_on_the_engine_exactly_as_lax(perm):
  m = mesh_1d()
  x = np.random.default_rng(1).standard_normal((N * 3, 5)).astype(np.float32)
  i = np.arange(N * 2 * 4, dtype=np.int32).reshape(N * 2, 4)

  def body(x, i):
    return jax.lax.ppermute(x, "x", perm), jax.lax.ppermute(i, "x", perm)

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  args = shard(x, m, P("x")), shard(i, m, P("x"))
  want, got, text = _both(f, *args)
  _exact(got, want)
  assert text.count('custom_call_target="smddp_collective_permute"') == 2, text
  assert "collective-permute" not in text
  # Independent reference: block s of the input lands at block d, zeros elsewhere.
  ref = np.zeros_like(x)
  for s, d in perm:
    ref[d * 3:(d + 1) * 3] = x[s * 3:(s + 1) * 3]
  np.testing.assert_array_equal(got[0], ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("perm", [RING, PARTIAL], ids=["ring", "partial"])
def test_ppermute_gradients_swapped_equal_lax(perm):
  m = mesh_1d()
  rng = np.random.default_rng(2)
  x = rng.standard_normal((N * 2, 3)).astype(np.float32)
  w = rng.standard_normal((N * 2, 3)).astype(np.float32)

  def body(x, w):
    def loss(x):
      return jnp.sum(jnp.sin(jax.lax.ppermute(x, "x", perm)) * w)
    return jax.grad(loss)(x)

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("x"), P("x")), out_specs=P("x")))
  want, got, text = _both(f, shard(x, m, P("x")), shard(w, m, P("x")))
  _exact([got], [want])
  # forward and its transpose (the inverse permutation) both on the engine
  assert text.count('custom_call_target="smddp_collective_permute"') == 2, text
  assert "collective-permute" not in text
  assert np.any(got != 0)


@pytest.mark.timeout(120)
def test_ppermute_over_part_of_a_2d_mesh_and_pshuffle():
  m = mesh_2d()  # (r=2, s=4)
  x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)

  def body(x):
    return (jax.lax.ppermute(x, "s", [(0, 1), (1, 2), (2, 3), (3, 0)]),
            jax.lax.pshuffle(x, ("r", "s"), [7, 0, 1, 2, 3, 4, 5, 6]))

  spec = P(("r", "s"))
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(spec,), out_specs=(spec, spec)))
  want, got, text = _both(f, shard(x, m, spec))
  _exact(got, want)
  assert text.count('custom_call_target="smddp_collective_permute"') == 2, text
  assert "collective-permute" not in text


@pytest.mark.timeout(120)
def test_ppermute_the_engine_does_not_take_stays_on_xla_with_a_warning(caplog, monkeypatch):
  monkeypatch.setattr(requirements, "_warned", set())  # warned once per process
  m = mesh_1d()
  z = (np.arange(N * 2) + 1j).astype(np.complex64).reshape(N * 2, 1)

  def body(z):
    return jax.lax.ppermute(z, "x", RING)

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("x"),), out_specs=P("x")))
  args = (shard(z, m, P("x")),)
  with caplog.at_level(logging.WARNING, logger="jax_smddp"):
    want, got, text = _both(f, *args)
  _exact([got], [want])
  assert "collective-permute" in text and "smddp_collective_permute" not in text
  assert any("ppermute" in r.getMessage() and "complex64" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_all_names_ppermute():
  assert "collective_permute" in smddp.swap.parse("all")
  assert smddp.swap.parse("ppermute") == {"collective_permute"}
