"""all_to_all: rank r sends its p-th block to rank p (expert and sequence parallelism)."""

from __future__ import annotations

import numpy as np

from jax import core, lax, tree_util
from jax.interpreters import ad, batching

from jax_smddp._jax_internals import hlo, lax_parallel, mlir

from jax_smddp import _collective as c


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, axis_index_groups=None,
               tiled: bool = False):
  """Splits `x` along `split_axis` into one block per rank, sends block p to rank p
  and concatenates the received blocks along `concat_axis`, like :func:`jax.lax.all_to_all`.

  Untiled, ``x.shape[split_axis]`` must equal the group size: that axis is
  removed and a new one of that size is inserted at `concat_axis`.
  """
  axes = c.axes_tuple(axis_name)
  c.check_bound("all_to_all", axes)
  axis_index_groups = c.index_groups(axis_index_groups)
  size = c.group_size(axes, axis_index_groups)

  def bind(leaf, split_axis=split_axis, concat_axis=concat_axis):
    ndim = np.ndim(leaf)
    for name, a in (("split_axis", split_axis), ("concat_axis", concat_axis)):
      if not -ndim <= a < ndim:
        raise ValueError(f"jax_smddp.all_to_all: {name}={a} is out of range for an input of "
                         f"rank {ndim}.")
    split_axis, concat_axis = split_axis % ndim, concat_axis % ndim
    n = np.shape(leaf)[split_axis]
    if tiled and n % size:
      raise ValueError(f"jax_smddp.all_to_all: split_axis {split_axis} has size {n}, not "
                       f"divisible by the {size} ranks of axis {axis_name!r}.")
    if not tiled:
      if n != size:
        raise ValueError(f"jax_smddp.all_to_all: untiled split_axis {split_axis} has size {n} "
                         f"but axis {axis_name!r} has {size} ranks; they must be equal.")
      # As jax.lax does: insert the new axis, exchange, drop the split axis.
      if split_axis < concat_axis:
        concat_axis += 1
        leaf = lax.expand_dims(leaf, (concat_axis,))
      elif split_axis > concat_axis:
        leaf = lax.expand_dims(leaf, (concat_axis,))
        split_axis += 1
    leaf = c.pvary_for(axes, leaf)
    out = all_to_all_p.bind(leaf, split_axis=split_axis, concat_axis=concat_axis,
                            axis_name=axes, axis_index_groups=axis_index_groups, tiled=tiled)
    if not tiled and split_axis != concat_axis:
      out = lax.squeeze(out, (split_axis,))
    return out

  return tree_util.tree_map(bind, x)


def _to_lax(**params):
  return lax_parallel.all_to_all_p, params


def _lower(ctx, x, *, platform, split_axis, concat_axis, axis_name, axis_index_groups, tiled):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axis_name, axis_index_groups)
  if why:
    return why
  n = c.group_size_of(ctx, axis_name, axis_index_groups)
  itemsize = np.dtype(x_aval.dtype).itemsize
  shape, s, k = tuple(x_aval.shape), split_axis, x_aval.ndim
  if s == concat_axis:  # [outer, ranks, inner] in and out: no transposes
    return c.emit_ffi_call(ctx, platform, "smddp_all_to_all", x, axis_name, x_aval, out_aval,
                           axis_index_groups=axis_index_groups, outer=c.prod(shape[:s]),
                           inner_bytes=c.prod(shape[s:]) // n * itemsize)
  # Bring the split blocks to the front, exchange them, and move the received
  # blocks to the concat axis: rest is the shape of one block.
  rest = shape[:s] + (shape[s] // n,) + shape[s + 1:]
  aval = lambda shp: core.ShapedArray(shp, x_aval.dtype)
  blocks = mlir.reshape(ctx, x, aval(shape[:s] + (n,) + rest[s:]))
  front = (n,) + rest
  blocks = hlo.transpose(blocks, mlir.dense_int_array([s] + [i for i in range(k + 1) if i != s]))
  y, = c.emit_ffi_call(ctx, platform, "smddp_all_to_all", blocks, axis_name, aval(front),
                       aval(front), axis_index_groups=axis_index_groups, outer=1,
                       inner_bytes=c.prod(rest) * itemsize)
  cc = concat_axis
  y = hlo.transpose(y, mlir.dense_int_array(list(range(1, cc + 1)) + [0] + list(range(cc + 1, k + 1))))
  return [mlir.reshape(ctx, y, out_aval)]


def _transpose(cts, x, *, split_axis, concat_axis, axis_name, axis_index_groups, tiled):
  # At the primitive level (untiled reshapes live outside it) the transpose
  # just swaps the roles of the two axes.
  return (all_to_all_p.bind(cts, split_axis=concat_axis, concat_axis=split_axis,
                            axis_name=axis_name, axis_index_groups=axis_index_groups,
                            tiled=tiled),)


def _batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_to_lax, axis_data, vals_in, dims_in, params)
  if d is None:
    return all_to_all_p.bind(x, **params), None
  s, cc = params["split_axis"], params["concat_axis"]
  return all_to_all_p.bind(x, **{**params, "split_axis": s + (d <= s),
                                 "concat_axis": cc + (d <= cc)}), d


all_to_all_p = c.make_primitive("all_to_all", "all_to_all", _to_lax, _lower)
ad.deflinear2(all_to_all_p, _transpose)
batching.fancy_primitive_batchers[all_to_all_p] = _batcher
