"""psum_scatter / reduce_scatter: sum over ranks, each rank keeps one block
(the FSDP gradient reduction; the transpose of all_gather)."""

from __future__ import annotations

import numpy as np

from jax._src import tree_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.lax import parallel as lax_parallel

from jax_smddp import _collective as c


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False):
  """Sums `x` over `axis_name` and scatters the result, like :func:`jax.lax.psum_scatter`.

  Untiled, ``x.shape[scatter_dimension]`` must equal the group size and that
  dimension is removed; tiled, it must be divisible by the group size and
  each rank keeps its ``1/size`` slice. `axis_index_groups` (as jax.lax takes
  them) splits the ranks into groups that each reduce among themselves.
  """
  axes = c.axes_tuple(axis_name)
  c.check_bound("psum_scatter", axes)
  axis_index_groups = c.index_groups(axis_index_groups)
  size = c.group_size(axes, axis_index_groups)

  def bind(leaf):
    shape = np.shape(leaf)
    if not -len(shape) <= scatter_dimension < max(len(shape), 1):
      raise ValueError(f"jax_smddp.psum_scatter: scatter_dimension={scatter_dimension} is out "
                       f"of range for an input of shape {shape}.")
    dim = scatter_dimension % len(shape)
    if tiled and shape[dim] % size:
      raise ValueError(
          f"jax_smddp.psum_scatter: tiled scatter dimension {dim} has size {shape[dim]}, "
          f"which is not divisible by the {size} ranks of axis {axis_name!r}; pad that "
          f"dimension to a multiple of {size}.")
    if not tiled and shape[dim] != size:
      raise ValueError(
          f"jax_smddp.psum_scatter: untiled scatter dimension {dim} has size {shape[dim]} "
          f"but axis {axis_name!r} has {size} ranks; they must be equal (or pass tiled=True).")
    if np.dtype(leaf.dtype) == np.bool_:
      raise TypeError("jax_smddp.psum_scatter cannot sum booleans: cast to an integer "
                      "type first, e.g. x.astype(jnp.int32).")
    leaf = c.pvary_for(axes, leaf)
    return reduce_scatter_p.bind(leaf, scatter_dimension=dim, axis_name=axes,
                                 axis_index_groups=axis_index_groups, axis_size=size,
                                 tiled=tiled)

  return tree_util.tree_map(bind, x)


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                   tiled: bool = False):
  """NCCL-style name for :func:`psum_scatter` (same signature and result)."""
  return psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                      axis_index_groups=axis_index_groups, tiled=tiled)


def _to_lax(**params):
  return lax_parallel.reduce_scatter_p, params


def _lower(ctx, x, *, platform, scatter_dimension, axis_name, axis_index_groups, axis_size, tiled):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axis_name, axis_index_groups)
  if why:
    return why
  # Input viewed as [outer, ranks, inner]; this rank reduces block [:, rank, :].
  d = scatter_dimension
  return c.emit_ffi_call(ctx, platform, "smddp_reduce_scatter", x, axis_name, x_aval, out_aval,
                         axis_index_groups=axis_index_groups, reduce=c.REDUCE_OPS["sum"],
                         outer=c.prod(x_aval.shape[:d]),
                         inner=c.prod(x_aval.shape[d:]) // axis_size)


def _transpose(cts, x, *, scatter_dimension, axis_name, axis_index_groups, axis_size, tiled):
  from jax_smddp.all_gather import all_gather
  return (all_gather(cts, axis_name, axis_index_groups=axis_index_groups,
                     axis=scatter_dimension, tiled=tiled),)


def _batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_to_lax, axis_data, vals_in, dims_in, params)
  if d is None:
    return reduce_scatter_p.bind(x, **params), None
  return c.bind_batched_scatter(reduce_scatter_p, x, d, params)


reduce_scatter_p = c.make_primitive("reduce_scatter", "reduce_scatter", _to_lax, _lower)
ad.deflinear2(reduce_scatter_p, _transpose)
batching.fancy_primitive_batchers[reduce_scatter_p] = _batcher
