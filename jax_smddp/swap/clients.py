"""The XLA-level swap's set-up, run as JAX creates its clients (``JAX_SMDDP_COLLECTIVES=xla``
or ``all``).

JAX creates a platform's client through the factory registered for it
(``jax._src.xla_bridge``, reached through :mod:`jax_smddp._jax_internals`). :func:`install`
wraps the CPU and the CUDA factories, with one wrapper, so that before the client exists each
checks its library (the MPI ABI library, :mod:`jax_smddp.swap.xla`; the NCCL API front end,
:mod:`jax_smddp.swap.nccl`), connects
jax_smddp's processes (:func:`jax_smddp.initialize`, over the jax.distributed key-value store)
and hands the library that world. A failure raises where JAX creates the client: the program
stops instead of running on another implementation.

This module lies above those two and :mod:`jax_smddp.distributed` (which reports what the
libraries serve: ``xla_collectives``), so that none of them imports one that imports it back.
"""

from __future__ import annotations

import dataclasses


from jax_smddp._jax_internals import jax_distributed, xla_bridge

from jax_smddp import distributed
from jax_smddp.swap import nccl as nccl_swap
from jax_smddp.swap import xla as xla_swap


def _set_up_cpu() -> None:
  lib = xla_swap.check_for_client()
  if jax_distributed.global_state.client is None:
    return  # one process: JAX runs no cross-process collective
  distributed.initialize()
  xla_swap.serve(lib)


def _set_up_cuda() -> None:
  lib = nccl_swap.load_for_client()
  if lib is None:
    return  # XLA's GPU collectives stay on NCCL (load_for_client said why)
  state = jax_distributed.global_state
  process = int(state.process_id or 0) if state.client is not None else 0
  if state.client is not None:
    distributed.initialize()
  nccl_swap.serve(lib, process)


def _refuse_if_created(platform: str, name: str) -> None:
  if platform in xla_bridge._backends:
    raise RuntimeError(
        f"jax_smddp: JAX's {name} client already exists, so its collectives cannot change; set "
        "JAX_SMDDP_COLLECTIVES=xla before Python starts.")


def _wrap(platform: str, set_up, refuse_if_created: str = "") -> None:
  """Wraps `platform`'s client factory, once, so that `set_up` runs before it creates
  the client; with `refuse_if_created` (the platform's name in words), raises where
  that client exists already and the factory is not wrapped yet."""
  registration = xla_bridge._backend_factories.get(platform)
  if registration is None or getattr(registration.factory, "_jax_smddp", False):
    return
  if refuse_if_created:
    _refuse_if_created(platform, refuse_if_created)
  make_client = registration.factory

  def factory(*args, **kwargs):
    set_up()
    return make_client(*args, **kwargs)

  factory._jax_smddp = True
  xla_bridge._backend_factories[platform] = dataclasses.replace(registration, factory=factory)


def _install_cuda() -> None:
  """JAX's CUDA plugin may register its factory after jax_smddp's plugin runs (JAX
  initializes plugins in no fixed order): a factory registered later is wrapped as it
  is registered, and again once every plugin is (both idempotent)."""

  def wrap(**_):
    _wrap("cuda", _set_up_cuda)

  _refuse_if_created("cuda", "CUDA")
  wrap()
  register = xla_bridge.register_backend_factory
  if not getattr(register, "_jax_smddp", False):
    def register_backend_factory(name, *args, **kwargs):
      register(name, *args, **kwargs)
      if name == "cuda":
        wrap()

    register_backend_factory._jax_smddp = True
    xla_bridge.register_backend_factory = register_backend_factory
  xla_bridge.register_plugin_callbacks(wrap)


def install() -> None:
  """Wraps JAX's CUDA and CPU client factories so that each sets its swap up first;
  called by the jax_plugins entry point (and ``jax_smddp.use("xla")``), before any
  client exists."""
  _install_cuda()
  _wrap("cpu", _set_up_cpu, refuse_if_created="CPU")
