"""Hybrid sharding on a 2x4 (replica x shard) mesh: gather_params,
reduce_grads and reduce_sharded_grads against jax.lax and the global gradient."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_smddp import hybrid
from helpers import shard

R, S = 2, 4  # replica groups x shard group size


def mesh():
  return jax.make_mesh((R, S), ("replica", "shard"))


def problem():
  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((16, 8)).astype(np.float32) / 4,
            "b1": rng.standard_normal((8,)).astype(np.float32),
            "w2": rng.standard_normal((8, 4)).astype(np.float64) / 4}
  x = rng.standard_normal((32, 16)).astype(np.float32)
  return params, x


def loss(full, x):
  h = jnp.tanh(x @ full["w1"] + full["b1"])
  return jnp.sum((h @ full["w2"]) ** 2)


PSPEC = {"w1": P("shard"), "b1": P("shard"), "w2": P("shard")}
XSPEC = P(("replica", "shard"))


def global_grads():
  params, x = problem()
  return jax.jit(jax.grad(loss))(params, x)


def run(body, check_vma=True):
  m = mesh()
  params, x = problem()
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(PSPEC, XSPEC), out_specs=PSPEC,
                            check_vma=check_vma))
  args = ({k: shard(v, m, PSPEC[k]) for k, v in params.items()}, shard(x, m, XSPEC))
  return f(*args), f.lower(*args).as_text()


def assert_grads(got, want):
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5)


def count(text, target):
  return len(re.findall(rf"custom_call @{target}\b", text))


@pytest.mark.timeout(180)
def test_reduce_grads_matches_lax_and_global():
  """replica_axis given to gather_params: the replica sum is reduce_grads' (one
  batched all-reduce per dtype on jax_smddp), nothing through XLA."""
  def smddp_body(p, x):
    full = hybrid.gather_params(p, "shard", replica_axis="replica")
    g = jax.grad(loss)(full, x)  # full-size gradients of this device's batch
    return hybrid.reduce_grads(g, "shard", "replica")

  def lax_body(p, x):
    full = jax.tree_util.tree_map(lambda v: jax.lax.all_gather(v, "shard", tiled=True), p)
    full = jax.lax.pcast(full, "replica", to="varying")
    g = jax.grad(loss)(full, x)
    return jax.lax.psum(jax.lax.psum_scatter(g, "shard", tiled=True), "replica")

  got, text = run(smddp_body)
  want, _ = run(lax_body)
  assert_grads(got, want)
  assert_grads(got, global_grads())
  # one collective per element type (float32, float64) and step
  assert count(text, "smddp_all_gather") == 2
  assert count(text, "smddp_reduce_scatter") == 2
  assert count(text, "smddp_all_reduce") == 2
  assert "stablehlo.all_reduce" not in text and "stablehlo.all_gather" not in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_grads_nothing_summed_twice(check_vma):
  """Without replica_axis in gather_params, check_vma=True autodiff sums over
  replicas itself; reduce_grads must not sum again (check_vma=False: it must)."""
  def body(p, x):
    g = jax.grad(loss)(hybrid.gather_params(p, "shard"), x)
    return hybrid.reduce_grads(g, "shard", "replica", mean=True)

  got, text = run(body, check_vma)
  assert_grads(got, jax.tree_util.tree_map(lambda g: g / (R * S), global_grads()))
  assert count(text, "smddp_all_reduce") == (0 if check_vma else 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_sharded_grads(check_vma):
  """Gradients of the shards themselves: the transpose of gather_params has
  reduce-scattered them within the shard group; add the replicas. (With
  check_vma=True the shards are typed invariant over 'replica', so autodiff has
  already summed their gradients there, through jax.lax, and there is nothing
  left to add.)"""
  def body(p, x):
    g = jax.grad(lambda p: loss(hybrid.gather_params(p, "shard", replica_axis="replica"), x))(p)
    return hybrid.reduce_sharded_grads(g, "replica")

  got, text = run(body, check_vma)
  assert_grads(got, global_grads())
  assert count(text, "smddp_reduce_scatter") == 2  # the transposes, one per dtype
  assert count(text, "smddp_all_reduce") == (0 if check_vma else 2)
