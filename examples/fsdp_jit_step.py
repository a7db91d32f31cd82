"""The FSDP step written as global-view jit (`--style jit`), as MaxText writes FSDP.

No shard_map and no collective in the code: parameters and optimizer state are jax
Arrays sharded over the `fsdp` mesh axis (each leaf along its largest dimension that
the axis divides; replicated when none does), the batch over every device, and one
`jax.jit` with those shardings runs the unsharded model (fsdp_model.forward). XLA's
SPMD partitioner inserts the all-gathers of the parameters and the reductions of the
gradients. Which library runs those is XLA's choice of CPU collectives: gloo by
default across processes, jax_smddp's engine with JAX_SMDDP_COLLECTIVES=xla set
before Python starts (jax_smddp/swap/xla.py; fsdp_train.py sets it for the processes
it launches with `--collectives smddp`). Within one process XLA's in-process
collectives run either way.

Same model, loss, clipping and AdamW as the shard_map step (fsdp_step.py), so the
losses of the two styles agree.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_model as fm
from fsdp_mesh import SHARD_AXIS, MeshPlan


class JitFSDP:
  """The global-view steps for one model and mesh (the interface fsdp_train.py uses)."""

  policy_name = "none"
  gathers_per_layer = None  # XLA's partitioner decides

  def __init__(self, cfg: fm.Config, plan: MeshPlan, optimizer_for, global_batch: int,
               clip_norm: float = 1.0):
    self.cfg, self.plan, self.clip_norm = cfg, plan, clip_norm
    self.mesh = plan.make_mesh()
    self.global_tokens = global_batch * cfg.seq_len
    shapes = jax.eval_shape(functools.partial(fm.init_params, cfg), jax.random.key(0))
    self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    # Decay matrices, not norm scales (the stacked layers' leading axis is not a dimension).
    decay = {g: jax.tree.map(lambda s, g=g: s.ndim - (g == "layers") >= 2, shapes[g])
             for g in shapes}
    self.optimizer = optimizer_for(decay)
    self.param_specs = jax.tree.map(self._spec, shapes)
    self.opt_specs = jax.tree.map(self._spec, jax.eval_shape(self.optimizer.init, shapes))
    self.batch_spec = P(plan.batch_axes)
    self.layout = self  # bytes_per_rank, as FlatLayout

  def _spec(self, leaf) -> P:
    n = self.plan.shard_size
    dims = [d for d in np.argsort(leaf.shape)[::-1] if leaf.shape[d] % n == 0]
    if not leaf.shape or not dims or n == 1:
      return P()
    spec = [None] * len(leaf.shape)
    spec[int(dims[0])] = SHARD_AXIS
    return P(*spec)

  def bytes_per_rank(self) -> int:
    shapes = jax.eval_shape(functools.partial(fm.init_params, self.cfg), jax.random.key(0))
    return sum(4 * math.prod(x.shape) // (self.plan.shard_size if s != P() else 1)
               for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(
                   self.param_specs, is_leaf=lambda x: isinstance(x, P))))

  def shardings(self, specs):
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  @functools.cached_property
  def _init_params(self):  # one compiled program for every init_state (and collectives_only_step)
    return jax.jit(functools.partial(fm.init_params, self.cfg),
                   out_shardings=self.shardings(self.param_specs))

  def init_state(self, seed: int):
    params = self._init_params(jax.random.key(seed))
    opt_state = jax.jit(self.optimizer.init, out_shardings=self.shardings(self.opt_specs))(params)
    return params, opt_state

  def shard_batch(self, tokens):
    return self.plan.place_batch(self.mesh, tokens)

  def _loss(self, params, tokens):
    logits = fm.forward(self.cfg, params, tokens[:, :-1])
    return fm.next_token_loss_sum(logits, tokens[:, 1:]) / self.global_tokens

  def _train_step(self, params, opt_state, tokens):
    loss, grads = jax.value_and_grad(self._loss)(params, tokens)
    grad_norm = optax.global_norm(grads)
    scale = jnp.minimum(1.0, self.clip_norm / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": grad_norm}

  @functools.cached_property
  def train_step(self):
    state = (self.shardings(self.param_specs), self.shardings(self.opt_specs))
    replicated = NamedSharding(self.mesh, P())
    return jax.jit(self._train_step,
                   in_shardings=(*state, NamedSharding(self.mesh, self.batch_spec)),
                   out_shardings=(*state, {"loss": replicated, "grad_norm": replicated}),
                   donate_argnums=(0, 1))

  @functools.cached_property
  def eval_step(self):
    return jax.jit(self._loss, out_shardings=NamedSharding(self.mesh, P()))

  @functools.cached_property
  def collectives_only_step(self):
    """The parameters' all-gathers alone (sharded in, replicated out): the part of the
    step's collectives that does not depend on XLA's choices for the gradients."""
    params = self._init_params(jax.random.key(0))

    def gather_params(p):  # named: its compiled program is jit_gather_params (--dump-hlo)
      return p

    gather = jax.jit(gather_params, out_shardings=NamedSharding(self.mesh, P()))
    return lambda: gather(params)
