"""jax_smddp.ragged_all_to_all on 8 CPU devices (XLA:CPU refuses jax.lax's, so the reference
is numpy running jax.lax's documented pseudocode): jax.lax's docstring example; random sizes
and offsets with several slices per rank, overlapping and empty slices, in three dtypes;
2-D meshes and axis_index_groups; each compiled program calling the engine's all_to_all and
no ragged-all-to-all; gradients against a jnp reference; vmap; an output made inside the
body; the errors; the lax swap (jax.lax.ragged_all_to_all on the engine, its gradient by
jax.lax's rules)."""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import mesh_1d, mesh_2d, shard

pytestmark = pytest.mark.timeout(180)


def reference(operands, outputs, ios, sss, oos, rss):
  """jax.lax.ragged_all_to_all's pseudocode (its docstring), one list entry per rank."""
  n = len(operands)
  k = len(ios[0])
  s = k // n
  results = [o.copy() for o in outputs]
  for r in range(n):
    for i in range(k):
      q, j = divmod(i, s)  # slot i comes from rank q, its slice r * s + j
      src = r * s + j
      off = oos[q][src]  # the sender names where it goes
      data = operands[q][ios[q][src]:ios[q][src] + sss[q][src]]
      size = rss[r][i]
      results[r][off:off + size] = data[:size]
  return results


