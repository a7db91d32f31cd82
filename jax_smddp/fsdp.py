"""FSDP helpers: run a stack of layers over sharded parameters, prefetching the next layer.

    from jax_smddp.fsdp import scan_layers

    def gather(shards):                       # one layer's shards -> its full parameters
      return jax_smddp.all_gather(shards, "fsdp", axis=0, tiled=True)

    h = scan_layers(layer_fn, x, stacked_shards, gather)   # inside jax.shard_map

`layer_fn(h, params) -> h` is one layer; `stacked_shards` is a pytree whose leaves carry
the layer dimension first (this rank's shards of every layer); `gather(shards)` turns one
layer's shards into the parameters `layer_fn` takes, with any all_gather (jax_smddp's or
jax.lax's: the helper calls no collective itself).

prefetch=True (the default) software-pipelines the gathers: the first layer is gathered
before the loop, and the loop carries (h, params of the next layer): iteration i issues
the all_gather of layer i+1 and runs layer i on the parameters gathered one iteration
earlier. The gather has no data dependence on the layer's compute, so a runtime that runs
independent operations concurrently can overlap them. The loop runs n-1 times and the
last layer runs after it, so nothing is gathered twice and no dummy gather is issued.
The backward pass needs no code: the transpose of iteration i's gather (layer i+1's
reduce-scatter) receives its cotangent from the previous backward iteration, so it is
issued while layer i's backward pass computes. Cost: one more layer's gathered
parameters are live at a time.

policy: a `jax.checkpoint` policy (or None) per layer. With prefetch=False the gather is
inside the checkpointed region, so the backward pass gathers each layer again
(reshard after forward: two all_gathers per layer). With prefetch=True only the layer's
compute is checkpointed: the prefetched parameters come from the previous iteration, are
an input of the region and are therefore kept for the backward pass (one all_gather per
layer; activations are still rematerialized per the policy). Use prefetch=False where
the memory of all layers' gathered parameters matters more than the overlap.

unroll: `lax.scan`'s unroll (layers per loop iteration; True: no loop).

On the CPU backend prefetch gains little (examples/README.md, "Prefetch on CPU"): XLA's
CPU runtime does run a collective concurrently with independent work, but there the
collectives are CPU work on the same cores as the layers, so only waiting for slower ranks
can be hidden; and XLA copies the loop-carried parameters (and, in the backward loop, their
cotangent) at every iteration, about four copies of a layer's parameters per layer and
step, which with big layers cost more than the overlap saves unless the loop is unrolled.
It is meant for backends that run collectives beside the compute (GPU).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

__all__ = ["scan_layers", "gathers_per_layer"]


def gathers_per_layer(prefetch: bool, policy) -> int:
  """All_gathers of each layer's parameters per training step (forward + backward)."""
  return 2 if (policy is not None and not prefetch) else 1


def scan_layers(layer_fn: Callable[[Any, Any], Any], x, layer_shards, gather: Callable[[Any], Any],
                *, prefetch: bool = True, policy=None, unroll: int | bool = 1):
  """Applies `layer_fn` once per layer of `layer_shards` (leading dim = layers), in order.

  Returns the final activation. See the module docstring for prefetch and policy.
  Equal to `for i: x = layer_fn(x, gather(shards[i]))` in value and gradient.
  """
  leaves = jax.tree.leaves(layer_shards)
  if not leaves:
    raise ValueError("scan_layers: layer_shards has no arrays")
  n = leaves[0].shape[0]
  if any(leaf.ndim == 0 or leaf.shape[0] != n for leaf in leaves):
    raise ValueError("scan_layers: every leaf of layer_shards needs the same leading "
                     f"(layer) dimension; got shapes {[leaf.shape for leaf in leaves]}")
  if n == 0:
    return x

  if not prefetch:
    def step(h, shards):
      return layer_fn(h, gather(shards))           # gather just before use
    if policy is not None:
      step = jax.checkpoint(step, policy=policy)
    h, _ = jax.lax.scan(lambda h, s: (step(h, s), None), x, layer_shards, unroll=unroll)
    return h

  layer = layer_fn if policy is None else jax.checkpoint(layer_fn, policy=policy)
  params = gather(jax.tree.map(lambda a: a[0], layer_shards))      # layer 0, before the loop
  if n > 1:
    def body(carry, next_shards):
      h, params = carry
      next_params = gather(next_shards)            # layer i+1: independent of layer i
      return (layer(h, params), next_params), None
    (x, params), _ = jax.lax.scan(body, (x, params),
                                  jax.tree.map(lambda a: a[1:], layer_shards), unroll=unroll)
  return layer(x, params)                          # the last layer: nothing left to fetch
