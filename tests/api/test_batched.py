"""Batched collectives: a pytree of arrays in one collective per element type,
equal to per-tensor jax.lax; gradients too."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import assert_same, mesh_1d, mesh_2d, random_array, shard

# leaves of mixed dtypes and shapes; every leading dim divisible by 8 ranks x 8
LEAVES = {
    "w": ((64, 6), np.float32),
    "b": ((64,), np.float32),
    "e": ((128, 2, 3), np.float64),
    "h": ((64, 5), jnp.bfloat16),
    "i": ((192,), np.int32),
}


def tree(leaves=LEAVES, seed=0):
  return {k: random_array(s, d, seed=seed + n) for n, (k, (s, d)) in enumerate(leaves.items())}


def run_tree(body, xs, mesh, in_spec, out_spec, check_vma=True):
  specs = jax.tree_util.tree_map(lambda _: in_spec, xs)
  out_specs = jax.tree_util.tree_map(lambda _: out_spec, xs)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=out_specs,
                            check_vma=check_vma))
  args = jax.tree_util.tree_map(lambda a: shard(a, mesh, in_spec), xs)
  return f(args), f.lower(args).as_text()


def count_calls(text, target):
  return len(re.findall(rf"custom_call @{target}\b", text))


def assert_trees_same(got, want):
  for k in want:
    assert_same(got[k], want[k], want[k].dtype)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("axis,tiled", [(0, True), (1, True), (0, False), (-1, False)])
def test_all_gather_batched(axis, tiled):
  m = mesh_1d()
  leaves = dict(LEAVES, flag=((8, 3), np.bool_))
  if axis == 1 and tiled:  # leaves of rank 2 or more
    leaves = {k: v for k, v in leaves.items() if len(v[0]) > 1}
  xs = tree(leaves)
  got, text = run_tree(lambda t: smddp.all_gather_batched(t, "x", axis=axis, tiled=tiled), xs,
                       m, P("x"), P("x"))
  want, _ = run_tree(lambda t: jax.tree_util.tree_map(
      lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=tiled), t), xs, m, P("x"), P("x"))
  assert_trees_same(got, want)
  dtypes = {np.dtype(d) for _, d in leaves.values()}
  assert count_calls(text, "smddp_all_gather") == len(dtypes)  # one call per element type


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (0, False)])
def test_psum_scatter_batched(dim, tiled):
  m = mesh_1d()
  if tiled:
    leaves = {"w": ((64, 16), np.float32), "b": ((64, 8), np.float32),
              "e": ((8, 24, 2), np.float64), "i": ((16, 8), np.int32)}
  else:
    leaves = {"w": ((8, 6), np.float32), "b": ((8, 2, 2), np.float32), "i": ((8, 3), np.int64)}
  xs = tree(leaves, seed=3)
  got, text = run_tree(lambda t: smddp.psum_scatter_batched(t, "x", scatter_dimension=dim,
                                                           tiled=tiled), xs, m, P(), P("x"))
  want, _ = run_tree(lambda t: jax.tree_util.tree_map(
      lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled), t),
      xs, m, P(), P("x"))
  assert_trees_same(got, want)
  dtypes = {np.dtype(d) for _, d in leaves.values()}
  assert count_calls(text, "smddp_reduce_scatter") == len(dtypes)


@pytest.mark.timeout(120)
def test_psum_batched_2d_axes():
  m = mesh_2d()
  xs = tree({"a": ((16, 3), np.float32), "b": ((8,), np.float32), "c": ((8, 2), np.int32)})
  got, text = run_tree(lambda t: smddp.psum_batched(t, ("r", "s")), xs, m, P(("r", "s")), P())
  want, _ = run_tree(lambda t: jax.lax.psum(t, ("r", "s")), xs, m, P(("r", "s")), P())
  assert_trees_same(got, want)
  assert count_calls(text, "smddp_all_reduce") == 2


@pytest.mark.timeout(120)
def test_batched_over_2d_group():
  """A tuple of axes (the whole 2x4 mesh) and one axis of it."""
  m = mesh_2d()
  xs = tree({"a": ((32, 3), np.float32), "c": ((64,), np.int32)})
  for axes, n in ((("r", "s"), 8), ("s", 4)):
    got, _ = run_tree(lambda t: smddp.psum_scatter_batched(t, axes), xs, m, P(), P(axes))
    want, _ = run_tree(lambda t: jax.lax.psum_scatter(t, axes, tiled=True), xs, m, P(), P(axes))
    assert_trees_same(got, want)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_match_lax(check_vma):
  """FSDP step: gather a pytree of parameter shards, differentiate; the
  transposes (batched reduce-scatters) give lax's gradients."""
  m = mesh_1d()
  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((16, 8)).astype(np.float32),
            "b1": rng.standard_normal((8,)).astype(np.float32),
            "w2": rng.standard_normal((8, 8)).astype(np.float64)}
  x = rng.standard_normal((32, 16)).astype(np.float32)

  def make(gather):
    def loss(p, x):
      full = gather(p)
      h = jnp.tanh(x @ full["w1"]) + full["b1"]
      return jax.lax.psum(jnp.sum((h @ full["w2"]) ** 2), "x")
    return loss

  def batched(p):
    # w1 is sharded along its columns, the others along rows
    rows = smddp.all_gather_batched({"b1": p["b1"], "w2": p["w2"]}, "x")
    return {"w1": smddp.all_gather_batched(p["w1"], "x", axis=1), **rows}

  def per_tensor(p):
    return {"w1": jax.lax.all_gather(p["w1"], "x", axis=1, tiled=True),
            "b1": jax.lax.all_gather(p["b1"], "x", tiled=True),
            "w2": jax.lax.all_gather(p["w2"], "x", tiled=True)}

  specs = {"w1": P(None, "x"), "b1": P("x"), "w2": P("x")}
  out = []
  for gather in (batched, per_tensor):
    f = jax.jit(jax.shard_map(jax.value_and_grad(make(gather)), mesh=m,
                              in_specs=(specs, P("x")), out_specs=(P(), specs),
                              check_vma=check_vma))
    p = {k: shard(v, m, specs[k]) for k, v in params.items()}
    out.append(f(p, shard(x, m, P("x"))))
  (l1, g1), (l2, g2) = out
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
  for k in params:
    np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g2[k]), rtol=1e-5, atol=1e-5)


def test_errors():
  m = mesh_1d()

  def body(x):
    return smddp.psum_scatter_batched({"a": x[:3]}, "x")

  with pytest.raises(ValueError, match="not divisible"):
    jax.jit(jax.shard_map(body, mesh=m, in_specs=P(), out_specs=P("x")))(jnp.ones((8,)))
  with pytest.raises(TypeError, match="booleans"):
    jax.jit(jax.shard_map(lambda x: smddp.psum_scatter_batched([x], "x"), mesh=m,
                          in_specs=P(), out_specs=P("x")))(jnp.ones((8,), bool))
  with pytest.raises(NameError, match="not bound"):
    smddp.all_gather_batched([jnp.ones(3)], "x")
