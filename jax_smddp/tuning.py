"""Algorithm and chunk-size choice per (op, size, layout), from the cost model.

The engine asks :func:`choose` at lowering time (one answer per distinct
(op, bytes, layout), cached). Within one process there is one algorithm
(``in_process``: ranks share memory). Across processes the choice is
``flat`` (every process exchanges with every other directly) or
``hierarchical`` (rail routes: each byte crosses the network once per host,
relayed over shared memory; only with >= 2 hosts of >= 2 processes each), and
the message chunk (pipelining granularity). The model is
:func:`jax_smddp.calibration.local_machine`: this machine's calibration
(``python -m jax_smddp.tools.calibrate --calibrate``, cached in
``~/.cache/jax_smddp/calibration.json``) when present, else defaults.

Environment overrides (the reason then says "forced by ..."):

* ``JAX_SMDDP_ALGORITHM`` = ``flat`` | ``hierarchical`` (hierarchical falls back
  to flat where it is not valid, and says so);
* ``JAX_SMDDP_CHUNK_BYTES`` = bytes (rounded up to a multiple of 64, at least
  4096).

Every choice is logged once at debug level on the ``jax_smddp`` logger.

In a multi-process job the choice must be the same in every process (the
engine checks that processes agree on each call's routes and chunk), so the
tuner's inputs are the job's, not each process's: ``jax_smddp.initialize()``
publishes process 0's machine model and overrides through the jax.distributed
key-value store (:func:`local_inputs`) and every process uses them
(:func:`set_job_inputs`), whatever its own calibration file or environment.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os

from jax_smddp import _collectives
from jax_smddp import calibration
from jax_smddp import config
from jax_smddp import cost_model
from jax_smddp.cost_model import Layout  # noqa: F401  (part of this module's interface)

log = logging.getLogger("jax_smddp")

OPS = cost_model.OPS
MIN_CHUNK_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Choice:
  algorithm: str    # "in_process" (one process), "flat" or "hierarchical" (across processes)
  chunk_bytes: int  # message chunk for cross-process algorithms (multiple of 64, >= 4096)
  reason: str       # short text for debug logs


def _round_chunk(nbytes: int) -> int:
  return max(MIN_CHUNK_BYTES, (int(nbytes) + 63) // 64 * 64)


# What the tuner decides from: the machine model and the two overrides, parsed.
# None: this process's own (one process); set by initialize() in a
# multi-process job.
_job_inputs: tuple | None = None  # (Machine, forced algorithm or None, forced chunk or None)

_OVERRIDES = ("JAX_SMDDP_ALGORITHM", "JAX_SMDDP_CHUNK_BYTES")


def local_inputs() -> str:
  """This process's tuner inputs, as JSON (what process 0 publishes)."""
  machine = calibration.local_machine()
  return calibration.dumps({"machine": machine.to_json(),
                            "overrides": [os.environ.get(k) for k in _OVERRIDES]})


def set_job_inputs(inputs: str | None) -> None:
  """Decides from `inputs` (local_inputs() of process 0) from now on; None:
  from this process's own again."""
  global _job_inputs
  if inputs is None:
    _job_inputs = None
  else:
    data = json.loads(inputs)
    machine = calibration.machine_from_json(data["machine"])
    _job_inputs = (machine, *_overrides(*data["overrides"]))
  _choose.cache_clear()


def _overrides(algorithm: str | None, chunk_bytes: str | None) -> tuple:
  """JAX_SMDDP_ALGORITHM and JAX_SMDDP_CHUNK_BYTES (rounded as the engine
  rounds it) from their raw values; a bad value raises, naming the setting."""
  chunk = config.parse("JAX_SMDDP_CHUNK_BYTES", chunk_bytes)
  return (config.parse("JAX_SMDDP_ALGORITHM", algorithm),
          None if chunk is None else _round_chunk(chunk))


def _inputs() -> tuple:
  if _job_inputs is not None:
    return _job_inputs
  return (calibration.local_machine(), *_overrides(*(os.environ.get(k) for k in _OVERRIDES)))


