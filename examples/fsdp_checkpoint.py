"""Checkpoints of the FSDP example with Orbax: sharded state saved and restored as is.

A checkpoint holds the parameters and optimizer state in their sharded storage layout
(each device writes its own shards) and a small JSON record of the run's settings
(model size, mesh, data, schedule), so that `--resume` refuses a checkpoint written by
a different configuration instead of loading it into the wrong layout. The step
number is the checkpoint's name; the data pipeline is a function of the step, so no
data state needs saving. In a multi-process run the processes wait for each other at the
jax.distributed service: saving and restoring run no XLA collective.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    # Every process named as taking part: Orbax's barriers then wait at the jax.distributed
    # service, not (its default for all processes) in an XLA all-reduce across processes
    # (multihost_utils.sync_global_devices, a collective outside the training step). It
    # leaves the directory to us then.
    os.makedirs(self.directory, exist_ok=True)
    everyone = ocp.options.MultiprocessingOptions(
        active_processes=set(range(jax.process_count())))
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False, multiprocessing_options=everyone))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, settings: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        settings=ocp.args.JsonSave(settings)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, params, opt_state, settings: dict):
    """Restores into the shapes and shardings of `params` and `opt_state` (templates)."""
    saved = self.manager.restore(step, args=ocp.args.Composite(
        settings=ocp.args.JsonRestore()))["settings"]
    if saved != settings:
      diff = {k: (saved.get(k), settings.get(k)) for k in sorted(set(saved) | set(settings))
              if saved.get(k) != settings.get(k)}
      raise ValueError(f"checkpoint {self.directory}/{step} was written with other settings "
                       f"(saved, now): {diff}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params, "opt_state": opt_state})
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
    return state["params"], state["opt_state"]

  def close(self) -> None:
    self.manager.close()
