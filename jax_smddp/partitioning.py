"""Sharding rules for global-view code: ``unshard`` under plain ``jax.jit``.

``unshard(x, axis_name)`` gathers the dimension(s) of a sharded array that
mesh axis `axis_name` shards, without ``shard_map``: the result is the same
array, replicated along that axis. It is an identity in value, so it can be
dropped into pjit-style code (parameters stored sharded, each layer unsharding
its parameters just before use) without changing any answer. Two paths, by
the mesh's axis types (``jax.make_mesh`` makes ``Explicit`` axes by default):

* ``Explicit`` axes: the layout is part of the array's type, so the gather is
  a ``jax.shard_map`` over the mesh around :func:`jax_smddp.all_gather_reduced`.
  The result is typed *reduced* over the axis, so JAX keeps the gradient as
  per-device partial sums (no all-reduce after the weight-gradient matmul) and
  the transpose reduce-scatters them once: both the gather and the gradient
  reduction run on jax_smddp.
* ``Auto`` axes (classic pjit): the layout is only known to XLA's partitioner,
  so the gather is a ``jax.experimental.custom_partitioning`` op with a Shardy
  ``sharding_rule`` (the default partitioner in the supported jax versions)
  whose partition callback, which sees the operand's actual sharding at
  compile time, emits :func:`jax_smddp.all_gather` for the dimension the axis
  shards. The plugin's ``smddp_all_gather`` appears in the compiled program
  (after partitioning), not in ``jit(...).lower()``'s text, which holds the
  partitioner's ``CustomSPMDPartitioning`` call. The rule gives the gathered
  dimension a factor of its own so the sharding does not propagate through the
  op. The gradient is a ``custom_vjp`` whose backward pass is a second
  partitioned op asking for the cotangent in the layout of `x` (it takes `x`
  as an operand so that layout is known). That cotangent is, before
  reduction, a partial sum on each device, and XLA's partitioner never hands
  partial sums to a custom call: it reduces them itself (XLA's collective, a
  reduce-scatter or an all-reduce and a slice) straight into that layout.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np

import jax
from jax import tree_util

from jax_smddp._jax_internals import jax_core as core
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_smddp import _collective as c
from jax_smddp.all_gather import all_gather as _smddp_all_gather
from jax_smddp.reduced import all_gather_invariant, all_gather_reduced

log = logging.getLogger("jax_smddp")


def unshard(x, axis_name, *, dim: int | None = None, reduced: bool = True):
  """Gathers the dimension of `x` sharded over mesh axis `axis_name`, under ``jax.jit``.

  Args:
    x: a global array (or pytree of arrays) inside ``jax.jit``, sharded over a
      mesh (``NamedSharding``); not inside ``jax.shard_map`` (there, use
      :func:`jax_smddp.all_gather`).
    axis_name: a mesh axis name, or a tuple of them (gathered together).
    dim: optional hint, on meshes with ``Auto`` axes: the dimension that
      `axis_name` shards. The layout is not known while tracing, so without it
      the partitioner propagates no sharding through ``unshard`` (the values
      are right either way); with it, the other dimensions keep their sharding
      (tensor parallelism) and the gathered one is kept replicated.
    reduced: on a mesh whose axes are ``Explicit`` only: type the result
      *reduced* over `axis_name` (the default; the gradient then reaches the
      transpose as per-device partial sums and is reduce-scattered once, on
      jax_smddp), or plainly replicated (``reduced=False``; the gradient is
      all-reduced by XLA and sliced). JAX forbids element-wise operations
      between a value reduced over an axis and one sharded over it (a bias
      added to batch-sharded activations): unshard such parameters with
      ``reduced=False``. Ignored on meshes with ``Auto`` axes.

  Returns:
    `x` itself (same values, shape and dtype), replicated along `axis_name`.
    Its gradient comes back in the layout of `x`.

  The gather runs on jax_smddp (``smddp_all_gather`` in the compiled program).
  An axis that is not the minor-most axis sharding its dimension (for example
  ``"fsdp"`` in ``P(("fsdp", "tp"))``) cannot be gathered in place: that
  dimension is resharded by XLA instead. A dimension not sharded over
  `axis_name` is left as it is.
  """
  axes = c.axes_tuple(axis_name)
  for name in axes:
    if not isinstance(name, str):
      raise TypeError(f"jax_smddp.unshard: axis names are strings (mesh axis names), got {name!r}")
  env = core.get_axis_env()
  bound = [name for name in axes if env.axis_exists(name)]
  if bound:
    raise ValueError(
        f"jax_smddp.unshard: axis {bound[0]!r} is a manual axis here (inside jax.shard_map), "
        f"where arrays are per-device blocks; gather them with "
        f"jax_smddp.all_gather(x, {bound[0]!r}, axis=..., tiled=True) instead.")
  return tree_util.tree_map(lambda leaf: _unshard_leaf(leaf, axes, dim, reduced), x)


def _unshard_leaf(x, axes: tuple, dim, reduced: bool):
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  types = dict(zip(mesh.axis_names, mesh.axis_types)) if mesh is not None else {}
  if mesh is not None and not mesh.empty and all(
      types.get(a) == AxisType.Explicit for a in axes):
    return _unshard_explicit(x, axes, mesh, sharding.spec, reduced)
  if dim is not None:
    if not -np.ndim(x) <= dim < max(np.ndim(x), 1):
      raise ValueError(f"jax_smddp.unshard: dim={dim} is out of range for an array of shape "
                       f"{np.shape(x)}.")
    dim = dim % np.ndim(x)
  return _unshard(x, (axes, dim))


def _unshard_explicit(x, axes: tuple, mesh, spec: P, reduced: bool):
  """Explicit axes: the layout is in the type, so gather in a shard_map with
  jax_smddp's all_gather_reduced (the result is typed *reduced* over `axes`, so
  the gradient reaches the transpose unreduced and is reduce-scattered once)
  or all_gather_invariant (reduced=False)."""
  want_in, out, gathers = _plan(axes, spec, np.ndim(x))
  if want_in != _spec(_entries(spec, np.ndim(x))):
    x = jax.sharding.reshard(x, want_in)  # axes that are not minor-most: XLA
  if not gathers:
    return x if want_in == out else jax.sharding.reshard(x, out)
  gather = all_gather_reduced if reduced else all_gather_invariant

  def body(block):
    for d, names in gathers:
      block = gather(block, names, axis=d, tiled=True)
    return block

  gathered = frozenset(a for _, names in gathers for a in names) if reduced else frozenset()
  out_spec = P(*out, reduced=gathered | spec.reduced)
  return jax.shard_map(body, mesh=mesh, in_specs=want_in, out_specs=out_spec)(x)


# --- the plan: which dimensions to gather, from the operand's sharding ---------

def _entries(spec: P, ndim: int) -> list[tuple]:
  out = []
  for i in range(ndim):
    e = spec[i] if i < len(spec) else None
    out.append(() if e is None else (tuple(e) if isinstance(e, (tuple, list)) else (e,)))
  return out


def _spec(entries: list[tuple]) -> P:
  return P(*[None if not e else (e[0] if len(e) == 1 else e) for e in entries])


def _plan(axes: tuple, spec: P, ndim: int):
  """(operand spec to ask for, result spec, [(dim, axes gathered there)])."""
  entries = _entries(spec, ndim)
  want_in, out, gathers = list(entries), list(entries), []
  for d, e in enumerate(entries):
    mine = tuple(a for a in e if a in axes)
    if not mine:
      continue
    rest = tuple(a for a in e if a not in axes)
    if e[len(rest):] == mine:  # the gathered axes are minor-most: blocks are contiguous
      gathers.append((d, mine))
    else:
      log.debug("jax_smddp.unshard: axes %s are not minor-most in %s of dimension %d; "
                "XLA reshards that dimension", mine, e, d)
      want_in[d] = rest
    out[d] = rest
  return _spec(want_in), _spec(out), gathers


def _check_mesh(axes: tuple, mesh) -> None:
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"jax_smddp.unshard: axis {missing[0]!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)} that the array is sharded over.")


def _rules(key, mesh, operand_types, result_types):
  """Shardy rules. Forward: the result's dims are factors of their own, so the
  gathered sharding does not propagate through the op (with `dim` known, the
  other dims share the operand's factors and the gathered one must be
  replicated). Backward (two operands, x and the cotangent): the result shares
  the factors of x, so the gradient is propagated in the layout of x."""
  _, dim = key
  ndim = len(operand_types[0].shape)
  xf = [f"x{i}" for i in range(ndim)]
  free = [f"r{i}" if dim is None or i == dim else xf[i] for i in range(ndim)]
  extra = {} if dim is None else {"need_replication_factors": (f"r{dim}",)}
  if len(operand_types) == 1:
    return f"{' '.join(xf)} -> {' '.join(free)}", extra
  return f"{' '.join(xf)}, {' '.join(free)} -> {' '.join(xf)}"


# --- forward: gather -----------------------------------------------------------

@partial(custom_partitioning, static_argnums=(1,))
def _gather(x, key):
  return x


def _gather_partition(key, mesh, arg_shapes, result_shape):
  axes, _ = key
  _check_mesh(axes, mesh)
  ndim = len(arg_shapes[0].shape)
  want_in, out, gathers = _plan(axes, arg_shapes[0].sharding.spec, ndim)

  def lower(x):
    for d, names in gathers:
      x = _smddp_all_gather(x, names, axis=d, tiled=True)
    return x

  return mesh, lower, NamedSharding(mesh, out), (NamedSharding(mesh, want_in),)


_gather.def_partition(
    partition=_gather_partition,
    infer_sharding_from_operands=lambda key, mesh, arg_shapes, result_shape: NamedSharding(
        mesh, _plan(key[0], arg_shapes[0].sharding.spec, len(arg_shapes[0].shape))[1]),
    sharding_rule=_rules)


# --- backward: the cotangent back in the layout of x ---------------------------

@partial(custom_partitioning, static_argnums=(2,))
def _like(x, ct, key):
  del x
  return ct


def _like_partition(key, mesh, arg_shapes, result_shape):
  sharding = NamedSharding(mesh, arg_shapes[0].sharding.spec)
  return mesh, lambda x, ct: ct, sharding, (sharding, sharding)


_like.def_partition(
    partition=_like_partition,
    infer_sharding_from_operands=lambda key, mesh, arg_shapes, result_shape: NamedSharding(
        mesh, arg_shapes[0].sharding.spec),
    sharding_rule=_rules)


# --- the differentiable op -----------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unshard(x, key):
  if x.ndim == 0:
    return x
  return _gather(x, key)


def _unshard_fwd(x, key):
  return _unshard(x, key), x


def _unshard_bwd(key, x, ct):
  if x.ndim == 0:
    return (ct,)
  return (_like(x, ct, key),)


_unshard.defvjp(_unshard_fwd, _unshard_bwd)
