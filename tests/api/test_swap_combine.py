"""Combining under the lax swap (jax_smddp.swap.combine): a data-parallel step's gradient psums
make one engine all-reduce per element type, with the answers of the unswapped step and of the
swap without combining, bit for bit; all_gathers and psum_scatters alike; calls of other axes,
element types or that depend on each other stay apart."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from jax_smddp import distributed
from helpers import mesh_1d, mesh_2d, shard


def _calls(text: str) -> dict:
  out = {}
  for target in re.findall(r'custom_call_target="(smddp_\w+)"', text):
    out[target] = out.get(target, 0) + 1
  return out


def _run(f, args, ops="all", combine_bytes=None, monkeypatch=None):
  """(answers, compiled text, engine calls counted in one run) with `ops` swapped."""
  if combine_bytes is not None:
    monkeypatch.setenv("JAX_SMDDP_COMBINE_BYTES", str(combine_bytes))
  with smddp.use(ops):
    text = f.lower(*args).compile().as_text()
    jax.block_until_ready(f(*args))
    before = distributed.traffic_by_op()
    out = jax.tree_util.tree_map(np.asarray, f(*args))
    after = distributed.traffic_by_op()
  if combine_bytes is not None:
    monkeypatch.delenv("JAX_SMDDP_COMBINE_BYTES")
  counted = {op: after[op]["calls"] - before.get(op, {}).get("calls", 0) for op in after}
  return out, text, {k: v for k, v in counted.items() if v}


def _same(got, want):
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


def _dp_step(mesh, n_params=12):
  """A data-parallel step in plain jax.lax: value_and_grad of a little MLP, a psum per gradient
  (some in bfloat16) and one of the loss."""
  rng = np.random.default_rng(0)
  shapes = [(6, 5), (5,), (5, 7), (7,), (7, 3), (3,), (3, 4), (4,), (4, 4), (4,), (4, 2), (2,)]
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes[:n_params]]
  params[2] = params[2].astype(jnp.bfloat16)
  params[3] = params[3].astype(jnp.bfloat16)
  x = rng.standard_normal((mesh.size * 4, 6)).astype(np.float32)

  def loss(ps, x):
    h = x
    for w, b in zip(ps[0::2], ps[1::2]):
      h = jnp.tanh(h @ w.astype(jnp.float32) + b.astype(jnp.float32))
    return jnp.sum(h ** 2)

  def body(ps, x):
    l, grads = jax.value_and_grad(loss)(ps, x)
    grads = [jax.lax.psum(g, "x") for g in grads]
    return jax.lax.psum(l, "x"), [p - 0.1 * g.astype(p.dtype) for p, g in zip(ps, grads)]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([P()] * len(params), P("x")),
                            out_specs=(P(), [P()] * len(params)), check_vma=False))
  return f, ([shard(p, mesh, P()) for p in params], shard(x, mesh, P("x")))


@pytest.mark.timeout(200)
def test_data_parallel_step_makes_one_all_reduce_per_dtype(monkeypatch):
  mesh = mesh_1d()
  f, args = _dp_step(mesh)
  want = jax.tree_util.tree_map(np.asarray, f(*args))  # unswapped
  got, text, counted = _run(f, args)
  apart, text_apart, counted_apart = _run(f, args, combine_bytes=0, monkeypatch=monkeypatch)
  assert _calls(text) == {"smddp_all_reduce": 2}, _calls(text)  # float32 and bfloat16
  assert counted == {"smddp_all_reduce": 2 * mesh.size}, counted
  assert _calls(text_apart) == {"smddp_all_reduce": 13}, _calls(text_apart)
  assert "all-reduce" not in text
  _same(got, apart)  # combined = one call per psum, bit for bit
  _same(got[1], want[1])  # and the unswapped step's
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.timeout(200)
def test_gradients_through_combined_calls_are_unchanged():
  """jax.grad of a function of the combined step's outputs: the rewrite is at lowering, after
  differentiation, so gradients are those of the swap without combining."""
  mesh = mesh_1d()
  rng = np.random.default_rng(3)
  a, b = (rng.integers(-4, 4, (8, 3)).astype(np.float32) for _ in range(2))

  def body(a, b):
    def loss(a, b):
      return jnp.sum(jax.lax.psum(a * a, "x") * jax.lax.psum(b, "x"))
    return jax.grad(loss, argnums=(0, 1))(a, b)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                            out_specs=(P("x"), P("x"))))
  args = shard(a, mesh, P("x")), shard(b, mesh, P("x"))
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, _ = _run(f, args)
  _same(got, want)  # small integers: every order of summation gives the same floats
  assert _calls(text)["smddp_all_reduce"] < 4, _calls(text)


@pytest.mark.timeout(200)
def test_gathers_and_scatters_combined_with_their_layouts(monkeypatch):
  mesh = mesh_1d()
  n = mesh.size
  rng = np.random.default_rng(4)
  w1 = rng.standard_normal((n * 2, 3)).astype(np.float32)
  w2 = rng.standard_normal((5, n * 3)).astype(np.float32)
  g1 = rng.standard_normal((n * n * 2, 4)).astype(np.float32)
  g2 = rng.standard_normal((n, 2, n * 2)).astype(np.float32)
  i1 = rng.integers(-9, 9, (n * n, 2)).astype(np.int32)

  def body(w1, w2, g1, g2, i1):
    return (jax.lax.all_gather(w1, "x", axis=0, tiled=True),
            jax.lax.all_gather(w2, "x", axis=1, tiled=True),
            jax.lax.all_gather(w1, "x", axis=1, tiled=False),
            jax.lax.psum_scatter(g1, "x", scatter_dimension=0, tiled=True),
            jax.lax.psum_scatter(g2[0], "x", scatter_dimension=1, tiled=True),
            jax.lax.psum_scatter(g1[:n], "x", scatter_dimension=0, tiled=False),
            jax.lax.psum_scatter(i1, "x", scatter_dimension=0, tiled=True))

  specs = (P("x"), P(None, "x"), P("x"), P("x"), P("x"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                            out_specs=(P(), P(), P("x"), P("x"), P("x"), P("x"), P("x")),
                            check_vma=False))
  args = tuple(shard(v, mesh, s) for v, s in zip((w1, w2, g1, g2, i1), specs))
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, _ = _run(f, args)
  apart, _, _ = _run(f, args, combine_bytes=0, monkeypatch=monkeypatch)
  assert _calls(text) == {"smddp_all_gather": 1, "smddp_reduce_scatter": 2}, _calls(text)
  _same(got, apart)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[0], w1)  # independent: a tiled gather of the shards


@pytest.mark.timeout(200)
def test_bool_gathers_combine_and_bool_reductions_stay_lax():
  """The engine moves bools but reduces none: gathers of bools are combined, their pmax not."""
  mesh = mesh_1d()
  n = mesh.size
  rng = np.random.default_rng(6)
  b1 = rng.integers(0, 2, (n * 2, 3)).astype(np.bool_)
  b2 = rng.integers(0, 2, (n, 5)).astype(np.bool_)

  def body(b1, b2):
    return (jax.lax.all_gather(b1, "x", tiled=True), jax.lax.all_gather(b2, "x", tiled=True),
            jax.lax.pmax(b1, "x"), jax.lax.pmax(b2, "x"))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                            out_specs=(P(), P(), P("x"), P("x")), check_vma=False))
  args = shard(b1, mesh, P("x")), shard(b2, mesh, P("x"))
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, _ = _run(f, args)
  assert _calls(text) == {"smddp_all_gather": 1}, _calls(text)
  _same(got, want)
  np.testing.assert_array_equal(got[0], b1)  # independent: a tiled gather of the shards
  np.testing.assert_array_equal(got[3], np.tile(b2.any(0), (n, 1)))


@pytest.mark.timeout(200)
def test_other_axes_dtypes_and_dependent_calls_stay_apart():
  mesh = mesh_2d()  # r=2, s=4
  rng = np.random.default_rng(5)
  a = rng.integers(-5, 5, (8, 3)).astype(np.float32)
  i = rng.integers(-5, 5, (8, 3)).astype(np.int32)

  def body(a, i):
    x = jax.lax.psum(a, "r")
    y = jax.lax.psum(a, "s")        # another group: its own call
    z = jax.lax.psum(i, "r")        # another element type: its own call
    u = jax.lax.psum(x * 2, "r")    # depends on x: cannot join x's call
    v = jax.lax.psum(a + 1, "r")    # joins x
    return x, y, z, u, v

  spec = P(("r", "s"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 5,
                            check_vma=False))
  args = shard(a, mesh, spec), shard(i, mesh, spec)
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, _ = _run(f, args)
  _same(got, want)
  assert _calls(text) == {"smddp_all_reduce": 4}, _calls(text)


@pytest.mark.timeout(200)
def test_threshold_splits_calls(monkeypatch):
  mesh = mesh_1d()
  xs = [np.full((8, 16), k, np.float32) for k in range(6)]  # 64 bytes per device each

  def body(*xs):
    return [jax.lax.psum(x, "x") for x in xs]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=[P()] * 6))
  args = [shard(x, mesh, P("x")) for x in xs]
  got, text, _ = _run(f, args, combine_bytes=128, monkeypatch=monkeypatch)
  assert _calls(text) == {"smddp_all_reduce": 3}, _calls(text)
  for k, g in enumerate(got):
    np.testing.assert_array_equal(g, np.full((1, 16), 8 * k, np.float32))


@pytest.mark.timeout(200)
def test_the_psums_autodiff_inserts_are_combined_too():
  """With check_vma, jax.grad of replicated parameters inserts psums itself (psum_invariant):
  the rewrite runs after differentiation, so they are combined like the program's own."""
  mesh = mesh_1d()
  rng = np.random.default_rng(6)
  params = [rng.standard_normal(s).astype(np.float32) for s in ((6, 5), (5,), (5, 3), (3,))]
  x = rng.standard_normal((mesh.size * 4, 6)).astype(np.float32)

  def loss(ps, x):
    h = x
    for w, b in zip(ps[0::2], ps[1::2]):
      h = jnp.tanh(h @ w + b)
    return jnp.sum(h ** 2)

  def body(ps, x):
    value, grads = jax.value_and_grad(loss)(ps, x)
    return jax.lax.psum(value, "x"), grads

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([P()] * 4, P("x")),
                            out_specs=(P(), [P()] * 4)))
  args = ([shard(p, mesh, P()) for p in params], shard(x, mesh, P("x")))
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, counted = _run(f, args)
  assert _calls(text) == {"smddp_all_reduce": 1}, _calls(text)
  assert counted == {"smddp_all_reduce": mesh.size}, counted
  _same(got, want)


