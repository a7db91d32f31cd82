"""jax_smddp.pbroadcast on the engine's host family (8 CPU devices in one process): every
rank gets the source's block, in three dtypes, against numpy and against jax.lax's
documented definition (a psum of the value masked to the source: jax.lax.pbroadcast itself
has no CPU lowering); over one axis of a 2-D mesh and over both, in either order; each
compiled program calling jax_smddp's collective_permute, not XLA's collective-broadcast or
all-reduce; gradients and transposition against jax.lax's transpose rule, vmap; the lax
swap (jax.lax.pbroadcast on the engine); the fallback where the engine does not take it."""

from __future__ import annotations

import inspect
import logging

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from jax_smddp import requirements
from helpers import mesh_1d, mesh_2d, shard

pytestmark = pytest.mark.timeout(120)

SOURCES = pytest.mark.parametrize("source", [0, 5])


def _documented(x, axis_name, source):
  """jax.lax.pbroadcast as its docstring defines it."""
  masked = jnp.where(jax.lax.axis_index(axis_name) == source, x, jnp.zeros_like(x))
  return jax.lax.psum(masked, axis_name)


def _compiled(fn, source, x, mesh=None, axis="x", spec=P("x")):
  mesh = mesh or mesh_1d()
  f = jax.jit(jax.shard_map(lambda b: fn(b, axis, source), mesh=mesh, in_specs=spec,
                            out_specs=spec))
  xs = shard(x, mesh, spec)
  return np.asarray(f(xs)), f.lower(xs).compile().as_text()


def _numpy(x, source, n=8):
  return np.concatenate([np.split(x, n)[source]] * n)


@SOURCES
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_answers_are_numpys_and_jax_laxs(source, dtype):
  x = ((np.arange(8 * 4 * 5) * 7 % 251) - 125).reshape(8 * 4, 5).astype(dtype)
  got, text = _compiled(smddp.pbroadcast, source, x)
  want, _ = _compiled(_documented, source, x)
  np.testing.assert_array_equal(got, _numpy(x, source))
  np.testing.assert_array_equal(got, want)
  assert got.dtype == x.dtype
  assert 'custom_call_target="smddp_collective_permute"' in text, text[-3000:]
  assert "collective-broadcast" not in text and "all-reduce" not in text


@pytest.mark.parametrize("axis,source", [("s", 2), (("r", "s"), 6), (("s", "r"), 3)])
def test_one_axis_of_a_2d_mesh_and_both(axis, source):
  mesh = mesh_2d()  # ("r", "s") = (2, 4)
  x = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8 * 3, 2)
  spec = P(("r", "s"))
  got, text = _compiled(smddp.pbroadcast, source, x, mesh, axis, spec)
  want, _ = _compiled(_documented, source, x, mesh, axis, spec)
  np.testing.assert_array_equal(got, want, err_msg=str(axis))
  # One source per group: over "s", one per row of the mesh; over both, one for all.
  assert len({got[i * 3:(i + 1) * 3].tobytes() for i in range(8)}) == (2 if axis == "s" else 1)
  assert "smddp_collective_permute" in text


def _loss(fn, source, weights):
  def body(v):
    if weights is None:  # one scalar per rank
      v, weights_ = v[0], 1.0
    else:
      weights_ = weights
    return jax.lax.psum(jnp.sum(jnp.sin(fn(v * v, "x", source)) * weights_ *
                                (1 + jax.lax.axis_index("x"))), "x")
  return body


def _grad(fn, source, weights=None):
  return jax.jit(jax.grad(jax.shard_map(_loss(fn, source, weights), mesh=mesh_1d(),
                                        in_specs=P("x"), out_specs=P())))


@SOURCES
def test_gradient_is_numpys_and_jax_laxs_rule(source):
  mesh = mesh_1d()
  x = np.random.default_rng(0).standard_normal((8 * 3, 4)).astype(np.float32)
  xs = shard(x, mesh, P("x"))
  weights = jnp.arange(12.0).reshape(3, 4)
  got = np.asarray(_grad(smddp.pbroadcast, source, weights)(xs))
  # Only the source's block has a gradient: 2 v cos(v^2) w, times the ranks' weights (1..8).
  v = np.split(x, 8)[source]
  ref = np.zeros_like(x)
  ref[source * 3:(source + 1) * 3] = 2 * v * np.cos(v * v) * np.asarray(weights) * 36
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
  text = _grad(smddp.pbroadcast, source, weights).lower(xs).compile().as_text()
  assert "smddp_collective_permute" in text and "smddp_all_reduce" in text
  # jax.lax.pbroadcast's own rule (run on CPU by the swap) builds the cotangent with
  # full_like, which takes scalars only: compared on one scalar per rank.
  s = shard(x[:8, 0], mesh, P("x"))
  with smddp.use("collective_permute"):
    want = np.asarray(_grad(jax.lax.pbroadcast, source)(s))
  np.testing.assert_allclose(np.asarray(_grad(smddp.pbroadcast, source)(s)), want, rtol=1e-6)
  assert np.count_nonzero(want) == 1


