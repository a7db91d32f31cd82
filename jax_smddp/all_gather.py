"""all_gather: every rank receives every rank's block (the FSDP parameter gather)."""

from __future__ import annotations

import numpy as np

from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.lax import parallel as lax_parallel

from jax_smddp import _collective as c


TO = ("varying", "reduced", "invarying")  # jax.lax.all_gather's `to=`, its spelling


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying"):
  """Gathers `x` from every rank of `axis_name`, like :func:`jax.lax.all_gather`.

  Args:
    x: array (or pytree of arrays) on this rank.
    axis_name: a mesh axis name of the enclosing ``jax.shard_map``, or a tuple
      of them (ranks ordered as ``jax.lax`` orders them).
    axis_index_groups: None, or groups of indices along `axis_name` (lists of one
      size covering every index once): each group gathers among its own ranks,
      in the group's order.
    axis: where the gathered dimension goes in the result.
    tiled: if True, concatenate along `axis` instead of stacking a new one.
    to: the result's type over `axis_name`, as jax.lax means it: "varying"
      (default), "reduced" (:func:`jax_smddp.all_gather_reduced`) or "invarying"
      (:func:`jax_smddp.all_gather_invariant`); the last two take no groups.
  """
  if to not in TO:
    raise ValueError(f"jax_smddp.all_gather: to={to!r}; use one of {', '.join(TO)} "
                     "(jax.lax.all_gather's values)")
  if to != "varying":
    if axis_index_groups is not None:
      raise NotImplementedError(f"jax_smddp.all_gather: to={to!r} with axis_index_groups "
                                "(jax.lax does not take them together either)")
    from jax_smddp import reduced
    gather = reduced.all_gather_reduced if to == "reduced" else reduced.all_gather_invariant
    return gather(x, axis_name, axis=axis, tiled=tiled)
  return c.bind_gather("all_gather", all_gather_p, x, axis_name, axis, tiled,
                       axis_index_groups=c.index_groups(axis_index_groups))


def _to_lax(**params):
  return lax_parallel.all_gather_p, params


def _lower(ctx, x, *, platform, all_gather_dimension, axis_name, axis_index_groups, axis_size, tiled):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axis_name, axis_index_groups)
  if why:
    return why
  # Output viewed as [outer, ranks, inner]: rank p's input is block [:, p, :],
  # whether tiled (concatenated) or not (stacked).
  d = all_gather_dimension
  return c.emit_ffi_call(ctx, platform, "smddp_all_gather", x, axis_name, x_aval, out_aval,
                         axis_index_groups=axis_index_groups,
                         outer=c.prod(x_aval.shape[:d]),
                         inner_bytes=c.prod(x_aval.shape[d:]) * np.dtype(x_aval.dtype).itemsize)


def _transpose(cts, x, *, all_gather_dimension, axis_name, axis_index_groups, axis_size, tiled):
  from jax_smddp.reduce_scatter import psum_scatter
  return (psum_scatter(cts, axis_name, scatter_dimension=all_gather_dimension,
                       axis_index_groups=axis_index_groups, tiled=tiled),)


def _batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_to_lax, axis_data, vals_in, dims_in, params)
  if d is None:
    return all_gather_p.bind(x, **params), None
  return c.bind_batched_gather(all_gather_p, x, d, params)


all_gather_p = c.make_primitive("all_gather", "all_gather", _to_lax, _lower)
ad.deflinear2(all_gather_p, _transpose)
batching.fancy_primitive_batchers[all_gather_p] = _batcher
