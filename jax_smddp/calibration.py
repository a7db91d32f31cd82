"""The cost model's calibration of this machine: where it is kept, how it is
written and read, and the engine's policy it takes from this process.

:mod:`jax_smddp.cost_model` is the pure model (machines, byte counts,
predictions: no files, no engine); this module gives it this machine:
:func:`local_machine` is the calibration ``python -m jax_smddp.tools.calibrate
--calibrate`` wrote (``JAX_SMDDP_CALIBRATION``, default
``~/.cache/jax_smddp/calibration.json``), else the CPU reference preset with
this machine's core count, either way with this process's heap policy
(:func:`heap_fresh_output_bytes`). The tuner (:mod:`jax_smddp.tuning`) asks it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import replace

from jax_smddp.cost_model import CPU_REFERENCE, MMAP_THRESHOLD_MAX, Machine


def calibration_path() -> str:
  """JAX_SMDDP_CALIBRATION, else the registry's default (with ``~`` expanded)."""
  from jax_smddp import config
  name = "JAX_SMDDP_CALIBRATION"
  return config.get(name) or os.path.expanduser(config.default(name))


def save_machine(machine: Machine, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"machine": machine.to_json()}, f, indent=2, default=_json_default)
    f.write("\n")


def _json_default(x):
  if isinstance(x, float) and not math.isfinite(x):
    return "inf"
  raise TypeError(type(x))


def _definite(d):
  if isinstance(d, dict):
    return {k: _definite(v) for k, v in d.items()}
  return math.inf if d == "inf" else d


def dumps(data) -> str:
  """`data` (holding Machine.to_json() forms) as JSON text, as save_machine writes it."""
  return json.dumps(data, default=_json_default)


def machine_from_json(d: dict) -> Machine:
  """The Machine of a JSON form that save_machine or dumps wrote."""
  return Machine.from_json(_definite(d))


def load_machine(path: str) -> Machine:
  with open(path) as f:
    data = json.load(f)
  return machine_from_json(data["machine"])


def heap_fresh_output_bytes() -> int:
  """Smallest output this process's glibc maps afresh on every call: its
  largest dynamic mmap threshold, or the higher one jax_smddp sets
  (JAX_SMDDP_HEAP_REUSE_BYTES) when it does. Blocks below it may still be
  mapped afresh where a thread's arena cannot fit them; the model ignores that."""
  try:
    from jax_smddp import capabilities
    kept = int(capabilities.heap_reuse()["bytes"])
  except Exception:  # no engine (docs, tools): glibc's own policy
    kept = 0
  return max(MMAP_THRESHOLD_MAX, kept)


@functools.lru_cache(maxsize=1)
def local_machine() -> Machine:
  """This machine: the cached calibration when present and readable, else the
  CPU reference preset with this machine's core count; either way with this
  process's heap policy (heap_fresh_output_bytes)."""
  heap = heap_fresh_output_bytes()
  path = calibration_path()
  if os.path.exists(path):
    try:
      return replace(load_machine(path), fresh_output_bytes=heap)
    except Exception:  # a damaged cache must never break a program
      pass
  return replace(CPU_REFERENCE, cores=os.cpu_count() or 1, source="default",
                 fresh_output_bytes=heap)
