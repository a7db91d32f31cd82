"""Settings of jax_smddp: every ``JAX_SMDDP_*`` environment variable.

Each setting is declared once, in the native registry
(``xla_ffi/common/settings.cc``: name, kind, default, accepted values,
meaning), and parsed by one strict parser that the engine and this module
share. ``jax_smddp.settings()`` lists them with their values here;
``python -m jax_smddp.doctor --settings`` prints the table of docs/settings.md.
The test-only settings (fault injection, the mock CUDA runtime, the GPU test
harness) are a registry of their own (``xla_ffi/common/test_settings.cc``,
test_specs()), left out of both and read, validated and defaulted as the rest.

Every ``JAX_SMDDP_*`` variable of the environment is checked (validate()) at
import, by ``python -m jax_smddp.doctor``, and again when a collective is
lowered or ``jax_smddp.initialize()`` runs: a bad value raises ValueError naming
the setting and what it accepts (at import it is only logged, so the doctor can
still show it); a name that is not a setting (a typo) is logged once at WARNING
level.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os

from jax_smddp import _native

log = logging.getLogger("jax_smddp")


def specs() -> list[dict]:
  """Every declaration a user may set: name, kind, default, min, max, choices, scope,
  agree, meaning."""
  return [dict(s) for s in _specs()]


def test_specs() -> list[dict]:
  """The test-only declarations, as specs(): what tests and test probes set, never a user."""
  return [dict(s) for s in _test_specs()]


@functools.cache
def _specs() -> tuple:
  return tuple(_native.engine().setting_specs())


@functools.cache
def _test_specs() -> tuple:
  return tuple(_native.engine().setting_specs(tests=True))


def parse(name: str, text: str | None):
  """`text` as a value of setting `name`, typed as the engine reads it (int for
  counts and bytes, float for seconds, list for lists, str otherwise; None when
  None or empty); raises ValueError naming the setting and what it accepts."""
  if text is None or text.strip() == "":
    return None
  return _native.engine().parse_setting(name, text)


def get(name: str):
  """The value of setting `name` from the environment, typed as by parse(), or
  None when unset (see value() for the value in effect)."""
  return parse(name, os.environ.get(name))


def default(name: str):
  """The registry's default of setting `name`, typed as by parse(): the one place a
  default is stated (xla_ffi/common/settings.cc). None where the registry says
  "unset"; a default stated as a description ("cores - 1") raises ValueError, and a
  text setting's default is the registry's text."""
  spec = next((s for s in _specs() + _test_specs() if s["name"] == name), None)
  if spec is None:
    raise ValueError(f"jax_smddp: {name} is not a setting")
  if spec["default"].startswith("unset"):
    return None
  return parse(name, spec["default"])


def value(name: str):
  """The value of setting `name` in effect: the environment's (get()), else the
  registry's default (default())."""
  v = get(name)
  return default(name) if v is None else v


def settings() -> dict[str, dict]:
  """Every setting a user may set (not the test-only ones): its value here (None:
  unset), default, kind, accepted values and meaning."""
  out = {}
  for s in specs():
    try:
      value = get(s["name"])
    except ValueError as e:
      value = f"<invalid: {e}>"
    out[s["name"]] = {"value": value, **{k: v for k, v in s.items() if k != "name"}}
  return out


def non_default() -> dict[str, str]:
  """The settings of this process that differ from their defaults: {name: value}, the
  environment's text for each JAX_SMDDP_* setting set to something other than its
  default (a value equal to a numeric or choice default, e.g. JAX_SMDDP_HIERARCHICAL=1, is
  left out), and the deadline where jax_smddp.set_timeout() changed it; test-only settings
  too (a mock node's copy rate changes the figures). What a run's summary prints, so that
  its figures say under which settings they were measured."""
  out = {}
  for s in specs() + test_specs():
    text = os.environ.get(s["name"])
    if text is None or text.strip() == "":
      continue
    try:
      same = parse(s["name"], text) == parse(s["name"], s["default"])
    except ValueError:  # a default that is a description ("cores - 1"), or a bad value
      same = False
    if not same:
      out[s["name"]] = text
  if "JAX_SMDDP_TIMEOUT_S" not in out and timeout() != value("JAX_SMDDP_TIMEOUT_S"):
    out["JAX_SMDDP_TIMEOUT_S"] = f"{timeout():g} (jax_smddp.set_timeout)"
  return out


