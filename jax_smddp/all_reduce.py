"""psum / pmax / pmin / all_reduce: every rank receives the reduction over ranks.

The engine's algorithm is balanced: each rank reduces an equal shard of the
buffer and writes it to every rank (the SMDDP balanced-fusion idea), so no
rank reads more than 1/size of the data from each peer.
"""

from __future__ import annotations

import numpy as np

import jax
from jax import core, tree_util
from jax.interpreters import ad, batching

from jax_smddp._jax_internals import lax_parallel

from jax_smddp import _collective as c


def all_reduce(x, axis_name, *, op: str = "sum", axis_index_groups=None):
  """Reduces `x` over `axis_name` with `op` ("sum", "max" or "min"); NCCL-style name.
  `axis_index_groups` (as jax.lax takes them) splits the ranks into groups that each
  reduce among themselves."""
  if op not in c.REDUCE_OPS:
    raise ValueError(f"jax_smddp.all_reduce: op must be one of {sorted(c.REDUCE_OPS)}, got {op!r}")
  api = {"sum": "psum", "max": "pmax", "min": "pmin"}[op]
  axes = c.axes_tuple(axis_name)
  skip = getattr(lax_parallel, "_maybe_skip_one_sized_axes", None)
  if skip is not None:
    axes = skip(axes)
  if not axes:
    return x
  c.check_bound(api, axes)
  groups = c.index_groups(axis_index_groups)
  lax_op = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op]

  def bind(leaf):
    if op == "sum" and _is_unreduced(leaf, axes):
      return jax.lax.psum(leaf, axes, axis_index_groups=groups)  # jax's unreduced-type protocol
    if not isinstance(leaf, core.Tracer):  # a constant: same answer on every rank
      return lax_op(leaf, axes, axis_index_groups=groups)
    if np.dtype(leaf.dtype) == np.bool_:
      if op != "sum":
        raise TypeError(f"jax_smddp.{api} does not reduce booleans: cast to an integer "
                        "type first, e.g. x.astype(jnp.int32).")
      leaf = leaf.astype(np.int32)  # as jax.lax.psum does
    invariant = c.vma_checked()
    if invariant and op == "sum":
      if groups is not None:
        raise NotImplementedError(
            f"jax_smddp.{api}: axis_index_groups inside a shard_map whose types are checked "
            "(jax.lax.psum does not take them there either): pass check_vma=False to "
            "jax.shard_map")
      leaf = c.pvary_for(axes, leaf)
    return all_reduce_p.bind(leaf, axes=axes, reduce=op, invariant=invariant,
                             axis_index_groups=groups)

  return tree_util.tree_map(bind, x)


def psum(x, axis_name, *, axis_index_groups=None):
  """All-reduce sum over `axis_name`, like :func:`jax.lax.psum`."""
  return all_reduce(x, axis_name, op="sum", axis_index_groups=axis_index_groups)


def pmax(x, axis_name, *, axis_index_groups=None):
  """All-reduce max over `axis_name`, like :func:`jax.lax.pmax`."""
  return all_reduce(x, axis_name, op="max", axis_index_groups=axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
  """All-reduce min over `axis_name`, like :func:`jax.lax.pmin`."""
  return all_reduce(x, axis_name, op="min", axis_index_groups=axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
  """All-reduce mean over `axis_name`, like :func:`jax.lax.pmean`: the sum on
  jax_smddp, divided by the group's size as jax.lax divides it."""
  x = psum(x, axis_name, axis_index_groups=axis_index_groups)
  n = jax.lax.psum(1, axis_name, axis_index_groups=c.index_groups(axis_index_groups))  # a constant
  return tree_util.tree_map(lambda v: v / n, x)


def _is_unreduced(leaf, axes) -> bool:
  get_from = getattr(lax_parallel, "_get_from", None)
  if get_from is None or not isinstance(leaf, core.Tracer):
    return False
  return get_from(jax.typeof(leaf), axes, "jax.lax.psum") == "unreduced"


def _to_lax(*, axes, reduce, invariant, axis_index_groups=None):
  if reduce == "sum" and invariant:
    return lax_parallel.psum_invariant_p, {"axes": axes}
  prim = {"sum": lax_parallel.psum_p, "max": lax_parallel.pmax_p, "min": lax_parallel.pmin_p}[reduce]
  return prim, {"axes": axes, "axis_index_groups": axis_index_groups}


def _lower(ctx, x, *, platform, axes, reduce, invariant, axis_index_groups=None):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axes, axis_index_groups)
  if why:
    return why
  return c.emit_ffi_call(ctx, platform, "smddp_all_reduce", x, axes, x_aval, out_aval,
                         axis_index_groups=axis_index_groups, reduce=c.REDUCE_OPS[reduce])


def _transpose(ct, x, *, axes, reduce, invariant, axis_index_groups=None):
  assert reduce == "sum", "only psum is linear"
  if invariant:
    # varying -> invariant: the transpose marks the cotangent varying again.
    lax_prim, lax_params = _to_lax(axes=axes, reduce=reduce, invariant=invariant)
    return ad.primitive_transposes[lax_prim](ct, x, **lax_params)
  return (all_reduce_p.bind(ct, axes=axes, reduce=reduce, invariant=False,
                            axis_index_groups=axis_index_groups),)


def _batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axes"]:
    return c.lax_batcher(_to_lax, axis_data, vals_in, dims_in, params)
  return all_reduce_p.bind(x, **params), d  # element-wise: batch dim unchanged


def _jvp(primals, tangents, *, axes, reduce, invariant, axis_index_groups=None):
  (x,), (t,) = primals, tangents
  params = dict(axes=axes, reduce=reduce, invariant=invariant, axis_index_groups=axis_index_groups)
  out = all_reduce_p.bind(x, **params)
  if reduce != "sum":
    raise NotImplementedError(
        f"jax_smddp: differentiating p{reduce} is not supported (jax.lax.p{reduce} is not "
        "differentiable either).")
  t = ad.instantiate_zeros(t)
  return out, all_reduce_p.bind(t, **params)


all_reduce_p = c.make_primitive("all_reduce", "all_reduce", _to_lax, _lower)
ad.primitive_jvps[all_reduce_p] = _jvp
ad.primitive_transposes[all_reduce_p] = _transpose
batching.fancy_primitive_batchers[all_reduce_p] = _batcher
