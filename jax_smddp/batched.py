"""Batched collectives: many arrays in one collective call.

FSDP gathers and reduces a layer's parameters together: one collective per
tensor pays one latency per tensor (and a rendezvous per tensor in the
engine). These functions pack every leaf of a pytree into one flat buffer per
element type, laid out so that each rank's part is contiguous, run ONE
jax_smddp collective per element type, and unpack. The answers are exactly
those of the per-tensor ``jax.lax`` calls; gradients follow from the
primitives (``all_gather`` and ``psum_scatter`` transpose to each other).

Use inside ``jax.shard_map``, as the per-tensor collectives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import jax.numpy as jnp
from jax import tree_util

from jax_smddp import _collective as c
from jax_smddp.all_gather import all_gather
from jax_smddp.all_reduce import psum
from jax_smddp.reduce_scatter import psum_scatter


def _by_dtype(leaves: list) -> dict[np.dtype, list[int]]:
  groups: dict[np.dtype, list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(np.dtype(leaf.dtype), []).append(i)
  return groups


def _concat(parts: list, axis: int):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def all_gather_batched(xs: Any, axis_name, *, axis: int = 0, tiled: bool = True) -> Any:
  """``jax.lax.all_gather`` of every leaf of `xs`, in one collective per element type.

  Equal to ``tree_map(lambda x: jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled), xs)``.
  Leaves are flattened, concatenated into one buffer (so each rank sends one
  contiguous block), gathered with a single :func:`jax_smddp.all_gather`, and
  cut back into their shapes.
  """
  axes = c.axes_tuple(axis_name)
  c.check_bound("all_gather_batched", axes)
  n = c.group_size(axes)
  leaves, treedef = tree_util.tree_flatten(xs)
  leaves = [jnp.asarray(x) for x in leaves]
  for x in leaves:
    limit = x.ndim if tiled else x.ndim + 1
    if not -limit <= axis < limit:
      raise ValueError(f"jax_smddp.all_gather_batched: axis={axis} is out of range for a leaf "
                       f"of shape {x.shape} (tiled={tiled}); use an axis in [{-limit}, {limit}).")
  out: list = [None] * len(leaves)
  for dtype, idx in _by_dtype(leaves).items():
    total = sum(leaves[i].size for i in idx)
    if total:
      buf = all_gather(_concat([leaves[i].reshape(-1) for i in idx], 0), axes, axis=0)
    off = 0
    for i in idx:
      x = leaves[i]
      if total:
        piece = buf[:, off:off + x.size].reshape((n,) + x.shape)  # [rank, *shape]
      else:
        piece = jnp.zeros((n,) + x.shape, dtype)
      off += x.size
      out[i] = _place_gathered(piece, axis, tiled)
  return tree_util.tree_unflatten(treedef, out)


def _place_gathered(piece, axis: int, tiled: bool):
  """[rank, *shape] -> the layout of all_gather(axis=axis, tiled=tiled)."""
  ndim = piece.ndim - 1
  if not tiled:
    return jnp.moveaxis(piece, 0, axis % (ndim + 1))
  d = axis % ndim
  moved = jnp.moveaxis(piece, 0, d)  # [..., rank, shape[d], ...]
  shape = moved.shape[:d] + (moved.shape[d] * moved.shape[d + 1],) + moved.shape[d + 2:]
  return moved.reshape(shape)


def psum_scatter_batched(xs: Any, axis_name, *, scatter_dimension: int = 0,
                         tiled: bool = True) -> Any:
  """``jax.lax.psum_scatter`` of every leaf of `xs`, in one collective per element type.

  Equal to ``tree_map(lambda x: jax.lax.psum_scatter(x, axis_name,
  scatter_dimension=scatter_dimension, tiled=tiled), xs)``. Each leaf is cut
  into one block per rank along `scatter_dimension`; the blocks of all leaves
  bound for the same rank are made contiguous, one :func:`jax_smddp.psum_scatter`
  sums them, and each rank's result is cut back into the leaves' shards.
  """
  axes = c.axes_tuple(axis_name)
  c.check_bound("psum_scatter_batched", axes)
  n = c.group_size(axes)
  leaves, treedef = tree_util.tree_flatten(xs)
  leaves = [jnp.asarray(x) for x in leaves]
  fronts = []
  for x in leaves:
    if not -x.ndim <= scatter_dimension < max(x.ndim, 1) or x.ndim == 0:
      raise ValueError(f"jax_smddp.psum_scatter_batched: scatter_dimension={scatter_dimension} "
                       f"is out of range for a leaf of shape {x.shape}.")
    d = scatter_dimension % x.ndim
    if tiled and x.shape[d] % n:
      raise ValueError(
          f"jax_smddp.psum_scatter_batched: a leaf of shape {x.shape} has {x.shape[d]} rows "
          f"along scatter dimension {d}, not divisible by the {n} ranks of {axis_name!r}.")
    if not tiled and x.shape[d] != n:
      raise ValueError(
          f"jax_smddp.psum_scatter_batched: untiled scatter dimension {d} of a leaf of shape "
          f"{x.shape} must have the group size {n} (or pass tiled=True).")
    fronts.append(jnp.moveaxis(x, d, 0))  # [rows, ...]: rank r owns rows [r*k, (r+1)*k)
  out: list = [None] * len(leaves)
  for dtype, idx in _by_dtype(leaves).items():
    if np.dtype(dtype) == np.bool_:
      raise TypeError("jax_smddp.psum_scatter_batched cannot sum booleans: cast to an integer "
                      "type first, e.g. x.astype(jnp.int32).")
    per_rank = [fronts[i].size // n for i in idx]
    if sum(per_rank):
      buf = _concat([fronts[i].reshape(n, -1) for i in idx], 1)  # [rank, sum of parts]
      mine = psum_scatter(buf, axes, scatter_dimension=0, tiled=False)  # this rank's row
    off = 0
    for i, k in zip(idx, per_rank):
      f = fronts[i]
      part = mine[off:off + k] if sum(per_rank) else jnp.zeros((0,), dtype)
      off += k
      if tiled:
        out[i] = jnp.moveaxis(part.reshape((f.shape[0] // n,) + f.shape[1:]), 0,
                              scatter_dimension % leaves[i].ndim)
      else:
        out[i] = part.reshape(f.shape[1:])
  return tree_util.tree_unflatten(treedef, out)


def psum_batched(xs: Any, axis_name) -> Any:
  """``jax.lax.psum`` of every leaf of `xs`, in one all-reduce per element type."""
  axes = c.axes_tuple(axis_name)
  c.check_bound("psum_batched", axes)
  leaves, treedef = tree_util.tree_flatten(xs)
  leaves = [jnp.asarray(x) for x in leaves]
  out: list = [None] * len(leaves)
  for dtype, idx in _by_dtype(leaves).items():
    if not sum(leaves[i].size for i in idx):
      for i in idx:
        out[i] = psum(leaves[i], axes)
      continue
    buf = psum(_concat([leaves[i].reshape(-1) for i in idx], 0), axes)
    off = 0
    for i in idx:
      x = leaves[i]
      out[i] = buf[off:off + x.size].reshape(x.shape)
      off += x.size
  return tree_util.tree_unflatten(treedef, out)
