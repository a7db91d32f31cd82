"""The device mesh of the FSDP example, and which library runs its collectives.

  --mesh 8     one axis, ("fsdp",): parameters sharded 8 ways, batch sharded 8 ways.
  --mesh 2x4   hybrid sharding, ("replica", "fsdp"): parameters sharded 4 ways within
               each replica group and replicated across the 2 groups; batch sharded over
               all 8 devices. Gradients are reduce-scattered within a shard group (the
               transpose of the parameter all_gather), then summed across replica groups
               with one psum.
  --mesh 1     a single device: the same program with groups of one (the reference).

`--collectives smddp|xla` picks the module that provides all_gather / psum_scatter /
psum: `jax_smddp` or `jax.lax`. They have the same signatures, so the training code
is identical apart from that one name; the gradient reduce-scatter follows, being the
transpose of each library's own all_gather.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SHARD_AXIS = "fsdp"
REPLICA_AXIS = "replica"


def collectives_module(name: str):
  if name == "smddp":
    import jax_smddp
    return jax_smddp
  if name == "xla":
    return jax.lax
  raise ValueError(f"--collectives must be smddp or xla, not {name!r}")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  shape: tuple[int, ...]            # (fsdp,) or (replica, fsdp)

  @classmethod
  def parse(cls, text: str) -> "MeshPlan":
    try:
      shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
      shape = ()
    if len(shape) not in (1, 2) or min(shape, default=0) < 1:
      raise ValueError(f"--mesh must be N (fsdp) or RxS (replica x fsdp), not {text!r}")
    return cls(shape)

  @property
  def axis_names(self) -> tuple[str, ...]:
    return (SHARD_AXIS,) if len(self.shape) == 1 else (REPLICA_AXIS, SHARD_AXIS)

  @property
  def replica_axis(self) -> str | None:
    return REPLICA_AXIS if len(self.shape) == 2 else None

  @property
  def shard_size(self) -> int:
    return self.shape[-1]

  @property
  def num_devices(self) -> int:
    return math.prod(self.shape)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The batch is split over every device."""
    return self.axis_names

  def __str__(self) -> str:
    return "x".join(map(str, self.shape))

  def make_mesh(self) -> Mesh:
    devices = jax.devices()
    if len(devices) < self.num_devices:
      raise ValueError(f"--mesh {self} needs {self.num_devices} devices, jax sees {len(devices)}")
    return Mesh(np.array(devices[:self.num_devices]).reshape(self.shape), self.axis_names)

  def batch_sharding(self, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(self.batch_axes))

  def place_batch(self, mesh: Mesh, tokens):
    """The global batch (the same numpy array in every process) as a sharded jax Array: each
    process places the rows of its own devices. (jax.device_put would also check that every
    process passed the same array, with an all-gather across processes on every call.)"""
    tokens = np.asarray(tokens)
    return jax.make_array_from_callback(tokens.shape, self.batch_sharding(mesh),
                                        lambda index: tokens[index])


def psum_packed(collectives, tree, axis_name):
  """All-reduce a pytree as one flat buffer (one collective instead of one per leaf)."""
  flat, unravel = ravel_pytree(tree)
  return unravel(collectives.psum(flat, axis_name))
