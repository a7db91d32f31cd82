"""The FSDP training and evaluation steps, and a step that runs only their collectives.

Everything runs inside one `jax.shard_map` per step, on each device's shards:

  forward   gather the embedding; scan over layers (jax_smddp.fsdp.scan_layers), each
            layer's parameters unsharded by one all_gather: with prefetch, layer i+1's
            gather is issued while layer i computes (the scan carries the gathered
            parameters); without, just before the layer uses them; gather the head.
  backward  jax.grad; the transpose of each all_gather is a reduce-scatter, so each
            layer's gradient arrives already sharded like its parameters (with prefetch,
            layer i+1's reduce-scatter is issued while layer i's gradient computes).
  hybrid    (--mesh RxS) parameters are invariant over the replica axis; they are cast to
            "varying" before jax.grad so that JAX inserts no reduction of its own, then
            the gradients are summed across replica groups with one psum of one flat buffer.
  update    global-norm clipping (one scalar psum over the shard axis) and AdamW, all on
            shards: the optimizer state never exists unsharded.

The loss of a rank is the sum of its tokens' cross-entropies divided by the GLOBAL
token count, so the psum of the ranks' losses (and of their gradients) is the mean
over the global batch, whatever the mesh.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_model as fm
from fsdp_layout import FlatLayout, spec_for_ndim
from fsdp_mesh import MeshPlan, psum_packed
from jax_smddp.fsdp import gathers_per_layer, scan_layers

REMAT_POLICIES = {
    # no jax.checkpoint: gathered layer parameters are kept for the backward pass.
    "none": None,
    # matmul outputs kept; the rest of each layer, including the parameter all_gather,
    # is recomputed in the backward pass (FSDP's reshard-after-forward).
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # only each layer's input kept: the whole layer recomputed.
    "full": jax.checkpoint_policies.nothing_saveable,
}


OFFLOAD_POLICY = "offload_dots_no_batch"


def layer_policy(remat: str, offload: bool):
  """(name, jax.checkpoint policy) for one layer; a None policy means no jax.checkpoint."""
  if offload:
    # Matmul outputs (no batch dims) go to pinned host memory in the forward pass and
    # come back for the backward pass; everything else is recomputed.
    return OFFLOAD_POLICY, jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")
  return remat, REMAT_POLICIES[remat]


def make_schedule(lr: float, warmup: int, steps: int):
  """Linear warmup to `lr`, then cosine decay to lr/10 at `steps`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=lr * 0.1)


def make_optimizer(schedule, weight_decay: float, decay_mask):
  return optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                     mask=decay_mask)


def state_specs(tree, shard_axis: str):
  """PartitionSpecs for storage-shaped trees (parameters, optimizer state)."""
  return jax.tree.map(lambda x: spec_for_ndim(x.ndim, shard_axis), tree)


