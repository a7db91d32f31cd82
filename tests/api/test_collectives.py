"""Every collective against jax.lax (and numpy) on data that reveals misplaced
blocks: dtypes, axes, tiled/untiled, uneven shapes, 1-D and 2-D meshes."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import assert_same, lowered_text, mesh_1d, mesh_2d, random_array, run

ALL_DTYPES = [np.float32, np.float64, jnp.bfloat16, np.float16, np.int8, np.int32,
              np.int64, np.uint8, np.uint32, np.bool_]
REDUCE_DTYPES = [d for d in ALL_DTYPES if d is not np.bool_]

# (mesh factory, in_spec over the leading dim, collective axis names)
LAYOUTS = {
    "1d": (mesh_1d, P("x"), "x"),
    "2d-s": (mesh_2d, P(("r", "s")), "s"),
    "2d-r": (mesh_2d, P(("r", "s")), "r"),
    "2d-rs": (mesh_2d, P(("r", "s")), ("r", "s")),
    "2d-sr": (mesh_2d, P(("r", "s")), ("s", "r")),
}


def both(smddp_body, lax_body, x, layout, out_spec=None, check_vma=True):
  make_mesh, in_spec, _ = LAYOUTS[layout]
  mesh = make_mesh()
  out_spec = in_spec if out_spec is None else out_spec
  _, got = run(smddp_body, x, mesh, in_spec, out_spec, check_vma)
  _, want = run(lax_body, x, mesh, in_spec, out_spec, check_vma)
  return got, want


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_gather_dtypes_layouts(dtype, layout):
  axes = LAYOUTS[layout][2]
  x = random_array((8 * 3, 5), dtype)
  got, want = both(lambda v: smddp.all_gather(v, axes, tiled=True),
                   lambda v: jax.lax.all_gather(v, axes, tiled=True), x, layout)
  assert_same(got, want, dtype)


@pytest.mark.parametrize("axis,tiled", [(0, False), (1, False), (2, False), (-1, False),
                                        (0, True), (1, True), (-1, True)])
@pytest.mark.parametrize("layout", ["1d", "2d-rs"])
def test_all_gather_axes(axis, tiled, layout):
  axes = LAYOUTS[layout][2]
  x = random_array((8 * 3, 7), np.float32)
  got, want = both(lambda v: smddp.all_gather(v, axes, axis=axis, tiled=tiled),
                   lambda v: jax.lax.all_gather(v, axes, axis=axis, tiled=tiled), x, layout)
  assert_same(got, want, np.float32)


def test_all_gather_matches_numpy():
  x = random_array((8 * 2, 3), np.float32)
  mesh = mesh_1d()
  _, got = run(lambda v: smddp.all_gather(v, "x", axis=1, tiled=True), x, mesh, P("x"), P("x"))
  # every rank holds all blocks side by side along axis 1
  blocks = np.split(x, 8, axis=0)
  expect = np.concatenate([np.concatenate(blocks, axis=1)] * 8, axis=0)
  np.testing.assert_array_equal(np.asarray(got), expect)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_psum_scatter_dtypes_layouts(dtype, layout):
  axes = LAYOUTS[layout][2]
  n = 8 if layout in ("1d", "2d-rs", "2d-sr") else (4 if layout == "2d-s" else 2)
  x = random_array((8 * n * 3, 5), dtype)
  got, want = both(lambda v: smddp.psum_scatter(v, axes, tiled=True),
                   lambda v: jax.lax.psum_scatter(v, axes, tiled=True), x, layout)
  assert_same(got, want, dtype)


@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (2, True), (0, False), (1, False)])
def test_psum_scatter_dims(dim, tiled):
  shape = [3, 5, 6]
  shape[dim] = 8 * (3 if tiled else 1)
  x = random_array((8 * shape[0],) + tuple(shape[1:]), np.float32)
  if dim == 0:
    x = random_array((8 * shape[0],) + tuple(shape[1:]), np.float32)
  got, want = both(lambda v: smddp.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled),
                   lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled),
                   x, "1d")
  assert_same(got, want, np.float32)


def test_reduce_scatter_is_psum_scatter_and_matches_numpy():
  x = random_array((8 * 16, 3), np.float64)
  mesh = mesh_1d()
  _, got = run(lambda v: smddp.reduce_scatter(v, "x", tiled=True), x, mesh, P("x"), P("x"))
  total = x.reshape(8, 16, 3).sum(axis=0)  # sum over ranks of each rank's [16, 3] block
  np.testing.assert_allclose(np.asarray(got), total, rtol=1e-12)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("layout", ["1d", "2d-s", "2d-r", "2d-rs"])
def test_all_reduce(dtype, op, layout):
  axes = LAYOUTS[layout][2]
  lax_fn = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op]
  x = random_array((8 * 3, 7), dtype, seed=1)
  got, want = both(lambda v: smddp.all_reduce(v, axes, op=op),
                   lambda v: lax_fn(v, axes), x, layout)
  assert_same(got, want, dtype)


def test_psum_matches_numpy_and_names():
  x = random_array((8 * 5, 3), np.float64)
  mesh = mesh_1d()
  for fn, ref in ((smddp.psum, np.sum), (smddp.pmax, np.max), (smddp.pmin, np.min)):
    _, got = run(lambda v: fn(v, "x"), x, mesh, P("x"), P())
    np.testing.assert_allclose(np.asarray(got), ref(x.reshape(8, 5, 3), axis=0), rtol=1e-12)


def test_psum_bool_counts_like_lax():
  x = random_array((8 * 4,), np.bool_)
  got, want = both(lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), x, "1d", P())
  assert_same(got, want, np.int32)


@pytest.mark.parametrize("n_elems", [1, 3, 7, 8, 9, 1000, 4099])
def test_all_reduce_uneven_shards(n_elems):
  # Fewer elements than ranks, and counts that do not split evenly.
  x = random_array((8 * n_elems,), np.float32, seed=n_elems)
  got, want = both(lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), x, "1d", P())
  assert_same(got, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("split,concat,tiled", [(0, 0, True), (1, 1, True), (0, 1, True),
                                                (1, 0, True), (2, 0, True), (0, 1, False),
                                                (1, 0, False), (1, 2, False)])
def test_all_to_all(dtype, split, concat, tiled):
  shape = [8 * 2, 6, 5]
  if tiled:
    shape[split] = 8 * (shape[split] // 8 + 1) if split else shape[0]
  else:
    shape[split] = 8 if split else shape[0]
  x = random_array((shape[0] * (8 if split else 1),) + tuple(shape[1:]), dtype)
  if split == 0:
    x = random_array((8 * (8 * 2 if tiled else 8),) + tuple(shape[1:]), dtype)
  got, want = both(lambda v: smddp.all_to_all(v, "x", split, concat, tiled=tiled),
                   lambda v: jax.lax.all_to_all(v, "x", split, concat, tiled=tiled), x, "1d")
  assert_same(got, want, dtype)


@pytest.mark.parametrize("layout", ["2d-s", "2d-rs"])
def test_all_to_all_2d(layout):
  axes = LAYOUTS[layout][2]
  x = random_array((8 * 8, 3), np.float32)
  got, want = both(lambda v: smddp.all_to_all(v, axes, 0, 1, tiled=True),
                   lambda v: jax.lax.all_to_all(v, axes, 0, 1, tiled=True), x, layout)
  assert_same(got, want, np.float32)


def test_zero_size_and_scalar_inputs():
  x = random_array((8 * 2, 0), np.float32)
  got, want = both(lambda v: smddp.all_gather(v, "x", tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", tiled=True), x, "1d")
  assert got.shape == want.shape and got.dtype == want.dtype
  x = random_array((8,), np.float32)
  got, want = both(lambda v: smddp.psum(v[0], "x")[None], lambda v: jax.lax.psum(v[0], "x")[None],
                   x, "1d", P())
  assert_same(got, want, np.float32)


def test_pytree_inputs():
  x = random_array((8 * 4, 3), np.float32)
  def body(fn):
    return lambda v: fn({"a": v, "b": [2 * v]}, "x")["b"][0]
  got, want = both(body(lambda t, a: smddp.psum(t, a)), body(lambda t, a: jax.lax.psum(t, a)),
                   x, "1d", P())
  assert_same(got, want, np.float32)


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_vma_modes(check_vma):
  x = random_array((8 * 8, 3), np.float32)
  for s_fn, l_fn, out in (
      (lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), P()),
      (lambda v: smddp.all_gather(v, "x", tiled=True), lambda v: jax.lax.all_gather(v, "x", tiled=True), P("x")),
      (lambda v: smddp.psum_scatter(v, "x", tiled=True), lambda v: jax.lax.psum_scatter(v, "x", tiled=True), P("x"))):
    got, want = both(s_fn, l_fn, x, "1d", out, check_vma=check_vma)
    assert_same(got, want, np.float32)


# --- what reaches XLA -------------------------------------------------------

@pytest.mark.parametrize("body,target,native", [
    (lambda v: smddp.all_gather(v, "x", tiled=True), "smddp_all_gather", "stablehlo.all_gather"),
    (lambda v: smddp.psum_scatter(v, "x", tiled=True), "smddp_reduce_scatter", "stablehlo.reduce_scatter"),
    (lambda v: smddp.psum(v, "x"), "smddp_all_reduce", "stablehlo.all_reduce"),
    (lambda v: smddp.pmax(v, "x"), "smddp_all_reduce", "stablehlo.all_reduce"),
    (lambda v: smddp.all_to_all(v, "x", 0, 1, tiled=True), "smddp_all_to_all", "stablehlo.all_to_all"),
])
def test_lowering_uses_plugin_custom_call(body, target, native):
  x = random_array((8 * 8, 4), np.float32)
  text = lowered_text(body, x, mesh_1d(), P("x"), P("x"), check_vma=False)
  assert f'stablehlo.custom_call @{target}' in text
  assert native not in text


def test_grad_lowering_has_no_xla_collectives():
  x = random_array((8 * 8, 4), np.float32)
  mesh = mesh_1d()
  def loss(w):
    f = jax.shard_map(lambda v: (smddp.all_gather(v, "x", tiled=True) ** 2).sum(keepdims=True),
                      mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return f(w).sum()
  from helpers import shard
  text = jax.jit(jax.grad(loss)).lower(shard(x, mesh, P("x"))).as_text()
  assert "@smddp_all_gather" in text and "@smddp_reduce_scatter" in text
  assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text


def test_unsupported_dtype_falls_back_to_lax():
  x = (random_array((8 * 4, 3), np.float32) + 1j * random_array((8 * 4, 3), np.float32, seed=3)
       ).astype(np.complex64)
  text = lowered_text(lambda v: smddp.psum(v, "x"), x, mesh_1d(), P("x"), P())
  assert "smddp_all_reduce" not in text and "stablehlo.all_reduce" in text
  got, want = both(lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), x, "1d", P())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("helpers", ["0", "7"])
def test_body_sharing_modes(helpers, tmp_path):
  # The in-process transport runs collective bodies on the last rank to
  # arrive plus JAX_SMDDP_CPU_HELPERS woken ranks: check both extremes.
  import subprocess
  import sys
  import textwrap
  script = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, NamedSharding
    import jax_smddp as smddp
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(jnp.arange(8 * 4096, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    for s, l, out in ((lambda v: smddp.all_gather(v, "x", tiled=True), lambda v: jax.lax.all_gather(v, "x", tiled=True), P("x")),
                      (lambda v: smddp.psum_scatter(v, "x", tiled=True), lambda v: jax.lax.psum_scatter(v, "x", tiled=True), P("x")),
                      (lambda v: smddp.psum(v, "x"), lambda v: jax.lax.psum(v, "x"), P())):
      f = jax.jit(jax.shard_map(s, mesh=mesh, in_specs=P("x"), out_specs=out))
      g = jax.jit(jax.shard_map(l, mesh=mesh, in_specs=P("x"), out_specs=out))
      for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(g(x)))
    print("OK")
  """)
  path = tmp_path / "modes.py"
  path.write_text(script)
  env = dict(os.environ, JAX_SMDDP_CPU_HELPERS=helpers)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=170)
  assert proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
