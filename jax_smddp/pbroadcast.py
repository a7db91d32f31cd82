"""pbroadcast: every rank of the axis receives rank `source`'s value (jax.lax.pbroadcast,
XLA's collective-broadcast).

Inside jax.shard_map under jit it runs on jax_smddp's engine as one collective_permute
call whose every rank's source is `source`: the engine's permute bodies read each rank's
output from its source, so one source feeds any number of ranks. jax.lax lowers it on
GPUs only (XLA:CPU has no collective-broadcast): on CPU, where the engine does not take
a call, it lowers as jax.lax documents it, a psum of the value masked to the source's;
on GPUs through jax.lax. Either fallback is logged once.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

import jax.numpy as jnp
from jax import lax, tree_util
from jax.interpreters import ad, batching

from jax_smddp._jax_internals import lax_parallel, mlir

from jax_smddp import _collective as c
from jax_smddp import requirements
from jax_smddp.all_reduce import psum


def pbroadcast(x, axis_name, source):
  """Every rank of `axis_name` receives the value `x` has on rank `source` (its
  position along `axis_name`), like :func:`jax.lax.pbroadcast`."""
  axes = c.axes_tuple(axis_name)
  c.check_bound("pbroadcast", axes)
  source = _checked_source(source, c.group_size(axes), axis_name)

  def bind(leaf):
    return pbroadcast_p.bind(c.pvary_for(axes, leaf), axis_name=axes, source=source)

  return tree_util.tree_map(bind, x)


def _checked_source(source, size: int, axis_name) -> int:
  try:
    source = operator.index(source)
  except TypeError:
    raise TypeError(f"jax_smddp.pbroadcast: source must be a Python int (a position along "
                    f"{axis_name!r}), got {source!r}.") from None
  if not 0 <= source < size:
    raise ValueError(f"jax_smddp.pbroadcast: source={source} is not a position along "
                     f"{axis_name!r}, whose {size} ranks are 0 to {size - 1}.")
  return source


def _to_lax(**params):
  return lax_parallel.pbroadcast_p, params


def _masked_psum(x, *, axis_name, source):
  """pbroadcast as jax.lax.pbroadcast's docstring defines it (booleans summed as int32)."""
  mask = lax.axis_index(axis_name) == source
  v = x.astype(np.int32) if x.dtype == np.bool_ else x
  out = lax.psum(lax.select(mask, v, lax.full_like(v, 0)), axis_name)
  return out.astype(x.dtype)


def _lower(ctx, x, *, platform, axis_name, source):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axis_name)
  if why and platform == "cpu":  # jax.lax has no CPU rule to fall back to
    requirements.fallback("jax_smddp.pbroadcast lowers as jax.lax.psum of the source's value here",
                          why)
    body = functools.partial(_masked_psum, axis_name=axis_name, source=source)
    return mlir.lower_fun(body, multiple_results=False)(ctx, x)
  if why:
    return why
  groups = c.replica_groups(ctx.module_context.axis_context, axis_name)
  # jax.lax reads `source` as a position in each group's rank order (the groups' rows), as
  # the engine does: every group reads it alike.
  sources = np.full(groups.shape[1], _checked_source(source, groups.shape[1], axis_name))
  nbytes = c.prod(x_aval.shape) * np.dtype(x_aval.dtype).itemsize
  return c.emit_ffi_call(ctx, platform, "smddp_collective_permute", x, axis_name, x_aval,
                         out_aval, sources=sources, inner_bytes=nbytes)


def _transpose(ct, x, *, axis_name, source):
  # As jax.lax's rule: the source's cotangent is the sum of every rank's, the others' zero
  # (jax.lax's builds it with full_like, which takes scalars only).
  total = psum(ct, axis_name)
  is_source = lax.axis_index(axis_name) == source
  return (jnp.where(is_source, total, jnp.zeros_like(ct)),)


def _batcher(axis_data, vals_in, dims_in, *, axis_name, source):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name not in axis_name:
    return pbroadcast_p.bind(x, axis_name=axis_name, source=source), d
  if len(axis_name) > 1:
    raise NotImplementedError(
        f"jax_smddp.pbroadcast over the vmapped axis {axis_data.name!r} and others at once "
        f"({axis_name}), as jax.lax.pbroadcast: broadcast over one axis at a time.")
  # vmap over the axis itself: a gather of the source's slice, no communication (jax.lax's
  # rule, whose list of indices jnp.take refuses).
  if d is None:
    return x, None
  return jnp.take(x, np.full(axis_data.size, source), axis=d), d


pbroadcast_p = c.make_primitive("pbroadcast", "collective_permute", _to_lax, _lower)
ad.deflinear2(pbroadcast_p, _transpose)
batching.fancy_primitive_batchers[pbroadcast_p] = _batcher
