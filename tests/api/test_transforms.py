"""jax_smddp collectives under jit, grad, vmap, scan and remat give jax.lax's answers."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import mesh_1d, mesh_2d, random_array, shard

MESH = None


def mesh():
  global MESH
  if MESH is None:
    MESH = mesh_1d()
  return MESH


def grads_both(make_loss, x, in_spec=P("x"), m=None, check_vma=True):
  """jax.grad of the same loss written with jax_smddp and with jax.lax."""
  m = m or mesh()
  out = []
  for lib in (smddp, jax.lax):
    body = make_loss(lib)
    def loss(w, body=body):
      f = jax.shard_map(body, mesh=m, in_specs=in_spec, out_specs=P(), check_vma=check_vma)
      return f(w)
    out.append(jax.jit(jax.value_and_grad(loss))(shard(x, m, in_spec)))
  (v1, g1), (v2, g2) = out
  np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-6)
  return g1


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis,tiled", [(0, True), (1, True), (0, False), (2, False)])
def test_grad_all_gather(axis, tiled, check_vma):
  x = random_array((8 * 4, 6), np.float32)
  def make(lib):
    def body(v):
      g = lib.all_gather(v, "x", axis=axis, tiled=tiled)
      return lib.psum(jnp.sum(jnp.sin(g) * g), "x")
    return body
  grads_both(make, x, check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (0, False)])
def test_grad_psum_scatter(dim, tiled, check_vma):
  shape = (8 * 8, 16) if dim == 0 and tiled else ((8 * 8, 8) if not tiled else (8 * 2, 16))
  x = random_array(shape, np.float32)
  def make(lib):
    def body(v):
      if not tiled:
        v = v.reshape(8, -1)
      s = lib.psum_scatter(v * jnp.arange(v.shape[-1]), "x", scatter_dimension=dim, tiled=tiled)
      return lib.psum(jnp.sum(s ** 3), "x")
    return body
  grads_both(make, x, check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_psum(check_vma):
  x = random_array((8 * 3, 5), np.float32)
  def make(lib):
    def body(v):
      s = lib.psum(v * v, "x")
      return jnp.sum(jnp.cos(s)) + lib.psum(jnp.sum(v), "x")
    return body
  grads_both(make, x, check_vma=check_vma)


def test_grad_all_to_all():
  x = random_array((8 * 8, 6), np.float32)
  def make(lib):
    def body(v):
      a = lib.all_to_all(v, "x", 0, 1, tiled=True)
      return lib.psum(jnp.sum(jnp.tanh(a) * jnp.arange(a.shape[1])), "x")
    return body
  grads_both(make, x)


def test_grad_on_2d_mesh_fsdp_style():
  m = mesh_2d()
  x = random_array((8 * 4, 6), np.float32)
  def make(lib):
    def body(w):
      full = lib.all_gather(w, ("r", "s"), tiled=True)   # unshard the parameter
      h = jnp.tanh(full @ full.T)
      return lib.psum(jnp.sum(h) / 8.0, ("r", "s"))
    return body
  grads_both(make, x, in_spec=P(("r", "s")), m=m)


def test_jvp_all_gather():
  x = random_array((8 * 2, 3), np.float32)
  t = random_array((8 * 2, 3), np.float32, seed=7)
  m = mesh()
  res = []
  for lib in (smddp, jax.lax):
    f = jax.shard_map(lambda v, lib=lib: lib.all_gather(v, "x", tiled=True) ** 2,
                      mesh=m, in_specs=P("x"), out_specs=P("x"))
    res.append(jax.jit(lambda a, b, f=f: jax.jvp(f, (a,), (b,)))(shard(x, m, P("x")), shard(t, m, P("x"))))
  for a, b in zip(res[0], res[1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "psum", "all_to_all"])
@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_inside_shard_map(op, in_axes):
  x = random_array((8 * 4, 8, 8), np.float32)
  def call(lib, v):
    if op == "all_gather":
      return lib.all_gather(v, "x", axis=1, tiled=False)
    if op == "psum_scatter":
      return lib.psum_scatter(v, "x", scatter_dimension=1, tiled=False)
    if op == "psum":
      return lib.psum(v, "x")
    return lib.all_to_all(v, "x", 1, 0, tiled=True)
  outs = []
  for lib in (smddp, jax.lax):
    body = lambda v, lib=lib: jax.vmap(lambda u: call(lib, u), in_axes=in_axes, out_axes=0)(v)
    f = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=P("x"), out_specs=P("x")))
    outs.append(np.asarray(f(shard(x, mesh(), P("x")))))
  # Independent reference: apply the unbatched lax collective per batch element.
  def per_example(v):
    return jnp.stack([call(jax.lax, jnp.take(v, i, axis=in_axes)) for i in range(v.shape[in_axes])])
  f = jax.jit(jax.shard_map(per_example, mesh=mesh(), in_specs=P("x"), out_specs=P("x")))
  ref = np.asarray(f(shard(x, mesh(), P("x"))))
  np.testing.assert_allclose(outs[0], ref, rtol=1e-6)
  np.testing.assert_allclose(outs[1], ref, rtol=1e-6)


def test_vmap_with_the_collective_axis_name():
  # vmap over a named axis and a collective over that name: handled without
  # communication, as jax.lax does.
  x = random_array((4, 3), np.float32)
  got = jax.vmap(lambda v: smddp.psum(v, "b"), axis_name="b")(x)
  want = jax.vmap(lambda v: jax.lax.psum(v, "b"), axis_name="b")(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_scan_and_remat():
  x = random_array((8 * 4, 4), np.float32)
  def make(lib):
    def layer(h, w):
      full = lib.all_gather(w, "x", tiled=True)     # gathered per layer
      return jnp.tanh(h @ full[:4]), None
    def body(ws):
      h0 = jnp.ones((2, 4), jnp.float32) + 0.1 * ws[:2]   # varying, like the data
      stacked = jnp.stack([ws, 2 * ws, 3 * ws])     # three "layers"
      h, _ = jax.lax.scan(jax.checkpoint(layer), h0, stacked)
      return lib.psum(jnp.sum(h), "x") / 8.0
    return body
  grads_both(make, x)


def test_many_collectives_in_one_program():
  x = random_array((8 * 8, 8), np.float32)
  outs = []
  for lib in (smddp, jax.lax):
    def body(v, lib=lib):
      a = lib.all_gather(v, "x", tiled=True)        # independent of b and c
      b = lib.psum(v, "x")
      c = lib.psum_scatter(v, "x", tiled=True)
      d = lib.all_gather(c, "x", tiled=True)        # depends on c
      e = lib.pmax(a, "x")
      return a.sum() + b.sum() + d.sum() + e.sum() + lib.all_to_all(v, "x", 0, 0, tiled=True).sum()
    f = jax.jit(jax.shard_map(lambda v, body=body: body(v)[None], mesh=mesh(),
                              in_specs=P("x"), out_specs=P("x")))
    outs.append(np.asarray(f(shard(x, mesh(), P("x")))))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5)


def test_two_hundred_consecutive_calls():
  x = random_array((8 * 16, 32), np.float32)
  m = mesh()
  f = jax.jit(jax.shard_map(lambda v: smddp.psum_scatter(smddp.all_gather(v, "x", tiled=True) * 0.5,
                                                         "x", tiled=True),
                            mesh=m, in_specs=P("x"), out_specs=P("x")))
  v = shard(x, m, P("x"))
  for i in range(200):
    v = f(v)           # all_gather then sum-scatter: v -> v * 8 * 0.5 = 4 v ... rescale
    v = v * 0.25
    if i % 10 == 0:
      v.block_until_ready()
  np.testing.assert_allclose(np.asarray(v), x, rtol=1e-5)


def test_eager_shard_map_without_jit():
  x = random_array((8 * 2, 3), np.float32)
  m = mesh()
  got = jax.shard_map(lambda v: smddp.all_gather(v, "x", tiled=True), mesh=m,
                      in_specs=P("x"), out_specs=P("x"))(shard(x, m, P("x")))
  want = jax.shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True), mesh=m,
                       in_specs=P("x"), out_specs=P("x"))(shard(x, m, P("x")))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_same_inner_jit_called_twice_pairs_the_right_instances():
  # jax lowers the inner jit once; XLA inlines it twice, so two collective
  # instructions carry identical attributes and may run in either order on
  # each device. The engine must still pair each with its own peers.
  m = mesh()

  @jax.jit
  def gather(w):
    return smddp.all_gather(w, "x", tiled=True)

  def body(w1, w2):
    return gather(w1) * 2.0, gather(w2) * 3.0

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  n = 4096
  a = np.arange(8 * n, dtype=np.float32)
  w1, w2 = shard(a, m, P("x")), shard(-a, m, P("x"))
  for _ in range(20):
    r1, r2 = f(w1, w2)
    np.testing.assert_array_equal(np.asarray(r1), np.tile(a, 8) * 2)
    np.testing.assert_array_equal(np.asarray(r2), np.tile(-a, 8) * 3)


@pytest.mark.timeout(120)
def test_many_independent_collectives_do_not_deadlock(tmp_path):
  # XLA's CPU runtime may run independent collectives of one device at the
  # same time; a handler that blocked its thread while waiting for peers
  # would exhaust XLA's threads. Six independent reduce-scatters of 400 KB
  # per rank once deadlocked this way.
  import subprocess
  import sys
  import textwrap
  script = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_smddp as smddp
    smddp.set_timeout(20)
    mesh = jax.make_mesh((8,), ("x",))
    k, n = 6, 100000
    def body(lib):
      return lambda *xs: tuple(jnp.tanh(lib.psum_scatter(jnp.tile(x, 8) * (i + 1), "x", tiled=True))
                               for i, x in enumerate(xs))
    xs = [jax.device_put(jnp.ones((8 * n,), jnp.float32) * (i + 1), NamedSharding(mesh, P("x")))
          for i in range(k)]
    spec = dict(mesh=mesh, in_specs=(P("x"),) * k, out_specs=(P("x"),) * k)
    f = jax.jit(jax.shard_map(body(smddp), **spec))
    g = jax.jit(jax.shard_map(body(jax.lax), **spec))
    want = g(*xs)
    for _ in range(30):
      for a, b in zip(f(*xs), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    print("OK")
  """)
  path = tmp_path / "independent.py"
  path.write_text(script)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                        timeout=110)
  assert proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr[-3000:]