def _us(seconds: float) -> str:
  return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _valid_layout(layout) -> Layout:
  h, p, d = (int(layout.hosts), int(layout.processes_per_host), int(layout.devices_per_process))
  return Layout(max(1, h), max(1, p), max(1, d))


def choose(op: str, bytes_per_rank: int, layout) -> Choice:
  """The algorithm and chunk for one call; never raises for valid input (an
  unexpected failure of the model falls back to the engine's defaults)."""
  layout = _valid_layout(layout)
  # A bad override raises here (_inputs), not swallowed with the model's failures below.
  return _choose(op, max(0, int(bytes_per_rank)), layout, _inputs())


@functools.lru_cache(maxsize=4096)
def _choose(op: str, nbytes: int, layout: Layout, inputs: tuple) -> Choice:
  try:
    choice = _decide(op, nbytes, layout, *inputs)
  except Exception as e:  # never break lowering
    algo = cost_model.default_algorithm(layout, op)
    choice = Choice(algo, cost_model.DEFAULT_CHUNK_BYTES,
                    f"default (model failed: {type(e).__name__}: {e})")
  log.debug("jax_smddp tuning: %s %d bytes/rank on %s -> %s, chunk %d (%s)", op, nbytes,
            layout.spec, choice.algorithm, choice.chunk_bytes, choice.reason)
  return choice


def _decide(op: str, nbytes: int, layout: Layout, machine, forced_algo: str | None,
            forced_chunk: int | None) -> Choice:
  if op not in OPS:
    raise ValueError(f"unknown op {op!r}")
  if layout.processes == 1:
    return Choice("in_process", forced_chunk or cost_model.DEFAULT_CHUNK_BYTES,
                  "one process: ranks share memory")
  routed = _collectives.spec(op).routed
  valid = cost_model.hierarchical_valid(layout) and routed
  if forced_algo:
    algo = forced_algo
    reason = f"forced by JAX_SMDDP_ALGORITHM={forced_algo}"
    if algo == "hierarchical" and not valid:
      algo = "flat"
      reason += (f" ({op} is always direct; flat)" if not routed else
                 " (not valid here: needs >= 2 hosts with >= 2 processes each; flat)")
    if forced_chunk:
      chunk = forced_chunk
      reason += f", chunk forced by JAX_SMDDP_CHUNK_BYTES={forced_chunk}"
    else:
      top, _ = cost_model.best(op, nbytes, layout, machine, algorithms=[algo])
      chunk = _round_chunk(top.chunk_bytes)
      reason += f", chunk by model ({_us(top.time_s)})"
    return Choice(algo, chunk, reason)
  algos = ["flat", "hierarchical"] if valid else ["flat"]
  if forced_chunk:
    preds = {a: cost_model.predict(op, nbytes, layout, machine, a, forced_chunk) for a in algos}
    default = cost_model.default_algorithm(layout, op)
    algo = min(preds, key=lambda a: preds[a].time_s)
    if default in preds and preds[algo].time_s >= 0.97 * preds[default].time_s:
      algo = default
    reason = (f"chunk forced by JAX_SMDDP_CHUNK_BYTES={forced_chunk}; model: " +
              " vs ".join(f"{a} {_us(p.time_s)}" for a, p in sorted(preds.items(),
                                                                   key=lambda kv: kv[0] != algo)))
    return Choice(algo, forced_chunk, reason)
  top, cands = cost_model.best(op, nbytes, layout, machine, algorithms=algos)
  others = {}
  for c in cands:
    if c.algorithm != top.algorithm and (c.algorithm not in others or
                                         c.time_s < others[c.algorithm].time_s):
      others[c.algorithm] = c
  reason = f"model ({machine.name}): {top.algorithm} {_us(top.time_s)}" + "".join(
      f" vs {a} {_us(p.time_s)}" for a, p in sorted(others.items()))
  return Choice(top.algorithm, _round_chunk(top.chunk_bytes), reason)


def clear_cache() -> None:
  """Forgets cached choices and the loaded calibration (after recalibrating)."""
  _choose.cache_clear()
  calibration.local_machine.cache_clear()
