"""jax_smddp.unshard under plain jax.jit (no shard_map): pjit-style FSDP with
parameters stored sharded, on meshes with Auto axes (custom_partitioning) and
Explicit axes (typed reduced/unreduced)."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_smddp as smddp

SPECS = {"w1": P("fsdp"), "w2": P(None, "fsdp"), "b": P("fsdp")}


def make_mesh(kind, shape=(8,), names=("fsdp",)):
  t = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(t,) * len(names))


def setup(mesh, specs=SPECS):
  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((32, 64)).astype(np.float32) / 4,
            "w2": rng.standard_normal((64, 16)).astype(np.float32) / 4,
            "b": rng.standard_normal((64,)).astype(np.float32)}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  x = jax.device_put(rng.standard_normal((16, 32)).astype(np.float32),
                     NamedSharding(mesh, P(mesh.axis_names[0])))
  return params, x


def mlp_loss(gather, gather_bias=None):
  gather_bias = gather_bias or gather

  def loss(params, x):
    h = jnp.tanh(x @ gather(params["w1"]) + gather_bias(params["b"]))
    return jnp.mean((h @ gather(params["w2"])) ** 2)
  return loss


def compiled_targets(f, *args):
  return sorted(set(re.findall(r'custom_call_target="(smddp_\w+)"', f.lower(*args).compile().as_text())))


def mesh_context(mesh, kind):
  import contextlib
  return jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_fsdp_grads_match_plain_jit(kind):
  mesh = make_mesh(kind)
  params, x = setup(mesh)
  if kind == "explicit":
    plain_gather = lambda w: jax.sharding.reshard(w, P())
  else:
    plain_gather = lambda w: w
  with mesh_context(mesh, kind):
    plain = jax.jit(jax.value_and_grad(mlp_loss(plain_gather)))
    # a bias added to batch-sharded activations cannot be typed reduced
    fsdp = jax.jit(jax.value_and_grad(mlp_loss(lambda w: smddp.unshard(w, "fsdp"),
                                               lambda b: smddp.unshard(b, "fsdp", reduced=False))))
    (l0, g0), (l1, g1) = plain(params, x), fsdp(params, x)
    targets = compiled_targets(fsdp, params, x)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for k in params:
    np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g0[k]), rtol=1e-5, atol=1e-6)
    assert g1[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim), (k, g1[k].sharding)
  assert "smddp_all_gather" in targets
  if kind == "explicit":  # the gradient reaches the transpose unreduced: the plugin reduces it
    assert "smddp_reduce_scatter" in targets


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_value_and_layout(kind):
  mesh = make_mesh(kind, (4, 2), ("fsdp", "tp"))
  w = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
  ws = jax.device_put(w, NamedSharding(mesh, P("fsdp", "tp")))
  with mesh_context(mesh, kind):
    f = jax.jit(lambda w: smddp.unshard(w, "fsdp", dim=0))
    out = f(ws)
    targets = compiled_targets(f, ws)
  np.testing.assert_array_equal(np.asarray(out), w)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2), out.sharding
  assert "smddp_all_gather" in targets
  if kind == "auto":
    assert "all_gather" not in jax.jit(lambda w: smddp.unshard(w, "fsdp")).lower(ws).as_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hint", [False, True])
def test_tensor_parallel_grads_2d(hint):
  """FSDP over 'fsdp' with tensor parallelism over 'tp' left in place."""
  mesh = make_mesh("auto", (4, 2), ("fsdp", "tp"))
  specs = {"w1": P("fsdp", "tp"), "w2": P("tp", "fsdp"), "b": P("tp")}
  dims = {64 * 32: 0, 64 * 16: 1, 64: None}  # by size: w1, w2, b

  def gather(w):
    return smddp.unshard(w, "fsdp", dim=dims[w.size] if hint else None)

  params, x = setup(mesh, specs)
  plain = jax.jit(jax.value_and_grad(mlp_loss(lambda w: w)))
  fsdp = jax.jit(jax.value_and_grad(mlp_loss(gather)))
  (l0, g0), (l1, g1) = plain(params, x), fsdp(params, x)
  assert "smddp_all_gather" in compiled_targets(fsdp, params, x)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for k in params:
    np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g0[k]), rtol=1e-5, atol=1e-6)
    assert g1[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)


@pytest.mark.timeout(120)
def test_axis_not_minor_most_and_unsharded():
  """'fsdp' major in ("fsdp", "tp"): XLA reshards; a replicated array is left alone."""
  mesh = make_mesh("auto", (4, 2), ("fsdp", "tp"))
  w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  ws = jax.device_put(w, NamedSharding(mesh, P(("fsdp", "tp"))))
  wr = jax.device_put(w, NamedSharding(mesh, P()))
  f = jax.jit(lambda a, b: (smddp.unshard(a, "fsdp"), smddp.unshard(b, "fsdp")))
  a, b = f(ws, wr)
  np.testing.assert_array_equal(np.asarray(a), w)
  np.testing.assert_array_equal(np.asarray(b), w)
  g = jax.jit(jax.grad(lambda a: jnp.sum(smddp.unshard(a, "fsdp") ** 2)))(ws)
  np.testing.assert_allclose(np.asarray(g), 2 * w)


def test_rejects_non_string_axis_and_shard_map():
  with pytest.raises(TypeError, match="axis names"):
    smddp.unshard(jnp.ones(4), 0)
  mesh = make_mesh("auto")
  f = jax.shard_map(lambda w: smddp.unshard(w, "fsdp"), mesh=mesh, in_specs=P("fsdp"),
                    out_specs=P("fsdp"))
  with pytest.raises(ValueError, match="jax_smddp.all_gather"):
    jax.jit(f)(jnp.ones(8))
