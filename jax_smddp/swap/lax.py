"""Drop-in backend swap: lower ``jax.lax`` collectives through jax_smddp.

An unmodified program that calls ``jax.lax.all_gather``, ``psum_scatter``,
``psum``/``pmax``/``pmin``, ``all_to_all``, ``ragged_all_to_all``, ``ppermute`` or ``pbroadcast``
inside ``jax.shard_map`` can run on jax_smddp's engine, either by setting
``JAX_SMDDP_COLLECTIVES`` before the program starts (read by the ``jax_plugins`` entry point
when JAX initialises its backends) or from code with :func:`use`.

How: the CPU and CUDA lowerings of the lax primitives themselves are replaced by a rule
that asks the jax_smddp module of that collective to lower the call (the
``_lower`` functions take the platform and the lax primitive's parameters) and falls back to
lax's original rule for any case jax_smddp does not take (the same cases as
for the jax_smddp API: other dtypes, ``axis_index_groups`` on GPUs, partially manual
``shard_map``, vmap/pmap axes, other platforms). Typing, batching and
differentiation stay jax.lax's: only the emitted code changes. The original
rules are kept and restored when a collective is swapped back.

Lowerings and compiled executables are cached by JAX: :func:`use` clears
JAX's caches whenever the set of swapped collectives changes, so a function
compiled before the change is compiled again.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Iterable

import numpy as np

import jax

from jax_smddp._jax_internals import lax_parallel, mlir

from jax_smddp import _collective as c
from jax_smddp import _gather_scatter as _gs
from jax_smddp import _startup
from jax_smddp import config
from jax_smddp import requirements
from jax_smddp.swap import combine

# The modules, not the functions of the same name that jax_smddp exports.
_ar = importlib.import_module("jax_smddp.all_reduce")
_a2a = importlib.import_module("jax_smddp.all_to_all")
_pp = importlib.import_module("jax_smddp.ppermute")
_pb = importlib.import_module("jax_smddp.pbroadcast")
_ra = importlib.import_module("jax_smddp.ragged_all_to_all")

log = logging.getLogger("jax_smddp")

ENV_VAR = _startup.ENV_VAR

# The collectives that can be swapped, by their jax_smddp name (the names each
# accepts: _startup.COLLECTIVE_NAMES).
OPS = _startup.SWAPPABLE


Lowered = Any  # lowered values, or a string saying why jax_smddp does not take the call


def _single(fn: Callable[..., Lowered], *params: str) -> Callable[..., Lowered]:
  """Adapts a one-operand jax_smddp lowering to a lax rule (ctx, *args, **params).

  `params` are the lax primitive's parameter names this module knows; a call
  with others (another jax version) keeps lax's lowering.
  """
  known = frozenset(params)

  def adapter(ctx, *args, platform, **kw):
    if len(args) != 1:
      return f"{len(args)} operands in one call"
    if set(kw) != known:
      return f"unexpected parameters {sorted(set(kw) ^ known)}"
    return fn(ctx, args[0], platform=platform, **kw)
  return adapter


def _ragged(ctx, *args, platform, **kw):
  """jax.lax.ragged_all_to_all's six operands: the composition of engine all_to_alls."""
  if len(args) != 6 or set(kw) != {"axis_name", "axis_index_groups"}:
    return f"{len(args)} operands and parameters {sorted(kw)} in one call"
  return _ra._lower(ctx, *args, platform=platform, **kw)


def _no_bool(fn):
  """Reductions of booleans stay with lax (the engine does not reduce them)."""
  def adapter(ctx, x, **params):
    if np.dtype(ctx.avals_in[0].dtype) == np.bool_:
      return "reduction of booleans"
    return fn(ctx, x, **params)
  return adapter


def _gather_no_groups(ctx, x, **params):  # all_gather_invariant_p, all_gather_reduced_p
  return _gs.lower_gather(ctx, x, axis_index_groups=None, **params)


def _scatter_no_groups(ctx, x, **params):  # unreduced_reduce_scatter_p
  return _gs.lower_scatter(ctx, x, axis_index_groups=None, **params)


def _permute(ctx, x, *, platform, axis_name, perm):  # lax names one axis as it was given
  return _pp._lower(ctx, x, platform=platform, axis_name=c.axes_tuple(axis_name), perm=perm)


