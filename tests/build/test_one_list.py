"""Python's one list of the collectives (jax_smddp._startup.COLLECTIVES) is the engine's: C++
enumerates and names the collectives once (xla_ffi/common/collective.h: the plan's kind, the
world's custom-call counts, the NCCL front end's served functions all use it), its names in
the enumeration's order begin with Python's four (collective_permute after them), no other
C++ file declares its own enumeration of them, and every Python module that lists them takes
that list."""

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


def test_the_engines_enumeration_is_pythons_list():
  want = list(_startup.COLLECTIVES)
  enum = _enum("xla_ffi/common/collective.h", "Collective", 5)
  assert enum[:4] == want and enum[4] == "collective_permute", enum
  text = open(os.path.join(REPO, "xla_ffi/common/collective.h")).read()
  names = re.findall(r'"([a-z_]+)"', text[text.index("kNames[kCollectives]"):])[:5]
  assert names == enum, names  # CollectiveName's table in the enumeration's order


def test_no_other_enumeration_of_the_collectives():
  """The plan, the world's counts and the NCCL front end take the one enumeration: none of
  their files declares collectives of its own or spells a collective's name."""
  for path in ("xla_ffi/algorithms/plan.h", "xla_ffi/transports/world.h",
               "cuda/ncclapi/nccl_calls.h", "cuda/ncclapi/nccl_calls.cc",
               "xla_ffi/ffi/call_counts.h", "xla_ffi/ffi/cpu_handlers.cc",
               "xla_ffi/ffi/gpu_handlers.cc", "xla_ffi/bindings/enums.h"):
    text = re.sub(r"//[^\n]*", "", open(os.path.join(REPO, path)).read())
    assert not re.search(r"\bkAllGather\s*,\s*kReduceScatter", text), path
    for name in _startup.COLLECTIVES + ("collective_permute",):
      assert f'"{name}"' not in text, (path, name)


def test_every_python_list_is_the_one_list():
  for ops in (swap.OPS, cost_model.OPS, core.OPS, gpu_bench.OPS):
    assert ops is _startup.COLLECTIVES
