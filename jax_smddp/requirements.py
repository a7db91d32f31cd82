"""JAX_SMDDP_REQUIRE: what a job insists on, instead of running on a fallback.

``JAX_SMDDP_REQUIRE=efa,gdrcopy`` (a comma list of the names in REQUIREMENTS)
makes ``python -m jax_smddp.doctor`` exit non-zero naming what is missing, and
makes the job's first jax_smddp collective (its lowering, or
``jax_smddp.initialize()``) raise ``RequirementError`` with the same reason,
rather than run on tcp instead of efa or on XLA's collectives instead of
jax_smddp's. ``no-fallback`` turns every fallback to jax.lax's lowering into
that error. Unset, each fallback is logged once at WARNING level with its
reason.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from jax_smddp import capabilities
from jax_smddp import config

log = logging.getLogger("jax_smddp")

ENV = "JAX_SMDDP_REQUIRE"


class RequirementError(RuntimeError):
  """A requirement of JAX_SMDDP_REQUIRE is not met on this machine."""


def _libfabric() -> str:
  f = capabilities.fabric()
  if not f["loaded"]:
    return f"libfabric cannot be used: {f['error']}"
  if not f["providers"]:
    return f"libfabric {f['version']} ({f['path']}) offers no reliable-datagram provider here"
  return ""


def _efa() -> str:
  why = _libfabric()
  if why:
    return why
  f = capabilities.fabric()
  if "efa" not in f["providers"]:
    return (f"libfabric ({f['path']}) has no efa provider here (providers: "
            f"{', '.join(f['providers'])}): no EFA device, or a libfabric without EFA support "
            "(on AWS, the EFA installer's /opt/amazon/efa)")
  return ""


def _cuda() -> str:
  c = capabilities.cuda()
  return c["error"] if c["error"] else ""


def _gdrcopy() -> str:
  return capabilities.gdrcopy()["error"]


def _mps() -> str:
  return capabilities.mps()["error"]


# Name -> check (returns "" when met, else why not). "no-fallback" is checked
# where a collective would fall back (see fallback()).
REQUIREMENTS: dict[str, Callable[[], str] | None] = {
    "libfabric": _libfabric,
    "efa": _efa,
    "cuda": _cuda,
    "gdrcopy": _gdrcopy,
    "mps": _mps,
    "no-fallback": None,
}


def required() -> tuple[str, ...]:
  """The names in JAX_SMDDP_REQUIRE (the settings registry refuses others)."""
  return tuple(dict.fromkeys(config.get(ENV) or []))


def unmet(names: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
  """(name, why) for each of `names` (default: JAX_SMDDP_REQUIRE's) not met here."""
  names = required() if names is None else names
  out = []
  for name in names:
    check = REQUIREMENTS[name]
    why = check() if check is not None else ""
    if why:
      out.append((name, why))
  return out


def describe(failures: list[tuple[str, str]]) -> str:
  lines = "; ".join(f"{name}: {why}" for name, why in failures)
  return (f"jax_smddp: {ENV}={os.environ.get(ENV, '')} is not met here ({lines}). "
          f"`python -m jax_smddp.doctor` shows what this machine offers; unset {ENV} (or drop "
          "these names) to run on the fallback instead.")


def enforce() -> None:
  """Raises ValueError for an invalid setting, RequirementError when a
  requirement is not met (each collective's lowering calls this, so the first
  one fails and none runs on a fallback or a misread setting)."""
  config.validate()
  if not os.environ.get(ENV):
    return
  failures = unmet()
  if failures:
    raise RequirementError(describe(failures))


_warned: set = set()


def fallback(what: str, why: str) -> None:
  """Called where a collective falls back (`what` lowers through jax.lax, or
  runs on a slower transport, because `why`): raises with ``no-fallback``
  required, else logs a warning once per (what, why)."""
  if os.environ.get(ENV) and "no-fallback" in required():
    raise RequirementError(
        f"jax_smddp: {what} would fall back here ({why}), and {ENV} includes no-fallback. "
        f"Change the program or the machine so jax_smddp takes it, or drop no-fallback from {ENV}.")
  warn_once(what, why)


def warn_once(what: str, why: str) -> None:
  if (what, why) not in _warned:
    _warned.add((what, why))
    log.warning("jax_smddp: %s: %s", what, why)