def _broadcast(ctx, x, *, platform, axis_name, source):
  return _pb._lower(ctx, x, platform=platform, axis_name=c.axes_tuple(axis_name), source=source)


def _reduce(op: str, invariant: bool):
  def lower(ctx, x, *, platform, axes, axis_index_groups=None):
    return _ar._lower(ctx, x, platform=platform, axes=tuple(axes), reduce=op,
                      invariant=invariant, axis_index_groups=axis_index_groups)
  return lower


# Parameters of the lax primitives (besides axis_index_groups where they have it).
_GATHER = ("all_gather_dimension", "axis_name", "axis_size", "tiled")
_SCATTER = ("scatter_dimension", "axis_name", "axis_size", "tiled")
_A2A = ("split_axis", "concat_axis", "axis_name", "axis_index_groups", "tiled")


def _takeovers() -> dict[str, list[tuple[Any, Callable[..., Lowered]]]]:
  """For each swappable collective: the lax primitives taken over, with their lowering.

  A primitive this jax version does not have is skipped.
  """
  table = {
      "all_gather": [
          ("all_gather_p", _single(_gs.lower_gather, "axis_index_groups", *_GATHER)),
          ("all_gather_invariant_p", _single(_gather_no_groups, *_GATHER)),
          ("all_gather_reduced_p", _single(_gather_no_groups, *_GATHER))],
      "reduce_scatter": [
          ("reduce_scatter_p",
           _single(_no_bool(_gs.lower_scatter), "axis_index_groups", *_SCATTER)),
          ("unreduced_reduce_scatter_p", _single(_no_bool(_scatter_no_groups), *_SCATTER))],
      "all_reduce": [
          ("psum_p", _single(_reduce("sum", False), "axes", "axis_index_groups")),
          ("psum_invariant_p", _single(_reduce("sum", True), "axes")),
          ("unreduced_psum_p", _single(_reduce("sum", True), "axes")),
          ("pmax_p", _single(_no_bool(_reduce("max", False)), "axes", "axis_index_groups")),
          ("pmin_p", _single(_no_bool(_reduce("min", False)), "axes", "axis_index_groups"))],
      "all_to_all": [
          ("all_to_all_p", _single(_a2a._lower, *_A2A)),
          ("ragged_all_to_all_p", _ragged)],
      "collective_permute": [
          ("ppermute_p", _single(_permute, "axis_name", "perm")),
          ("pbroadcast_p", _single(_broadcast, "axis_name", "source"))],
  }
  return {op: [(getattr(lax_parallel, name), lower) for name, lower in rows
               if hasattr(lax_parallel, name)]
          for op, rows in table.items()}


_active: set[str] = set()
_saved: dict[Any, Any] = {}  # (lax primitive, platform) -> its original entry there (or None)


def _install(prim, op: str, lower: Callable[..., Lowered]) -> None:
  for platform in c.ENGINE_PLATFORMS:
    _install_for(prim, op, lower, platform)


def _install_for(prim, op: str, lower: Callable[..., Lowered], platform: str) -> None:
  table = mlir._platform_specific_lowerings[platform]
  original = table.get(prim)
  _saved[(prim, platform)] = original
  # None: lax has no rule for this platform (pbroadcast on CPU), so nothing to fall back to.
  entry = original if original is not None else mlir._lowerings.get(prim)
  original_rule = entry.rule if entry is not None else _no_rule(prim, platform)

  def rule(ctx, *args, **params):
    requirements.enforce()
    if platform == "cuda" and len(args) == 1:
      out = c.lower_cuda(prim, op, lower, ctx, args[0], params)
    else:  # CPU, or a composition of collectives that each lower themselves (ragged_all_to_all)
      out = lower(ctx, *args, platform=platform, **params)
    if isinstance(out, str):
      requirements.fallback(f"jax.lax {prim.name} keeps its own lowering here", out)
      return original_rule(ctx, *args, **params)
    return out

  rule.__name__ = f"smddp_swapped_{prim.name}"
  mlir.register_lowering(prim, rule, platform=platform,
                         inline=entry.inline if entry is not None else False)


def _no_rule(prim, platform: str):
  def rule(ctx, *args, **params):
    raise NotImplementedError(f"jax.lax {prim.name} has no lowering for platform {platform}, and "
                              f"jax_smddp does not take this call")
  return rule