@SOURCES
def test_transpose_is_jax_laxs(source):
  mesh = mesh_1d()
  x = np.arange(8 * 2 * 3, dtype=np.float32).reshape(8 * 2, 3)

  def transposed(fn, scalar=False):
    def body(ct):
      ct = ct[0] if scalar else ct
      out = jax.linear_transpose(lambda v: fn(v, "x", source), ct)(ct)[0]
      return out[None] if scalar else out
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  got = np.asarray(transposed(smddp.pbroadcast)(shard(x, mesh, P("x"))))
  ref = np.zeros_like(x)
  ref[source * 2:(source + 1) * 2] = sum(np.split(x, 8))
  np.testing.assert_array_equal(got, ref)
  s = shard(x[:8, 1], mesh, P("x"))  # jax.lax's rule takes scalars only
  np.testing.assert_array_equal(np.asarray(transposed(smddp.pbroadcast, True)(s)),
                                np.asarray(transposed(jax.lax.pbroadcast, True)(s)))


def test_vmap_inside_and_over_the_axis():
  mesh = mesh_1d()
  x = np.arange(8 * 2 * 3, dtype=np.int32).reshape(8 * 2, 3)
  body = lambda v: jax.vmap(lambda row: smddp.pbroadcast(row, "x", 6))(v)
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
      shard(x, mesh, P("x")))
  np.testing.assert_array_equal(np.asarray(got), _numpy(x, 6))
  # Over a vmapped axis of its own name: a gather, no communication (jax.lax's rule passes
  # jnp.take a list, which it refuses: numpy is the reference).
  y = jnp.arange(8 * 3.0).reshape(8, 3)
  for axis in (0, 1):
    over = jax.vmap(lambda v: smddp.pbroadcast(v, "i", 2), in_axes=axis, out_axes=axis,
                    axis_name="i")(y if axis == 0 else y.T)
    np.testing.assert_array_equal(np.asarray(over if axis == 0 else over.T),
                                  np.tile(y[2], (8, 1)))


def test_a_source_off_the_axis_is_refused_naming_it():
  mesh = mesh_1d()
  for source, error in ((8, ValueError), (-1, ValueError), (1.5, TypeError)):
    f = jax.jit(jax.shard_map(lambda b, s=source: smddp.pbroadcast(b, "x", s), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(error, match="source"):
      f(shard(np.zeros((8, 2), np.float32), mesh, P("x")))


def test_swapped_jax_lax_pbroadcast_runs_on_the_engine():
  mesh = mesh_1d()
  x = np.random.default_rng(1).standard_normal((8 * 3, 5)).astype(np.float32)
  i = np.arange(8 * 2 * 4, dtype=np.int32).reshape(8 * 2, 4)
  body = lambda x, i: (jax.lax.pbroadcast(x, "x", 7), jax.lax.pbroadcast(i, "x", 1))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                            out_specs=(P("x"), P("x"))))
  args = shard(x, mesh, P("x")), shard(i, mesh, P("x"))
  with pytest.raises(NotImplementedError, match="pbroadcast"):  # XLA:CPU has none
    f.lower(*args)
  with smddp.use("all"):
    text = f.lower(*args).compile().as_text()
    got = f(*args)
  assert text.count('custom_call_target="smddp_collective_permute"') == 2, text
  assert "collective-broadcast" not in text
  np.testing.assert_array_equal(np.asarray(got[0]), _numpy(x, 7))
  np.testing.assert_array_equal(np.asarray(got[1]), _numpy(i, 1))
  assert smddp.swap.parse("pbroadcast") == {"collective_permute"}


def test_what_the_engine_does_not_take_is_the_documented_psum(caplog, monkeypatch):
  monkeypatch.setattr(requirements, "_warned", set())  # warned once per process
  mesh = mesh_1d()
  z = (np.arange(8 * 2) + 1j * np.arange(8 * 2)[::-1]).astype(np.complex64).reshape(8 * 2, 1)
  zs = shard(z, mesh, P("x"))
  for fn in (smddp.pbroadcast, jax.lax.pbroadcast):
    f = jax.jit(jax.shard_map(lambda v, fn=fn: fn(v, "x", 3), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    with smddp.use("all"), caplog.at_level(logging.WARNING, logger="jax_smddp"):
      got, text = np.asarray(f(zs)), f.lower(zs).compile().as_text()
    np.testing.assert_array_equal(got, _numpy(z, 3))
    assert "all-reduce" in text and "smddp_collective_permute" not in text
  assert any("pbroadcast" in r.getMessage() and "complex64" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_signature_is_jax_laxs():
  params = lambda fn: [(p.name, p.kind, p.default)
                       for p in inspect.signature(fn).parameters.values()]
  assert params(smddp.pbroadcast) == params(jax.lax.pbroadcast)
