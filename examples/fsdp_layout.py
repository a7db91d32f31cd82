"""How the FSDP example stores parameters sharded, and how it gathers them for use.

Storage. Every parameter leaf is flattened, zero-padded to a multiple of the shard
count n and stored as one 1-D array of n * k elements, sharded over the mesh's
`fsdp` axis: rank r holds elements [r*k, (r+1)*k). Layer parameters are stacked
over layers first, so their leaves are [n_layers, n * k], sharded along dim 1, and a
`lax.scan` over the layers hands each step one layer's [k] shards. The pytree keeps
the model's structure (embed/layers/head, then Flax's names), so optax, weight
decay masks and checkpoints see ordinary leaves; padding stays zero in training
(zero gradient, zero Adam update, zero decay).

Gather. Inside `jax.shard_map`, one group of leaves (the embedding, one layer, or
the head) is unsharded with ONE tiled all_gather: the rank's shards of all the
group's leaves are packed into one buffer, gathered, and cut back into leaves
(the FlatParameter of PyTorch FSDP). Its transpose is one reduce-scatter, so the
backward pass returns each layer's gradients already sharded like the parameters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

GROUPS = ("embed", "layers", "head")


class FlatLayout:
  """Flat, padded, sharded storage of a parameter tree, for a shard axis of size `n`."""

  def __init__(self, params_shapes: dict, n: int, shard_axis: str = "fsdp"):
    """`params_shapes`: the unsharded tree (arrays or ShapeDtypeStructs); "layers" leaves
    carry the layer dimension first."""
    self.n = n
    self.shard_axis = shard_axis
    self.treedefs, self.shapes = {}, {}
    for group in GROUPS:
      leaves, self.treedefs[group] = jax.tree.flatten(params_shapes[group])
      drop = 1 if group == "layers" else 0
      self.shapes[group] = [tuple(leaf.shape[drop:]) for leaf in leaves]
    self.n_layers = jax.tree.leaves(params_shapes["layers"])[0].shape[0]

  def chunk(self, shape) -> int:
    """Elements per rank of a leaf of `shape`."""
    return -(-math.prod(shape) // self.n)

  # ---- outside shard_map ----

  def to_storage(self, params: dict) -> dict:
    """Unsharded parameters -> storage layout (jit it with out_shardings to shard it)."""
    out = {}
    for group in GROUPS:
      leaves = jax.tree.leaves(params[group])
      flat = []
      for leaf, shape in zip(leaves, self.shapes[group]):
        lead = leaf.shape[:leaf.ndim - len(shape)]
        pad = self.n * self.chunk(shape) - math.prod(shape)
        flat.append(jnp.pad(leaf.reshape(*lead, -1), [(0, 0)] * len(lead) + [(0, pad)]))
      out[group] = jax.tree.unflatten(self.treedefs[group], flat)
    return out

  def storage_specs(self) -> dict:
    """PartitionSpecs of the storage tree (also valid for optimizer moments)."""
    specs = {}
    for g in GROUPS:
      spec = spec_for_ndim(2 if g == "layers" else 1, self.shard_axis)
      specs[g] = jax.tree.unflatten(self.treedefs[g], [spec] * len(self.shapes[g]))
    return specs

  def decay_mask(self) -> dict:
    """Weight decay for matrices (embedding, projections), not for norm scales."""
    return {g: jax.tree.unflatten(self.treedefs[g], [len(s) >= 2 for s in self.shapes[g]])
            for g in GROUPS}

  # ---- inside shard_map ----

  def gather(self, collectives, group: str, local_tree):
    """One all_gather of the group's packed shards (one layer's, for "layers");
    returns the unsharded leaves."""
    buf = jnp.concatenate(jax.tree.leaves(local_tree))                       # [K]
    full = collectives.all_gather(buf, self.shard_axis, axis=0, tiled=True)  # [n*K]
    full = full.reshape(self.n, buf.shape[0])
    leaves, offset = [], 0
    for shape in self.shapes[group]:
      k = self.chunk(shape)
      block = full[:, offset:offset + k].reshape(self.n * k)
      leaves.append(block[:math.prod(shape)].reshape(shape))
      offset += k
    return jax.tree.unflatten(self.treedefs[group], leaves)

  def packed_sizes(self) -> dict:
    """Elements per rank of each group's packed buffer (per layer for "layers")."""
    return {g: sum(self.chunk(s) for s in self.shapes[g]) for g in GROUPS}

  def bytes_per_rank(self, dtype=np.float32) -> int:
    sizes = self.packed_sizes()
    per = sizes["embed"] + sizes["head"] + self.n_layers * sizes["layers"]
    return per * np.dtype(dtype).itemsize


def spec_for_ndim(ndim: int, shard_axis: str) -> P:
  """The storage convention: scalars replicated, the last dim of 1-D/2-D leaves sharded."""
  if ndim == 0:
    return P()
  return P(*([None] * (ndim - 1)), shard_axis)