def case(n, s, rows, out_rows, dtype, seed, *, max_size=None, tail=(3,)):
  """Random per-rank arguments: sizes from 0 (empty slices) up, offsets anywhere they fit
  (so slices overlap, in the operand and in the output)."""
  rng = np.random.default_rng(seed)
  k = n * s
  max_size = max_size or min(rows, out_rows)
  value = lambda shape: rng.integers(-100, 100, shape).astype(dtype)
  ops = [value((rows, *tail)) for _ in range(n)]
  outs = [value((out_rows, *tail)) for _ in range(n)]
  sss = [rng.integers(0, max_size + 1, k) for _ in range(n)]
  ios = [np.array([rng.integers(0, rows - z + 1) for z in ss]) for ss in sss]
  oos = [np.array([rng.integers(0, out_rows - z + 1) for z in ss]) for ss in sss]
  rss = [np.array([sss[i // s][r * s + i % s] for i in range(k)]) for r in range(n)]
  return ops, outs, ios, sss, oos, rss


def _function(fn, mesh, axis="x", spec=P("x"), **kw):
  body = lambda *a: fn(*a, axis_name=axis, **kw)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _global(per_rank, mesh, spec=P("x"), index_dtype=np.int32):
  ops, outs, *indices = per_rank
  return (shard(np.concatenate(ops), mesh, spec), shard(np.concatenate(outs), mesh, spec),
          *(shard(np.concatenate(v).astype(index_dtype), mesh, spec) for v in indices))


def test_jax_laxs_docstring_example():
  mesh = mesh_1d(2)
  per_rank = ([np.array([1, 2, 2.]), np.array([3, 4, 0.])], [np.zeros(4), np.zeros(4)],
              [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
  got = np.asarray(_function(smddp.ragged_all_to_all, mesh)(*_global(per_rank, mesh)))
  np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])
  np.testing.assert_array_equal(got, np.concatenate(reference(*per_rank)))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("s,rows,out_rows", [(1, 9, 12), (3, 10, 7)])
def test_random_slices_are_numpys(dtype, s, rows, out_rows):
  mesh = mesh_1d()
  per_rank = case(8, s, rows, out_rows, dtype, seed=s * 100 + rows)
  f = _function(smddp.ragged_all_to_all, mesh)
  args = _global(per_rank, mesh)
  got = np.asarray(f(*args))
  np.testing.assert_array_equal(got, np.concatenate(reference(*per_rank)))
  assert got.dtype == np.dtype(dtype)
  text = f.lower(*args).compile().as_text()
  assert 'custom_call_target="smddp_all_to_all"' in text, text[-3000:]
  assert "ragged-all-to-all" not in text and "all-to-all" not in text


def test_int64_offsets_and_rank3_rows():
  mesh = mesh_1d()
  per_rank = case(8, 2, 6, 8, np.float32, seed=7, tail=(2, 3))
  got = _function(smddp.ragged_all_to_all, mesh)(*_global(per_rank, mesh, index_dtype=np.int64))
  np.testing.assert_array_equal(np.asarray(got), np.concatenate(reference(*per_rank)))


def grouped(groups, s, rows, out_rows, dtype, seed):
  """A case per group (its ranks in the group's order), as per-rank lists, and its reference."""
  size = sum(len(g) for g in groups)
  per_rank, want = [[None] * size for _ in range(6)], [None] * size
  for gi, g in enumerate(groups):
    c = case(len(g), s, rows, out_rows, dtype, seed=seed + gi)
    for pos, rank in enumerate(g):
      for a in range(6):
        per_rank[a][rank] = c[a][pos]
      want[rank] = reference(*c)[pos]
  return per_rank, np.concatenate(want)


@pytest.mark.parametrize("axis", ["s", ("r", "s"), ("s", "r")])
def test_2d_meshes(axis):
  mesh = mesh_2d()  # ("r", "s") = (2, 4); device r * 4 + s holds block r * 4 + s
  spec = P(("r", "s"))
  groups = {"s": [[0, 1, 2, 3], [4, 5, 6, 7]], ("r", "s"): [list(range(8))],
            ("s", "r"): [[0, 4, 1, 5, 2, 6, 3, 7]]}[axis]
  per_rank, want = grouped(groups, 2, 7, 9, np.float32, seed=len(axis))
  got = _function(smddp.ragged_all_to_all, mesh, axis, spec)(*_global(per_rank, mesh, spec))
  np.testing.assert_array_equal(np.asarray(got), want)


def test_axis_index_groups():
  mesh = mesh_1d()
  groups = [[6, 0, 4, 2], [1, 7, 3, 5]]
  per_rank, want = grouped(groups, 2, 5, 6, np.int32, seed=11)
  f = jax.jit(jax.shard_map(
      lambda *a: smddp.ragged_all_to_all(*a, axis_name="x", axis_index_groups=groups),
      mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  np.testing.assert_array_equal(np.asarray(f(*_global(per_rank, mesh))), want)


def test_an_output_made_inside_the_body():
  mesh = mesh_1d()
  per_rank = case(8, 2, 6, 10, np.float32, seed=3)
  per_rank[1][:] = [np.zeros_like(o) for o in per_rank[1]]

  def body(operand, io, ss, oo, rs):
    output = jnp.zeros((10, 3), operand.dtype)
    return smddp.ragged_all_to_all(operand, output, io, ss, oo, rs, axis_name="x")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  args = _global(per_rank, mesh)
  got = f(args[0], *args[2:])
  np.testing.assert_array_equal(np.asarray(got), np.concatenate(reference(*per_rank)))


def _jnp_reference(operand, output, per_rank, n=8):
  """The same exchange on the global arrays with the slices known (static): jnp updates, in
  jax.lax's order, differentiable by jax itself."""
  _, _, ios, sss, oos, rss = per_rank
  rows, out_rows = operand.shape[0] // n, output.shape[0] // n
  k = len(ios[0])
  s = k // n
  for r in range(n):
    for i in range(k):
      q, j = divmod(i, s)
      src = r * s + j
      size, start, off = int(rss[r][i]), q * rows + int(ios[q][src]), r * out_rows + int(oos[q][src])
      output = output.at[off:off + size].set(operand[start:start + size])
  return output


def test_gradients_are_a_jnp_references():
  mesh = mesh_1d()
  per_rank = case(8, 2, 6, 8, np.float64, seed=5)  # overlapping slices in operand and output
  operand, output, *indices = _global(per_rank, mesh)
  weights = np.random.default_rng(1).standard_normal(output.shape)
  f = _function(smddp.ragged_all_to_all, mesh)

  def loss(fn):
    return lambda a, b: jnp.sum(jnp.sin(fn(a * a, b)) * weights)

  got = jax.jit(jax.grad(loss(lambda a, b: f(a, b, *indices)), argnums=(0, 1)))(operand, output)
  want = jax.grad(loss(lambda a, b: _jnp_reference(a, b, per_rank)), argnums=(0, 1))(
      np.asarray(operand), np.asarray(output))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)
  assert np.count_nonzero(np.asarray(got[0])) and np.count_nonzero(np.asarray(got[1]))


def test_vmap_over_a_batch():
  mesh = mesh_1d()
  cases = [case(8, 2, 5, 7, np.float32, seed=20 + b) for b in range(3)]
  stacked = [np.stack([np.concatenate(c[a]) for c in cases], axis=1) for a in range(6)]
  args = [shard(v if a < 2 else v.astype(np.int32), mesh, P("x")) for a, v in enumerate(stacked)]
  body = jax.vmap(lambda *a: smddp.ragged_all_to_all(*a, axis_name="x"), in_axes=1, out_axes=1)
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(*args)
  want = np.stack([np.concatenate(reference(*c)) for c in cases], axis=1)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_wrong_arguments_are_named():
  mesh = mesh_1d()
  f = _function(smddp.ragged_all_to_all, mesh)

  def call(change):
    per_rank = [list(v) for v in case(8, 1, 4, 4, np.float32, seed=0)]
    change(per_rank)
    return f(*_global(per_rank, mesh))

  def shorten(v):
    v[:] = [x[:-1] for x in v]

  with pytest.raises(ValueError, match="one length.*input_offsets.*recv_sizes"):
    call(lambda a: shorten(a[5]))
  with pytest.raises(ValueError, match="length 7 is not divisible by the 8 ranks of axis 'x'"):
    call(lambda a: [shorten(v) for v in a[2:]])
  with pytest.raises(TypeError, match="operand is float32 but output is int32"):
    call(lambda a: a.__setitem__(1, [x.astype(np.int32) for x in a[1]]))
  with pytest.raises(ValueError, match=r"operand rows \(3,\) and output rows \(2,\)"):
    call(lambda a: a.__setitem__(1, [x[:, :2] for x in a[1]]))
  sharded = _global(case(8, 1, 4, 4, np.float32, seed=0), mesh)
  with pytest.raises(TypeError, match="input_offsets is float32.*integers"):
    f(sharded[0], sharded[1], sharded[2].astype(np.float32), *sharded[3:])


def test_signature_is_jax_laxs():
  params = lambda fn: [(p.name, p.kind, p.default)
                       for p in inspect.signature(fn).parameters.values()]
  assert params(smddp.ragged_all_to_all) == params(jax.lax.ragged_all_to_all)


def test_swapped_jax_lax_ragged_all_to_all_runs_on_the_engine():
  mesh = mesh_1d()
  per_rank = case(8, 2, 6, 9, np.float32, seed=9)
  f = _function(jax.lax.ragged_all_to_all, mesh)
  args = _global(per_rank, mesh)
  with pytest.raises(Exception, match="ragged-all-to-all"):  # XLA:CPU has none
    f.lower(*args).compile()
  with smddp.use("all"):
    text = f.lower(*args).compile().as_text()
    got = np.asarray(f(*args))
  np.testing.assert_array_equal(got, np.concatenate(reference(*per_rank)))
  assert 'custom_call_target="smddp_all_to_all"' in text
  assert "ragged-all-to-all" not in text
  assert smddp.swap.parse("ragged_all_to_all") == {"all_to_all"}


def test_swapped_gradient_by_jax_laxs_rules():
  # jax.lax's transpose sends each cotangent slice back, overwriting: it is the gradient where
  # no operand row is sent twice and no output row written twice. Rank q sends its slice for
  # rank d from row 2d, which rank d writes at row 2q: 0 to 2 rows each.
  n = 8
  rng = np.random.default_rng(4)
  sizes = rng.integers(0, 3, (n, n))  # [q, d]
  per_rank = ([rng.standard_normal((2 * n, 3)) for _ in range(n)],
              [rng.standard_normal((2 * n, 3)) for _ in range(n)],
              [2 * np.arange(n)] * n, list(sizes), [np.full(n, 2 * q) for q in range(n)],
              list(sizes.T))
  f = _function(jax.lax.ragged_all_to_all, mesh_1d())
  operand, output, *indices = _global(per_rank, mesh_1d())
  weights = rng.standard_normal(output.shape)
  loss = lambda fn: lambda a, b: jnp.sum(jnp.sin(fn(a * a, b)) * weights)
  with smddp.use("all"):
    grad = jax.jit(jax.grad(loss(lambda a, b: f(a, b, *indices)), argnums=(0, 1)))
    got = grad(operand, output)
    assert "ragged-all-to-all" not in grad.lower(operand, output).compile().as_text()
  want = jax.grad(loss(lambda a, b: _jnp_reference(a, b, per_rank)), argnums=(0, 1))(
      np.asarray(operand), np.asarray(output))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)
