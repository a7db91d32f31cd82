"""The all_gather and reduce_scatter primitives, each the other's transpose.

They are defined side by side, a floor below the modules that export them (all_gather.py,
reduce_scatter.py, reduced.py), so that no module imports one that imports it back: jax.lax
keeps this pair in one module too (parallel.py). The front ends (argument checks, pytrees)
are _collective's bind_gather and bind_scatter.
"""

from __future__ import annotations

import numpy as np

from jax.interpreters import ad, batching

from jax_smddp._jax_internals import lax_parallel

from jax_smddp import _collective as c


def _gather_to_lax(**params):
  return lax_parallel.all_gather_p, params


def lower_gather(ctx, x, *, platform, all_gather_dimension, axis_name, axis_index_groups,
                 axis_size, tiled):
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


def _gather_transpose(cts, x, *, all_gather_dimension, axis_name, axis_index_groups, axis_size,
                      tiled):
  return (c.bind_scatter("psum_scatter", reduce_scatter_p, cts, axis_name, all_gather_dimension,
                         tiled, axis_index_groups),)


def _gather_batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_gather_to_lax, axis_data, vals_in, dims_in, params)
  if d is None:
    return all_gather_p.bind(x, **params), None
  return c.bind_batched_gather(all_gather_p, x, d, params)


def _scatter_to_lax(**params):
  return lax_parallel.reduce_scatter_p, params


def lower_scatter(ctx, x, *, platform, scatter_dimension, axis_name, axis_index_groups, axis_size,
                  tiled):
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


def _scatter_transpose(cts, x, *, scatter_dimension, axis_name, axis_index_groups, axis_size,
                       tiled):
  return (c.bind_gather("all_gather", all_gather_p, cts, axis_name, scatter_dimension, tiled,
                        axis_index_groups=c.index_groups(axis_index_groups)),)


def _scatter_batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_scatter_to_lax, axis_data, vals_in, dims_in, params)
  if d is None:
    return reduce_scatter_p.bind(x, **params), None
  return c.bind_batched_scatter(reduce_scatter_p, x, d, params)


all_gather_p = c.make_primitive("all_gather", "all_gather", _gather_to_lax, lower_gather)
ad.deflinear2(all_gather_p, _gather_transpose)
batching.fancy_primitive_batchers[all_gather_p] = _gather_batcher

reduce_scatter_p = c.make_primitive("reduce_scatter", "reduce_scatter", _scatter_to_lax,
                                    lower_scatter)
ad.deflinear2(reduce_scatter_p, _scatter_transpose)
batching.fancy_primitive_batchers[reduce_scatter_p] = _scatter_batcher