@pytest.mark.timeout(200)
def test_psum_of_a_pytree_is_combined_by_element_type():
  """jax.lax.psum of a pytree (a psum per leaf in this jax): one engine call per element type."""
  mesh = mesh_1d()
  tree = {"a": np.arange(16, dtype=np.float32).reshape(8, 2),
          "b": np.ones((8, 3), np.float32), "i": np.arange(8, dtype=np.int32).reshape(8, 1)}

  def body(t):
    return jax.lax.psum(t, "x")

  specs = {k: P("x") for k in tree}
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs={k: P() for k in tree},
                            check_vma=False))
  args = ({k: shard(v, mesh, P("x")) for k, v in tree.items()},)
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  got, text, _ = _run(f, args)
  assert _calls(text) == {"smddp_all_reduce": 2} and "all-reduce" not in text, _calls(text)
  _same(got, want)
  np.testing.assert_array_equal(got["i"], [[28]])  # independent: 0 + 1 + ... + 7


@pytest.mark.timeout(200)
def test_a_bucket_the_engine_turns_down_lowers_call_by_call(monkeypatch, caplog):
  import logging

  from jax_smddp import requirements
  from jax_smddp.swap import combine
  monkeypatch.setattr(requirements, "_warned", set())
  monkeypatch.setattr(combine._ar, "_lower", lambda *a, **k: "refused for this test")
  mesh = mesh_1d()
  a, b = np.arange(16, dtype=np.float32).reshape(8, 2), np.ones((8, 3), np.float32)

  def body(a, b):
    return jax.lax.psum(a, "x"), jax.lax.psum(b, "x")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P(), P())))
  args = shard(a, mesh, P("x")), shard(b, mesh, P("x"))
  want = jax.tree_util.tree_map(np.asarray, f(*args))
  with caplog.at_level(logging.WARNING, logger="jax_smddp"):
    got, text, _ = _run(f, args)
  _same(got, want)
  assert "smddp_all_reduce" not in text and text.count("all-reduce(") >= 1, text
  messages = [r.getMessage() for r in caplog.records]
  assert any("combined all_reduce lowers call by call" in m and "refused for this test" in m
             for m in messages), messages
