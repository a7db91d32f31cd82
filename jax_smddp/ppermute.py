"""ppermute: rank i sends its value to rank j for each pair (i, j) of a permutation
(pipeline stages, ring attention, halo exchanges).

Inside jax.shard_map under jit it runs on jax_smddp's engine as one
collective_permute call (the engine's name for it, as XLA's collective-permute):
cycles and partial permutations alike, ranks that receive nothing get zeros, as
with jax.lax.ppermute. Elsewhere (vmap or pmap axes, element types the engine
does not move, groups whose rank order jax.lax would read differently) it
lowers through jax.lax, logged once as a fallback.
"""

from __future__ import annotations

import numpy as np

from jax import tree_util
from jax.interpreters import ad, batching

from jax_smddp._jax_internals import lax_parallel

from jax_smddp import _collective as c


def ppermute(x, axis_name, perm):
  """Sends `x` from rank i to rank j for each (i, j) in `perm`, like
  :func:`jax.lax.ppermute` (ranks that receive nothing get zeros). `perm`'s
  indices are positions along `axis_name`; no two pairs share a source or a
  destination."""
  axes = c.axes_tuple(axis_name)
  c.check_bound("ppermute", axes)
  perm = tuple((int(s), int(d)) for s, d in perm)

  def bind(leaf):
    return ppermute_p.bind(c.pvary_for(axes, leaf), axis_name=axes, perm=perm)

  return tree_util.tree_map(bind, x)


def _to_lax(**params):
  return lax_parallel.ppermute_p, params


def sources_of(perm, groups: np.ndarray) -> np.ndarray | str:
  """For each rank of the groups (rows of device ids, in rank order), the rank
  whose input it receives (-1: none), read as jax.lax reads `perm` (its indices
  are positions in each group's sorted device ids); one array for every group,
  or a string saying why there is none (the groups would read it differently)."""
  n = groups.shape[1]
  srcs = [s % n for s, _ in perm]
  dsts = [d % n for _, d in perm]
  if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(f"jax_smddp.ppermute: sources and destinations must be unique, got {perm}.")
  result = None
  for row in groups:
    ordered = sorted(row.tolist())
    rank = {dev: r for r, dev in enumerate(row.tolist())}
    sources = np.full(n, -1, np.int64)
    for s, d in zip(srcs, dsts):
      sources[rank[ordered[d]]] = rank[ordered[s]]
    if result is None:
      result = sources
    elif not np.array_equal(result, sources):
      return "the groups' rank orders read the permutation differently"
  return result


def _lower(ctx, x, *, platform, axis_name, perm):
  x_aval, = ctx.avals_in
  out_aval, = ctx.avals_out
  why = c.engine_unsupported(ctx, x_aval.dtype, axis_name)
  if why:
    return why
  groups = c.replica_groups(ctx.module_context.axis_context, axis_name)
  sources = sources_of(perm, groups)
  if isinstance(sources, str):
    return sources
  nbytes = c.prod(x_aval.shape) * np.dtype(x_aval.dtype).itemsize
  return c.emit_ffi_call(ctx, platform, "smddp_collective_permute", x, axis_name, x_aval,
                         out_aval, sources=sources, inner_bytes=nbytes)


def _transpose(ct, x, *, axis_name, perm):
  # The transpose of a permutation sends each cotangent back: the inverted perm.
  return (ppermute_p.bind(ct, axis_name=axis_name, perm=tuple((d, s) for s, d in perm)),)


def _batcher(axis_data, vals_in, dims_in, **params):
  (x,), (d,) = vals_in, dims_in
  if axis_data.name in params["axis_name"]:
    return c.lax_batcher(_to_lax, axis_data, vals_in, dims_in, params)
  return ppermute_p.bind(x, **params), d


ppermute_p = c.make_primitive("ppermute", "collective_permute", _to_lax, _lower)
ad.deflinear2(ppermute_p, _transpose)
batching.fancy_primitive_batchers[ppermute_p] = _batcher
