"""Gathers typed for JAX's explicit sharding, on jax_smddp.

``all_gather_reduced`` (varying -> *reduced*) and ``unreduced_psum_scatter``
(*unreduced* -> varying) are the twins of ``jax.lax.all_gather(..., to="reduced")``
and of lax's ``unreduced_psum_scatter``; each is the other's transpose. A
parameter gathered with ``all_gather_reduced`` inside ``jax.shard_map`` is typed
*reduced* over the gathered axes, so its cotangent is typed *unreduced*: JAX
keeps the per-device partial sums of the gradient (no all-reduce is inserted
after the weight-gradient matmul) and the transpose reduce-scatters them once,
on jax_smddp. This is how :func:`jax_smddp.unshard` works on meshes with
explicit axes.

``all_gather_invariant`` (varying -> invariant, the twin of
``jax.lax.all_gather_invariant``) gathers into a plain replicated value; its
transpose is a local slice of the (already reduced) cotangent.

Typing is jax.lax's (as for every jax_smddp collective); the CPU lowering is
that of ``all_gather`` / ``psum_scatter``.
"""

from __future__ import annotations

import numpy as np

from jax import tree_util
from jax import lax
from jax.interpreters import ad, batching

from jax_smddp._jax_internals import lax_parallel

from jax_smddp import _collective as c
from jax_smddp._gather_scatter import lower_gather as _gather_lower
from jax_smddp._gather_scatter import lower_scatter as _scatter_lower


def all_gather_reduced(x, axis_name, *, axis: int = 0, tiled: bool = False):
  """Gathers `x` (varying over `axis_name`) into a value typed *reduced* over it.

  Like ``jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="reduced")``;
  its transpose is :func:`unreduced_psum_scatter`. Inside ``jax.shard_map`` on a
  mesh whose axes are ``Explicit``.
  """
  return c.bind_gather("all_gather_reduced", all_gather_reduced_p, x, axis_name, axis, tiled)


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = False):
  """Gathers `x` (varying over `axis_name`) into a value invariant over it, like
  ``jax.lax.all_gather_invariant``; its transpose slices this rank's block."""
  return c.bind_gather("all_gather_invariant", all_gather_invariant_p, x, axis_name, axis, tiled)


def unreduced_psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False):
  """Sums the per-device partial values of `x` (typed *unreduced* over `axis_name`)
  and scatters the sum, like lax's ``unreduced_psum_scatter``; the result is
  varying over `axis_name`. Transpose of :func:`all_gather_reduced`."""
  axes = c.axes_tuple(axis_name)
  c.check_bound("unreduced_psum_scatter", axes)
  size = c.group_size(axes)

  def bind(leaf):
    ndim = np.ndim(leaf)
    if not -ndim <= scatter_dimension < max(ndim, 1):
      raise ValueError(f"jax_smddp.unreduced_psum_scatter: scatter_dimension="
                       f"{scatter_dimension} is out of range for an input of rank {ndim}.")
    return unreduced_reduce_scatter_p.bind(leaf, axis_name=axes,
                                           scatter_dimension=scatter_dimension % ndim,
                                           axis_size=size, tiled=tiled)

  return tree_util.tree_map(bind, x)


def _gather_to_lax(**params):
  return lax_parallel.all_gather_reduced_p, params


def _invariant_to_lax(**params):
  return lax_parallel.all_gather_invariant_p, params


def _scatter_to_lax(**params):
  return lax_parallel.unreduced_reduce_scatter_p, params


def _gather_lower_typed(ctx, x, *, platform, all_gather_dimension, axis_name, axis_size, tiled):
  return _gather_lower(ctx, x, platform=platform, all_gather_dimension=all_gather_dimension,
                       axis_name=axis_name, axis_index_groups=None, axis_size=axis_size,
                       tiled=tiled)


def _scatter_lower_typed(ctx, x, *, platform, axis_name, scatter_dimension, axis_size, tiled):
  if np.dtype(ctx.avals_in[0].dtype) == np.bool_:
    return "reduction of booleans"
  return _scatter_lower(ctx, x, platform=platform, scatter_dimension=scatter_dimension,
                        axis_name=axis_name, axis_index_groups=None, axis_size=axis_size,
                        tiled=tiled)


def _gather_transpose(cts, x, *, all_gather_dimension, axis_name, axis_size, tiled):
  return (unreduced_psum_scatter(cts, axis_name, scatter_dimension=all_gather_dimension,
                                 tiled=tiled),)


def _invariant_transpose(cts, x, *, all_gather_dimension, axis_name, axis_size, tiled):
  d = all_gather_dimension
  block = cts.shape[d] // axis_size
  out = lax.dynamic_slice_in_dim(cts, lax.axis_index(axis_name) * block, block, d)
  return (out if tiled else lax.squeeze(out, [d]),)


def _scatter_transpose(cts, x, *, axis_name, scatter_dimension, axis_size, tiled):
  return (all_gather_reduced(cts, axis_name, axis=scatter_dimension, tiled=tiled),)


def _gather_batcher(prim, to_lax):
  def batcher(axis_data, vals_in, dims_in, **params):
    (x,), (d,) = vals_in, dims_in
    if axis_data.name in params["axis_name"] or d is None:
      return c.lax_batcher(to_lax, axis_data, vals_in, dims_in, params)
    return c.bind_batched_gather(prim, x, d, params)
  return batcher


def _scatter_batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"] or d is None:
    return c.lax_batcher(_scatter_to_lax, axis_data, vals_in, dims_in, params)
  return c.bind_batched_scatter(unreduced_reduce_scatter_p, x, d, params)


all_gather_reduced_p = c.make_primitive("all_gather_reduced", "all_gather", _gather_to_lax,
                                        _gather_lower_typed)
ad.deflinear2(all_gather_reduced_p, _gather_transpose)
batching.fancy_primitive_batchers[all_gather_reduced_p] = _gather_batcher(
    all_gather_reduced_p, _gather_to_lax)

all_gather_invariant_p = c.make_primitive("all_gather_invariant", "all_gather", _invariant_to_lax,
                                          _gather_lower_typed)
ad.deflinear2(all_gather_invariant_p, _invariant_transpose)
batching.fancy_primitive_batchers[all_gather_invariant_p] = _gather_batcher(
    all_gather_invariant_p, _invariant_to_lax)

unreduced_reduce_scatter_p = c.make_primitive("unreduced_reduce_scatter", "reduce_scatter",
                                              _scatter_to_lax, _scatter_lower_typed)
ad.deflinear2(unreduced_reduce_scatter_p, _scatter_transpose)
batching.fancy_primitive_batchers[unreduced_reduce_scatter_p] = _scatter_batcher
