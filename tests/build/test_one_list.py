"""Python's one list of the collectives (jax_smddp._startup.COLLECTIVES) is the engine's: the
C++ enumerations of the collectives (the plan's kinds, the world's callers of custom calls,
the NCCL front end's collectives) name the same four in the same order, and every Python
module that lists them takes that list."""

from __future__ import annotations

import os
import re

from jax_smddp import _startup, cost_model, swap
from jax_smddp.tools import gpu_bench
from jax_smddp.tools.bench import core

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _enum(path: str, name: str, count: int) -> list[str]:
  text = open(os.path.join(REPO, path)).read()
  body = re.search(rf"enum class {name}\b[^{{]*{{([^}}]*)}}", text).group(1)
  body = re.sub(r"//[^\n]*", "", body)
  members = [m.strip() for m in body.split(",") if m.strip()][:count]
  return [re.sub(r"(?<!^)(?=[A-Z])", "_", m[1:]).lower() for m in members]  # kAllGather -> all_gather


def test_the_engines_enumerations_are_pythons_list():
  want = list(_startup.COLLECTIVES)
  assert _enum("xla_ffi/algorithms/plan.h", "Kind", 4) == want
  assert _enum("xla_ffi/transports/world.h", "Caller", 4) == want
  assert _enum("cuda/ncclapi/nccl_calls.h", "Collective", 4) == want


def test_every_python_list_is_the_one_list():
  for ops in (swap.OPS, cost_model.OPS, core.OPS, gpu_bench.OPS):
    assert ops is _startup.COLLECTIVES
