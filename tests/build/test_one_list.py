"""Python's one list of the collectives (jax_smddp._startup.COLLECTIVES) is the engine's: C++
enumerates and names the collectives once (xla_ffi/common/collective.h: the plan's kind, the
world's custom-call counts, the NCCL front end's served functions all use it), its names in
the enumeration's order begin with Python's four (collective_permute after them), no other
C++ file declares its own enumeration of them, every Python module that lists them takes
that list, and no other Python file spells the list out again (as names or as FFI targets)."""

from __future__ import annotations

import ast
import os
import re

from jax_smddp import _startup, cost_model, gpu, swap
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
  for ops in (cost_model.OPS, core.OPS, gpu_bench.OPS, gpu.ACROSS_HOSTS):
    assert ops is _startup.COLLECTIVES
  # The swap's list is the one list and the permute (jax.lax.ppermute's).
  assert swap.OPS is _startup.SWAPPABLE
  assert _startup.SWAPPABLE == _startup.COLLECTIVES + ("collective_permute",)


def restated_lists(root: str) -> list[str]:
  """Every tuple, list or set written in the package (outside _startup.py, and __all__) that
  names every collective of the one list, by name or by FFI target ("smddp_<name>")."""
  want = set(_startup.COLLECTIVES)
  found = []
  for dirpath, _, files in os.walk(os.path.join(root, "jax_smddp")):
    for f in sorted(files):
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, root)
      if not f.endswith(".py") or rel == os.path.join("jax_smddp", "_startup.py"):
        continue
      tree = ast.parse(open(path).read(), path)
      exported = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
      for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exported:
          names = {e.value.removeprefix("smddp_") for e in node.elts
                   if isinstance(e, ast.Constant) and isinstance(e.value, str)}
          if want <= names:
            found.append(f"{rel}:{node.lineno}")
  return found


def test_no_python_file_restates_the_list():
  found = restated_lists(REPO)
  assert not found, ("the collectives listed again (take jax_smddp._startup.COLLECTIVES, or "
                     "SWAPPABLE with collective_permute): " + ", ".join(found))


def test_the_check_finds_a_restated_list(tmp_path):
  names = ", ".join(repr(n) for n in _startup.COLLECTIVES)
  targets = ", ".join(repr("smddp_" + n) for n in _startup.COLLECTIVES)
  (tmp_path / "jax_smddp").mkdir()
  (tmp_path / "jax_smddp" / "a.py").write_text(
      f"__all__ = [{names}]\nSUBSET = ({names.rsplit(', ', 1)[0]})\n"
      f"def f(op):\n  return op in ({names})\n")
  (tmp_path / "jax_smddp" / "b.py").write_text(f"TARGETS = [{targets}, 'smddp_other']\n")
  (tmp_path / "jax_smddp" / "_startup.py").write_text(f"COLLECTIVES = ({names})\n")
  assert restated_lists(str(tmp_path)) == ["jax_smddp/a.py:4", "jax_smddp/b.py:1"]
