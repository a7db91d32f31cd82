"""jax_smddp.ppermute on the engine's host family (8 CPU devices in one process): a ring and
a partial permutation (ranks that receive nothing get zeros) in three dtypes, against numpy
and jax.lax; over one axis of a 2-D mesh and over both; each compiled program calling
jax_smddp's collective_permute, not XLA's collective-permute; gradients (the transpose is
the inverted permutation), vmap and transposition against jax.lax's."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import mesh_1d, mesh_2d, shard

RING = [(i, (i + 1) % 8) for i in range(8)]
PARTIAL = [(0, 3), (5, 1), (3, 7)]
PERMS = pytest.mark.parametrize("perm", [RING, PARTIAL], ids=["ring", "partial"])


def _compiled(module, perm, x, mesh=None, axis="x", spec=P("x")):
  mesh = mesh or mesh_1d()
  f = jax.jit(jax.shard_map(lambda b: module.ppermute(b, axis, perm), mesh=mesh, in_specs=spec,
                            out_specs=spec))
  xs = shard(x, mesh, spec)
  return np.asarray(f(xs)), f.lower(xs).compile().as_text()


def _numpy(x, perm, n=8):
  blocks = np.split(x, n)
  out = [np.zeros_like(blocks[0]) for _ in range(n)]
  for src, dst in perm:
    out[dst] = blocks[src]
  return np.concatenate(out)


@PERMS
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_answers_are_numpys_and_jax_laxs(perm, dtype):
  x = ((np.arange(8 * 4 * 5) * 7 % 251) - 125).reshape(8 * 4, 5).astype(dtype)
  got, text = _compiled(smddp, perm, x)
  want, lax_text = _compiled(jax.lax, perm, x)
  np.testing.assert_array_equal(got, _numpy(x, perm))
  np.testing.assert_array_equal(got, want)
  assert 'custom_call_target="smddp_collective_permute"' in text, text[-3000:]
  assert "collective-permute" not in text
  assert "collective-permute" in lax_text


@PERMS
def test_one_axis_of_a_2d_mesh_and_both(perm):
  mesh = mesh_2d()  # ("r", "s") = (2, 4)
  x = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8 * 3, 2)
  small = [(s % 4, d % 4) for s, d in perm if s < 4 and d < 4]
  for axis, p in (("s", small), (("r", "s"), perm)):
    spec = P(("r", "s"))
    got, text = _compiled(smddp, p, x, mesh, axis, spec)
    want, _ = _compiled(jax.lax, p, x, mesh, axis, spec)
    np.testing.assert_array_equal(got, want, err_msg=str(axis))
    assert "smddp_collective_permute" in text


@PERMS
def test_gradient_is_jax_laxs(perm):
  mesh = mesh_1d()
  x = shard(np.random.default_rng(0).standard_normal((8 * 3, 4)).astype(np.float32), mesh, P("x"))
  weights = jnp.arange(12.0).reshape(3, 4)

  def grad(module):
    body = lambda v: jax.lax.psum(jnp.sum(jnp.sin(module.ppermute(v * v, "x", perm)) * weights),
                                  "x")
    return jax.jit(jax.grad(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())))

  got, want = grad(smddp)(x), grad(jax.lax)(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  assert "smddp_collective_permute" in grad(smddp).lower(x).compile().as_text()


@PERMS
def test_transpose_is_the_inverted_permutation(perm):
  mesh = mesh_1d()
  x = np.arange(8 * 2 * 3, dtype=np.float32).reshape(8 * 2, 3)

  def transposed(module):
    def body(ct):
      return jax.linear_transpose(lambda v: module.ppermute(v, "x", perm), ct)(ct)[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  xs = shard(x, mesh, P("x"))
  got = np.asarray(transposed(smddp)(xs))
  np.testing.assert_array_equal(got, np.asarray(transposed(jax.lax)(xs)))
  np.testing.assert_array_equal(got, _numpy(x, [(d, s) for s, d in perm]))


def test_vmap_inside_and_over_the_axis_is_jax_laxs():
  mesh = mesh_1d()
  x = shard(np.arange(8 * 2 * 3, dtype=np.int32).reshape(8 * 2, 3), mesh, P("x"))

  def run(module):
    body = lambda v: jax.vmap(lambda row: module.ppermute(row, "x", PARTIAL))(v)
    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                                            out_specs=P("x")))(x))

  np.testing.assert_array_equal(run(smddp), run(jax.lax))
  # Over a vmapped axis of its own name: jax.lax's rule (a gather, no communication).
  y = jnp.arange(8 * 3.0).reshape(8, 3)
  over = lambda m: jax.vmap(lambda v: m.ppermute(v, "i", RING), axis_name="i")(y)
  np.testing.assert_array_equal(np.asarray(over(smddp)), np.asarray(over(jax.lax)))


def test_repeated_sources_are_refused_as_jax_lax_refuses_them():
  mesh = mesh_1d()
  f = jax.jit(jax.shard_map(lambda b: smddp.ppermute(b, "x", [(0, 1), (0, 2)]), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  with pytest.raises(ValueError, match="unique"):
    f(shard(np.zeros((8, 2), np.float32), mesh, P("x")))
