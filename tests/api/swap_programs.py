"""Programs written once against a collectives library `lib` (jax.lax or
jax_smddp: the same names and signatures), run by test_swap.py three ways:
jax.lax, jax_smddp, and jax.lax with the collectives swapped (in this process
with jax_smddp.use, or in a subprocess with JAX_SMDDP_COLLECTIVES).

Each program: make(lib) -> (body, in_specs, out_specs, check_vma), inputs()
-> tuple of numpy arrays, mesh() -> the mesh, and the jax_smddp custom calls
its lowering must hold when every collective is swapped.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def _rand(shape, dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  if np.issubdtype(np.dtype(dtype), np.integer):
    return rng.integers(-50, 50, size=shape).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def mesh_1d():
  return jax.make_mesh((8,), ("x",))


def mesh_2d():
  return jax.make_mesh((2, 4), ("r", "s"))


def fsdp_layer(check_vma):
  """value_and_grad of an FSDP layer: all_gather forward, psum_scatter as its
  transpose, psum of the loss."""
  def make(lib):
    def body(w, x):
      def loss(w):
        full = lib.all_gather(w, "x", axis=0, tiled=True)
        return lib.psum(jnp.sum(jnp.tanh(x @ full) ** 2), "x")
      return jax.value_and_grad(loss)(w)
    return body, (P("x"), P("x")), (P(), P("x")), check_vma
  return dict(make=make, mesh=mesh_1d,
              inputs=lambda: (_rand((64, 16), seed=1), _rand((32, 64), seed=2)),
              calls=("smddp_all_gather", "smddp_reduce_scatter", "smddp_all_reduce"))


def reductions():
  def make(lib):
    def body(x, i):
      return (lib.psum(x, "x"), lib.pmax(x, "x"), lib.pmin(i, "x"),
              lib.psum_scatter(x, "x", scatter_dimension=1, tiled=True),
              lib.psum_scatter(i, "x", scatter_dimension=0, tiled=False))
    return body, (P("x"), P("x")), (P(), P(), P(), P("x"), P("x")), True
  return dict(make=make, mesh=mesh_1d,
              inputs=lambda: (_rand((8, 16)), _rand((64, 3), np.int32, seed=3)),
              calls=("smddp_all_reduce", "smddp_reduce_scatter"))


def exchanges():
  def make(lib):
    def body(x):
      return (lib.all_to_all(x, "x", 0, 1, tiled=True),
              lib.all_to_all(x.reshape(8, -1, 4), "x", 0, 2),
              lib.all_gather(x, "x", axis=1))
    return body, (P("x"),), (P("x"), P("x"), P("x")), True
  return dict(make=make, mesh=mesh_1d,
              inputs=lambda: (_rand((64, 8), np.float64, seed=4),),
              calls=("smddp_all_to_all", "smddp_all_gather"))


def hybrid_2d():
  """2x4 mesh: gather within 's', reduce across 'r' and across both."""
  def make(lib):
    def body(w, x):
      full = lib.all_gather(w, "s", tiled=True)
      y = x @ full
      return lib.psum(y, "r"), lib.psum(jnp.sum(y), ("r", "s"))
    return body, (P("s"), P(("r", "s"))), (P(("r", "s")), P()), True
  return dict(make=make, mesh=mesh_2d,
              inputs=lambda: (_rand((16, 4), seed=5), _rand((16, 16), seed=6)),
              calls=("smddp_all_gather", "smddp_all_reduce"))


PROGRAMS = {
    "fsdp_layer": fsdp_layer(True),
    "fsdp_layer_no_vma": fsdp_layer(False),
    "reductions": reductions(),
    "exchanges": exchanges(),
    "hybrid_2d": hybrid_2d(),
}

XLA_COLLECTIVES = ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_reduce",
                   "stablehlo.all_to_all")


def compiled(name, lib):
  """(jitted function, sharded inputs) of program `name` written with `lib`."""
  prog = PROGRAMS[name]
  mesh = prog["mesh"]()
  body, in_specs, out_specs, check_vma = prog["make"](lib)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=check_vma))
  args = tuple(jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))
               for a, s in zip(prog["inputs"](), in_specs))
  return f, args


def run(name, lib):
  """(flat list of numpy results, lowered StableHLO text)."""
  f, args = compiled(name, lib)
  text = f.lower(*args).as_text()
  out = jax.tree_util.tree_leaves(f(*args))
  return [np.asarray(o) for o in out], text


def xla_collectives_in(text: str) -> list[str]:
  return [c for c in XLA_COLLECTIVES if c in text]


def plugin_calls_in(text: str) -> list[str]:
  import re
  return sorted(set(re.findall(r"custom_call @(smddp_\w+)", text)))