def format_non_default() -> str:
  """non_default() as one line: "jax_smddp settings: NAME=value, ..." (or "defaults")."""
  changed = non_default()
  return "jax_smddp settings: " + (", ".join(f"{k}={v}" for k, v in changed.items())
                                   if changed else "all defaults")


_warned_unknown: set = set()


def validate() -> None:
  """Raises ValueError for the first invalid JAX_SMDDP_* value; warns once
  about each name that is not a setting."""
  unknown, error = _native.engine().check_settings()
  names = [s["name"] for s in _specs() + _test_specs()]
  for name in unknown:
    if name in _warned_unknown:
      continue
    _warned_unknown.add(name)
    near = difflib.get_close_matches(name, names, n=1)
    log.warning("jax_smddp: %s is not a jax_smddp setting and is ignored%s", name,
                f" (did you mean {near[0]}?)" if near else "")
  if error:
    raise ValueError(error)


def _accepts(s: dict) -> str:
  def num(v):
    return "any" if v >= 1e18 else (f"{int(v)}" if float(v).is_integer() else f"{v:g}")
  kind = s["kind"]
  if kind in ("int", "bytes", "seconds"):
    unit = {"int": "integer", "bytes": "bytes (K, M, G allowed)", "seconds": "seconds"}[kind]
    return f"{unit}, {num(s['min'])} to {num(s['max'])}"
  if kind == "choice":
    return " \\| ".join(f"`{c}`" for c in s["choices"].split("|"))
  if kind == "list":
    return "comma list of " + ", ".join(f"`{c}`" for c in s["choices"].split("|"))
  return "text"


def markdown(tests: bool = False) -> str:
  """The settings table of docs/settings.md, generated from the registry; tests=True:
  the test-only registry's, for the tests section of docs/architecture.md."""
  lines = ["| setting | default | accepts | read by | meaning |", "|---|---|---|---|---|"]
  for s in test_specs() if tests else specs():
    agree = " Must be equal in every process." if s["agree"] else ""
    lines.append(f"| `{s['name']}` | {s['default']} | {_accepts(s)} | {s['scope']} | "
                 f"{s['meaning']}.{agree} |")
  return "\n".join(lines) + "\n"


def agreed_values() -> dict[str, str | None]:
  """This process's raw value (None: unset) of every setting that must be
  equal in every process of a job."""
  return {s["name"]: os.environ.get(s["name"]) for s in _specs() if s["agree"]}


# Read once, when JAX starts its backends: a differing value cannot be changed after.
_FIXED_AT_START = ("JAX_SMDDP_COLLECTIVES",)


def adopt(values: dict[str, str | None], source: str) -> None:
  """Makes this process's must-agree settings `values` (`source`'s, e.g.
  process 0's), saying so at WARNING level where they differed."""
  for name, value in values.items():
    mine = os.environ.get(name)
    if (mine or None) == (value or None):
      continue
    if name in _FIXED_AT_START:
      log.warning("jax_smddp: %s=%r here but %r in %s; it is read when JAX starts, so this "
                  "process keeps its own: set it alike in every process", name, mine, value, source)
      continue
    log.warning("jax_smddp: %s=%r here but %r in %s; using %s's (it must be equal in every "
                "process)", name, mine, value, source, source)
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value


def set_timeout(seconds: float) -> None:
  """Sets the deadline for every wait inside a collective, in seconds.

  When a peer does not reach a collective in time, every waiting rank fails
  with an error naming the collective, the communicator and the missing ranks.
  """
  seconds = float(seconds)
  if not seconds > 0:
    raise ValueError(f"jax_smddp.set_timeout: the timeout must be positive, got {seconds}")
  _native.engine().set_timeout(seconds)
  cuda = _native.cuda_engine()
  if cuda is not None:  # its own engine copy (the GPU network proxy's deadline)
    cuda.set_timeout(seconds)


def timeout() -> float:
  """The current deadline for waits inside a collective, in seconds."""
  return _native.engine().timeout()


try:
  validate()
  set_timeout(value("JAX_SMDDP_TIMEOUT_S"))
except ValueError as e:  # raised again at the first collective; the doctor shows it
  log.error("%s", e)
