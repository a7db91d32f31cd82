"""Each collective described once: the engine's table (xla_ffi/common/collective.h, read through
the native module's ``collectives()``), with the arithmetic Python derives from it. Every Python
table of the collectives (the swap, the cost model, the benchmarks, calibration) reads this
module, or ``jax_smddp._startup.COLLECTIVES`` where it must import nothing native
(tests/build/test_one_list.py checks both against the engine's).

For n ranks each with S input bytes: a rank's output is S n^out_power bytes; a block (what one
rank sends one other rank) S n^block_power; the data crosses the group ``passes`` times, between
every pair of ranks (``every_peer``) or along a permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_smddp._native import _smddp_cpu


@dataclass(frozen=True)
class Collective:
  """One collective's description (the fields of C++'s CollectiveSpec)."""
  name: str
  kind: int               # the engine's enumeration (Plan::kind)
  reduces: bool           # a reduction (sum, max, min) combines the ranks' values
  out_power: int          # output bytes = input bytes x n^out_power
  block_power: int        # a block = input bytes x n^block_power
  passes: int             # 2 for all_reduce (reduce-scatter, then all-gather)
  every_peer: bool        # every rank sends every other (else one peer: a permutation)
  routed: bool            # hierarchical routes and rings apply (else always a direct exchange)
  modelled: bool          # the cost model and the benchmarks cover it
  substrates: frozenset   # the engine families that run it ("in_process", "nccl_api", ...)
  plan_size: str          # how a plan sizes it: "byte_blocks", "element_blocks", "elements"


def _read() -> dict[str, Collective]:
  out = {}
  for d in _smddp_cpu.collectives():
    out[d["name"]] = Collective(**{**d, "substrates": frozenset(d["substrates"])})
  return out


SPECS: dict[str, Collective] = _read()
NAMES: tuple[str, ...] = tuple(SPECS)  # every collective, in the engine's order
MODELLED: tuple[str, ...] = tuple(n for n in NAMES if SPECS[n].modelled)


def spec(op: str) -> Collective:
  """`op`'s description; ValueError naming the known ones for any other name."""
  try:
    return SPECS[op]
  except KeyError:
    raise ValueError(f"unknown op {op!r}; one of {', '.join(NAMES)}") from None


def served_by(substrate: str) -> tuple[str, ...]:
  """The collectives the engine family `substrate` runs, in the engine's order."""
  return tuple(n for n in NAMES if substrate in SPECS[n].substrates)


def reduces(op: str) -> bool:
  return spec(op).reduces


def _scale(nbytes, power: int, n: int):
  return nbytes * n if power > 0 else nbytes // n if power < 0 else nbytes


def output_bytes(op: str, input_bytes: int, n: int) -> int:
  """One rank's output bytes over n ranks, given its input bytes."""
  return _scale(input_bytes, spec(op).out_power, n)


def input_bytes(op: str, output_bytes: int, n: int) -> int:
  """One rank's input bytes over n ranks, given its output bytes."""
  return _scale(output_bytes, -spec(op).out_power, n)


def block_bytes(op: str, input_bytes: int, n: int) -> int:
  """What one rank sends one other rank over n ranks, given its input bytes."""
  return _scale(input_bytes, spec(op).block_power, n)


def largest_bytes(op: str, input_bytes: int, n: int) -> int:
  """The larger of one rank's input and output (nccl-tests' size S of the call)."""
  return max(input_bytes, output_bytes(op, input_bytes, n))


def bus_factor(op: str, n: int) -> float:
  """nccl-tests' busbw / algbw over n ranks: each pass moves (n-1)/n of the data
  between every pair of ranks (1 along a permutation; 0 for one rank)."""
  if n < 1:
    raise ValueError(f"{n} ranks: a collective needs at least 1")
  s = spec(op)
  return s.passes * (n - 1) / n if s.every_peer else 1.0