def _uninstall(prim) -> None:
  for platform in c.ENGINE_PLATFORMS:
    table = mlir._platform_specific_lowerings[platform]
    original = _saved.pop((prim, platform))
    if original is None:
      table.pop(prim, None)
    else:
      table[prim] = original


def parse(ops: Iterable[str] | str) -> frozenset[str]:
  """Names of collectives (``all``, ``none``, jax_smddp or jax.lax names, comma lists)."""
  if isinstance(ops, str):
    ops = [ops]
  out: set[str] = set()
  for item in ops:
    if not isinstance(item, str):
      raise TypeError(f"jax_smddp.use: collective names are strings, got {item!r}")
    out.update(_startup.parse_collectives(item).ops)  # "xla": XLA's own only (xla_swap)
  return frozenset(out)


def active() -> frozenset[str]:
  """The jax.lax collectives currently lowered through jax_smddp."""
  return frozenset(_active)


def _set(ops: frozenset[str], clear_caches: bool) -> None:
  if ops == _active:
    return
  takeovers = _takeovers()
  for op in OPS:
    if op in _active and op not in ops:
      for prim, _ in takeovers[op]:
        _uninstall(prim)
    elif op in ops and op not in _active:
      for prim, lower in takeovers[op]:
        _install(prim, op, lower)
  _active.clear()
  _active.update(ops)
  if _active & set(combine.KINDS):
    combine.install(active)
  else:
    combine.uninstall()
  if clear_caches:
    jax.clear_caches()


class use:
  """Lowers the named ``jax.lax`` collectives through jax_smddp.

  ``use("all_gather", "reduce_scatter")`` (or ``use("all")``) takes effect at
  once and sets exactly the collectives that are swapped (``use()`` or
  ``use("none")`` swaps none back). Used as a context manager, the previous
  set is restored on exit::

      with jax_smddp.use("all"):
        y = f(x)            # jax.lax collectives in f run on jax_smddp

  Names: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
  ``collective_permute``, or the jax.lax names ``psum_scatter``, ``psum``/``pmax``/``pmin``
  (all three are ``all_reduce``), ``ragged_all_to_all`` (``all_to_all``), ``ppermute`` and
  ``pbroadcast`` (both ``collective_permute``), ``all``, ``none``; comma lists are accepted.
  ``xla`` also has
  XLA's own cross-process CPU collectives served by jax_smddp (jax_smddp.swap.xla),
  which can only be chosen before JAX creates its CPU client, in a process whose
  jaxlib was loaded with ``MPITRAMPOLINE_LIB`` set (``JAX_SMDDP_COLLECTIVES=xla``
  at start-up does both); leaving the context does not undo it.

  JAX caches lowerings and executables: whenever the set changes, JAX's caches
  are cleared (``jax.clear_caches()``) so that functions already compiled are
  compiled again with the new lowering; pass ``clear_caches=False`` to keep
  them (then only functions first traced after the change are affected).
  """

  def __init__(self, *ops: str, clear_caches: bool = True):
    if any(_startup.parse_collectives(o, strict=False).xla for o in ops if isinstance(o, str)):
      # XLA's own collectives: only before JAX creates its CPU client, and only in a
      # process started with JAX_SMDDP_COLLECTIVES=xla or MPITRAMPOLINE_LIB set (raises).
      from jax_smddp.swap import clients
      clients.install()
    self._previous = active()
    self._clear = clear_caches
    _set(parse(ops), clear_caches)

  def __enter__(self) -> "use":
    return self

  def __exit__(self, *exc) -> None:
    _set(self._previous, self._clear)

  def __repr__(self) -> str:
    return f"jax_smddp.use({', '.join(sorted(active()))})"


def use_from_env() -> frozenset[str]:
  """Applies ``JAX_SMDDP_COLLECTIVES`` (done by the jax_plugins entry point)."""
  raw = config.get(ENV_VAR) or ""
  try:
    ops = parse(raw)
  except ValueError as e:
    raise ValueError(f"{ENV_VAR}={raw!r}: {e}") from None
  if ops:
    _set(ops | _active, clear_caches=False)
    log.info("jax_smddp: jax.lax %s lower through jax_smddp (%s)",
             ", ".join(sorted(ops)), ENV_VAR)
  return ops