class FSDP:
  """The sharded steps for one model, mesh, collectives library and remat policy."""

  def __init__(self, cfg: fm.Config, plan: MeshPlan, collectives,
               optimizer_for: Callable[[dict], optax.GradientTransformation],
               global_batch: int, remat: str = "none", offload: bool = False,
               clip_norm: float = 1.0, prefetch: bool = False, unroll: int = 1):
    """`optimizer_for(decay_mask)` makes the optimizer, given which leaves to decay."""
    self.cfg, self.plan, self.c = cfg, plan, collectives
    self.prefetch = prefetch
    self.unroll = unroll if unroll > 0 else True     # lax.scan's unroll; 0: all layers
    self.mesh = plan.make_mesh()
    self.policy_name, self.policy = layer_policy(remat, offload)
    self.clip_norm = clip_norm
    self.global_tokens = global_batch * cfg.seq_len
    shapes = jax.eval_shape(functools.partial(fm.init_params, cfg), jax.random.key(0))
    self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    self.layout = FlatLayout(shapes, plan.shard_size)
    self.optimizer = optimizer = optimizer_for(self.layout.decay_mask())
    self.param_specs = self.layout.storage_specs()
    opt_shapes = jax.eval_shape(optimizer.init, jax.eval_shape(self.layout.to_storage, shapes))
    self.opt_specs = state_specs(opt_shapes, self.layout.shard_axis)
    self.batch_spec = P(plan.batch_axes)

  # ---- state ----

  def shardings(self, specs):
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def init_state(self, seed: int):
    """Parameters and optimizer state, created directly in their sharded layout."""
    init = lambda key: self.layout.to_storage(fm.init_params(self.cfg, key))
    params = jax.jit(init, out_shardings=self.shardings(self.param_specs))(jax.random.key(seed))
    opt_state = jax.jit(self.optimizer.init,
                        out_shardings=self.shardings(self.opt_specs))(params)
    return params, opt_state

  def shard_batch(self, tokens):
    return self.plan.place_batch(self.mesh, tokens)

  # ---- per-rank code (runs inside shard_map) ----

  def _forward(self, params, inputs):
    cfg, lay, c = self.cfg, self.layout, self.c
    x = fm.Embed(cfg).apply({"params": lay.gather(c, "embed", params["embed"])}, inputs)
    # A lax.scan over the layers. prefetch: the scan carries the next layer's gathered
    # parameters, so layer i+1's all_gather is issued while layer i computes (and, in the
    # backward pass, its reduce-scatter while layer i's gradient computes). Otherwise each
    # layer is gathered just before use.
    x = scan_layers(lambda h, p: fm.Block(cfg).apply({"params": p}, h), x, params["layers"],
                    functools.partial(lay.gather, c, "layers"),
                    prefetch=self.prefetch, policy=self.policy, unroll=self.unroll)
    return fm.Head(cfg).apply({"params": lay.gather(c, "head", params["head"])}, x)

  def _local_loss(self, params, tokens):
    logits = self._forward(params, tokens[:, :-1])
    return fm.next_token_loss_sum(logits, tokens[:, 1:]) / self.global_tokens

  def _train_step(self, params, opt_state, tokens):
    c, replica, shard = self.c, self.plan.replica_axis, self.layout.shard_axis
    # Parameters are the same on every replica group. Seen as "varying" over the replica
    # axis, their gradients are this rank's own; JAX would otherwise psum them with lax.
    diff_params = jax.lax.pcast(params, replica, to="varying") if replica else params
    loss, grads = jax.value_and_grad(self._local_loss)(diff_params, tokens)
    # grads: this rank's shards, already reduce-scattered over the shard group.
    if replica:
      grads = psum_packed(c, grads, replica)       # all-reduce across replica groups
    sq = sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads))
    grad_norm = jnp.sqrt(c.psum(sq, shard))
    scale = jnp.minimum(1.0, self.clip_norm / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    loss = c.psum(loss, self.plan.axis_names)       # mean over the global batch
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

  def _eval_step(self, params, tokens):
    return self.c.psum(self._local_loss(params, tokens), self.plan.axis_names)

  # ---- jitted steps ----

  @functools.cached_property
  def train_step(self):
    f = jax.shard_map(self._train_step, mesh=self.mesh,
                      in_specs=(self.param_specs, self.opt_specs, self.batch_spec),
                      out_specs=(self.param_specs, self.opt_specs, P()))
    return jax.jit(f, donate_argnums=(0, 1))

  @functools.cached_property
  def eval_step(self):
    f = jax.shard_map(self._eval_step, mesh=self.mesh,
                      in_specs=(self.param_specs, self.batch_spec), out_specs=P())
    return jax.jit(f)

  # ---- the step's collectives alone ----

  @property
  def gathers_per_layer(self) -> int:
    """Forward gather, plus a second one in the backward pass when the layer is remat'ed
    without prefetch (with prefetch the gathered parameters are kept; jax_smddp.fsdp)."""
    return gathers_per_layer(self.prefetch, self.policy)

  @functools.cached_property
  def collectives_only_step(self):
    """A jitted function that runs exactly the train step's collectives and no model math.

    Same library, same groups, same shapes and count: per group (embedding, each layer,
    head) the all_gather of its packed shards (twice for remat'ed layers), the
    reduce-scatter of a gradient of that size, the replica psum of all gradients as one
    buffer, and the two scalar psums (grad norm, loss). Inputs are the packed buffers,
    so no packing or unpacking is timed; the only arithmetic is one add per re-gather.
    The collective share reported by fsdp_train.py is its time over the step's time.
    """
    c, shard, replica = self.c, self.layout.shard_axis, self.plan.replica_axis
    regather = self.gathers_per_layer == 2

    def gather_scatter(buf, twice):
      full = c.all_gather(buf, shard, axis=0, tiled=True)
      if twice:  # opaque input, so that XLA cannot merge the two gathers
        full = full + c.all_gather(jax.lax.optimization_barrier(buf), shard, axis=0, tiled=True)
      return c.psum_scatter(full, shard, scatter_dimension=0, tiled=True)

    def comm(bufs):
      embed = gather_scatter(bufs["embed"], False)
      _, layers = jax.lax.scan(lambda _, b: (None, gather_scatter(b, regather)),
                               None, bufs["layers"])
      head = gather_scatter(bufs["head"], False)
      grads = {"embed": embed, "layers": layers, "head": head}
      if replica:
        grads = psum_packed(c, grads, replica)
      norm = c.psum(jnp.sum(grads["head"]), shard)
      return grads, c.psum(norm, self.plan.axis_names)

    specs = {"embed": P(shard), "layers": P(None, shard), "head": P(shard)}
    f = jax.jit(jax.shard_map(comm, mesh=self.mesh, in_specs=(specs,),
                              out_specs=(specs, P())))
    sizes = self.layout.packed_sizes()
    n = self.layout.n
    shapes = {"embed": (n * sizes["embed"],), "layers": (self.layout.n_layers, n * sizes["layers"]),
              "head": (n * sizes["head"],)}
    # Zeros made where they live, each device its own shard: no host array and no
    # collective. (jax.device_put of a global array would first check, with an XLA
    # all-gather across processes, that every process passed the same value.)
    bufs = {g: jax.jit(functools.partial(jnp.zeros, shapes[g], jnp.float32),
                       out_shardings=NamedSharding(self.mesh, specs[g]))()
            for g in shapes}
    return lambda: f(bufs)


def collective_ops(hlo_text: str) -> dict:
  """Collective instructions in a compiled module's text, by kind: jax_smddp custom calls
  (smddp_all_gather, ...) and XLA's own (all-gather, ..., collective-permute). A static
  count: an op inside the layer loop runs once per layer (jax_smddp.tools.step_collectives
  counts the calls)."""
  ops = re.findall(r'custom_call_target="(smddp_\w+)"', hlo_text)
  ops += re.findall(r"\s(all-gather|reduce-scatter|all-reduce|ragged-all-to-all|all-to-all|"
                    r"collective-permute|collective-broadcast)(?:-start)?\(", hlo_text)
  return dict(sorted(collections.Counter(ops).items()))


def _computations(hlo_text: str) -> dict:
  """Computation name -> its text, in a compiled module's text."""
  comps, name, lines = {}, None, []
  for line in hlo_text.splitlines():
    head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if name is None and head and not line.startswith(" "):
      name, lines = head.group(1), []
    elif name is not None and line.startswith("}"):
      comps[name] = "\n".join(lines)
      name = None
    elif name is not None:
      lines.append(line)
  return comps


def loop_collective_ops(hlo_text: str) -> list:
  """collective_ops of each while loop's body in a compiled module (the layer scans: the
  forward loop, then the backward loop), in the module's order; loops without collectives
  are left out."""
  comps = _computations(hlo_text)
  bodies = re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", hlo_text)
  out = [collective_ops(comps.get(b, "")) for b in dict.fromkeys(bodies)]
  return [ops for ops in out if ops]
