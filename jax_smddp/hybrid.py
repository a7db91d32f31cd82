"""Hybrid sharding (HSDP) on a 2-D mesh: replica groups x shard groups.

Parameters are sharded over the *shard* axis (FSDP within a group of devices,
typically one host or one NVLink domain) and replicated over the *replica*
axis (data parallelism between groups). Per step, inside ``jax.shard_map``:

* :func:`gather_params`: each layer's parameters are all-gathered within the
  shard group (one collective per element type for the whole pytree);
* :func:`reduce_grads`: full-size local gradients are reduce-scattered within
  the shard group, then all-reduced across replica groups, so each device ends
  with its shard of the gradient summed over every device;
* :func:`reduce_sharded_grads`: for gradients that are already sharded (for
  example those of the parameter shards, which the transpose of
  :func:`gather_params` reduce-scattered), the all-reduce across replicas alone.

Each step is a batched jax_smddp collective (see :mod:`jax_smddp.batched`).
Axis arguments take a mesh axis name or a tuple of them.

With ``check_vma=True`` (shard_map's default) JAX's autodiff already sums the
gradient of a value that is invariant over the replica axis (a parameter
replicated across replica groups) over that axis, with one jax.lax all-reduce
per tensor. Pass ``replica_axis`` to :func:`gather_params` to leave that sum to
:func:`reduce_grads` (one batched all-reduce on jax_smddp); either way, the
reduce functions only sum the leaves that are still varying over the replica
axis, so nothing is summed twice.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util

from jax_smddp import _collective as c
from jax_smddp.batched import all_gather_batched, psum_batched, psum_scatter_batched


def gather_params(params: Any, shard_axis, *, replica_axis=None, axis: int = 0) -> Any:
  """Full parameters from this device's shards: all-gather within the shard group.

  Equal to ``jax.lax.all_gather(p, shard_axis, axis=axis, tiled=True)`` for
  every leaf; one collective per element type. Its gradient is the
  reduce-scatter of the full-size gradients back to the shards, within the
  shard group.

  With `replica_axis` (and ``check_vma=True``), the gathered parameters are
  marked varying over it (``jax.lax.pcast(..., to="varying")``), so autodiff
  does not sum their gradients across replicas: :func:`reduce_grads` (or
  :func:`reduce_sharded_grads`) does, in one batched collective.
  """
  full = all_gather_batched(params, shard_axis, axis=axis, tiled=True)
  if replica_axis is not None:
    axes = c.axes_tuple(replica_axis)
    c.check_bound("hybrid.gather_params", axes)
    full = tree_util.tree_map(lambda v: c.pvary_for(axes, v), full)
  return full


def reduce_grads(grads: Any, shard_axis, replica_axis=None, *, scatter_dimension: int = 0,
                 mean: bool = False) -> Any:
  """Full-size local gradients -> this device's shard of their sum over all devices.

  A reduce-scatter within the shard group (``psum_scatter(g, shard_axis,
  scatter_dimension, tiled=True)``) followed by an all-reduce across replica
  groups (``psum(., replica_axis)``), each one collective per element type.
  Leaves that are invariant over `replica_axis` (autodiff already summed them
  there, see the module notes) are not summed again. With ``mean=True`` the
  result is divided by the number of devices (shard group size x replica group
  size).
  """
  out = psum_scatter_batched(grads, shard_axis, scatter_dimension=scatter_dimension,
                             tiled=True)
  if replica_axis is not None:
    out = _sum_over_replicas(out, replica_axis)
  if mean:
    n = c.group_size(c.axes_tuple(shard_axis))
    if replica_axis is not None:
      n *= c.group_size(c.axes_tuple(replica_axis))
    out = tree_util.tree_map(lambda g: g / n, out)
  return out


def reduce_sharded_grads(grads: Any, replica_axis) -> Any:
  """Gradients already sharded over the shard axis -> summed across replica groups
  (one all-reduce per element type); leaves invariant over `replica_axis` are
  already sums and are returned as they are."""
  return _sum_over_replicas(grads, replica_axis)


def _sum_over_replicas(tree: Any, replica_axis) -> Any:
  """psum over the replica axes each leaf still varies over, batched per set of axes."""
  axes = c.axes_tuple(replica_axis)
  c.check_bound("hybrid", axes)
  leaves, treedef = tree_util.tree_flatten(tree)
  groups: dict[tuple, list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(_still_varying(leaf, axes), []).append(i)
  out = list(leaves)
  for names, idx in groups.items():
    if names:
      for i, v in zip(idx, psum_batched([leaves[i] for i in idx], names)):
        out[i] = v
  return tree_util.tree_unflatten(treedef, out)


def _still_varying(leaf, axes: tuple) -> tuple:
  if not c.vma_checked():
    return axes  # no types to go by: every leaf is a per-device value
  varying = getattr(getattr(jax.typeof(leaf), "mat", None), "varying", None)
  if varying is None:
    return axes
  return tuple(a for a in axes if a in varying)
