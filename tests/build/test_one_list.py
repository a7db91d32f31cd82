"""Each collective is described once: C++ enumerates and describes the collectives in one
table (xla_ffi/common/collective.h: the plan's kind, the world's custom-call counts, the NCCL
front end's served functions all use it), Python reads that table (jax_smddp._collectives,
through the native module's collectives()), and jax_smddp._startup.COLLECTIVES, the list start-up
keeps without importing anything native, is the table's modelled collectives in its order. No
other C++ file declares its own enumeration of them, every Python module that lists them takes
those lists, and no other Python file spells a list of them out again (as names or as FFI
targets), nor a table keyed by them but for the few that map each to something outside the
engine (TABLES), nor compares an op with a collective's name where its description says what
the comparison asks (reduces, routed, passes, the size relations): the comparisons that stay
are COMPARISONS, each with its reason."""

from __future__ import annotations

import ast
import os
import re

from jax_smddp import _collectives, _startup, cost_model, gpu, swap
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
  enum = _enum("xla_ffi/common/collective.h", "Collective", 5)
  assert list(_collectives.NAMES) == enum, _collectives.NAMES  # the table in the enum's order
  assert [_collectives.SPECS[n].kind for n in enum] == list(range(len(enum)))
  assert _startup.COLLECTIVES == _collectives.MODELLED, _startup.COLLECTIVES
  assert _startup.SWAPPABLE == _collectives.NAMES, _startup.SWAPPABLE
  text = open(os.path.join(REPO, "xla_ffi/common/collective.h")).read()
  names = re.findall(r'\{Collective::k\w+, "([a-z_]+)"', text)
  assert names == enum, names  # one description per collective, in the enumeration's order


def test_no_other_enumeration_of_the_collectives():
  """Every native file takes the one description: none outside collective.h declares
  collectives of its own or spells a collective's name (a target's name is "smddp_" and the
  description's; messages take CollectiveName)."""
  found = []
  for top in ("xla_ffi", "cuda"):
    for dirpath, _, files in os.walk(os.path.join(REPO, top)):
      for f in sorted(files):
        path = os.path.relpath(os.path.join(dirpath, f), REPO)
        if not re.search(r"\.(h|cc|cu|cuh|inc)$", f) or path == "xla_ffi/common/collective.h":
          continue
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", open(os.path.join(REPO, path)).read(), flags=re.S)
        if re.search(r"\bkAllGather\s*,\s*kReduceScatter", text):
          found.append(f"{path}: an enumeration")
        found += [f"{path}: {name}" for name in _collectives.NAMES if f'"{name}"' in text]
  assert not found, found


def test_every_python_list_is_the_one_list():
  for ops in (cost_model.OPS, core.OPS, gpu_bench.OPS):
    assert ops is _collectives.MODELLED
  assert gpu.ACROSS_HOSTS == _collectives.served_by("gpu_across_hosts")
  # The swap's list is every collective (jax.lax.ppermute's too).
  assert swap.OPS is _startup.SWAPPABLE


# Tables keyed by the collectives that map each to something outside the engine's description:
# (file, the name the table is assigned to) -> what it maps them to.
TABLES = {
    ("jax_smddp/swap/lax.py", "table"): "the jax.lax primitives the swap takes over",
    ("jax_smddp/tools/bench/core.py", "calls"): "how the benchmark calls jax_smddp and jax.lax",
    ("jax_smddp/tools/bench/nccl_tests.py", "NAMES"): "nccl-tests' names and binaries",
}


def restated_lists(root: str) -> list[str]:
  """Every tuple, list or set written in the package (outside _startup.py, _collectives.py
  and __all__) that names two or more collectives, by name or by FFI target ("smddp_<name>"),
  and every dict keyed by two or more that TABLES does not name."""
  want = set(_collectives.NAMES)
  found = []
  for dirpath, _, files in os.walk(os.path.join(root, "jax_smddp")):
    for f in sorted(files):
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, root)
      if not f.endswith(".py") or rel in (os.path.join("jax_smddp", "_startup.py"),
                                          os.path.join("jax_smddp", "_collectives.py")):
        continue
      tree = ast.parse(open(path).read(), path)
      exported = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
      tables = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and (rel, t.id) in TABLES for t in node.targets)}
      for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exported:
          elts = node.elts
        elif isinstance(node, ast.Dict) and id(node) not in tables:
          elts = node.keys
        else:
          continue
        names = {e.value.removeprefix("smddp_") for e in elts
                 if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(want & names) >= 2:
          found.append(f"{rel}:{node.lineno}")
  return found


def test_no_python_file_restates_the_list():
  found = restated_lists(REPO)
  assert not found, ("the collectives listed again (read jax_smddp._collectives: NAMES, MODELLED, "
                     "served_by, reduces, the size relations): " + ", ".join(found))


def test_the_check_finds_a_restated_list(tmp_path):
  names = ", ".join(repr(n) for n in _startup.COLLECTIVES)
  targets = ", ".join(repr("smddp_" + n) for n in _startup.COLLECTIVES)
  (tmp_path / "jax_smddp" / "tools" / "bench").mkdir(parents=True)
  (tmp_path / "jax_smddp" / "a.py").write_text(
      f"__all__ = [{names}]\nONE = ('all_gather', 'x')\n"
      f"def f(op):\n  return op in ('reduce_scatter', 'all_reduce')\n")
  (tmp_path / "jax_smddp" / "b.py").write_text(f"TARGETS = [{targets}, 'smddp_other']\n")
  (tmp_path / "jax_smddp" / "c.py").write_text(
      "BUS = {'all_gather': 1, 'all_reduce': 2}\nNAMES = {'all_gather': 1, 'all_to_all': 2}\n"
      "ONE = {'all_gather': 1, 'other': 2}\n")
  (tmp_path / "jax_smddp" / "tools" / "bench" / "nccl_tests.py").write_text(
      "NAMES = {'all_gather': 1, 'all_to_all': 2}\nREDOPS = {'all_gather': 1, 'all_reduce': 2}\n")
  (tmp_path / "jax_smddp" / "_startup.py").write_text(f"COLLECTIVES = ({names})\n")
  (tmp_path / "jax_smddp" / "_collectives.py").write_text(f"NAMES = ({names})\n")
  assert restated_lists(str(tmp_path)) == [
      "jax_smddp/a.py:4", "jax_smddp/b.py:1", "jax_smddp/c.py:1", "jax_smddp/c.py:2",
      "jax_smddp/tools/bench/nccl_tests.py:2"]


# Comparisons of a value against a collective's name that stay: what each compares for is a fact
# of that one collective that its description does not hold. (file, function) -> (the names, why).
COMPARISONS: dict[tuple[str, str], tuple[frozenset, str]] = {
    ("jax_smddp/_collective.py", "_emit_cuda_call"): (
        frozenset({"all_reduce"}), "the GPU's all_reduce across hosts of a count n does not divide "
        "runs as its own lowering"),
    ("jax_smddp/_collective.py", "_cross_process_choice"): (
        frozenset({"collective_permute"}), "a permute has no routes or chunk size for the tuner "
        "to choose (not this file's owner's change: it could read spec(op).every_peer)"),
    ("jax_smddp/cost_model.py", "nccl_predict"): (
        frozenset({"all_reduce"}), "NCCL's tuner (tuning.cc): its ring all_reduce's 2N "
        "inter-node steps, and its tree runs all_reduce only"),
    ("jax_smddp/swap/combine.py", "_lower"): (
        frozenset({"all_gather", "all_reduce"}), "which primitive's lowering a bucket is packed "
        "for"),
    ("jax_smddp/tools/bench/checks.py", "numpy_reference"): (
        frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}),
        "numpy's answer for each op: an independent reference, not derived from the description "
        "it checks"),
    ("jax_smddp/tools/bench/core.py", "build_mpi4jax_program"): (
        frozenset({"all_gather", "all_reduce", "all_to_all"}), "which mpi4jax function runs the op"),
    ("jax_smddp/tools/gpu_bench.py", "_input"): (
        frozenset({"all_to_all"}), "the GPU bench's inputs: all_to_all's blocks labelled by "
        "destination so that a misplaced block shows"),
    ("jax_smddp/tools/gpu_bench.py", "_expected"): (
        frozenset({"all_gather", "all_to_all"}), "the GPU bench's reference for those inputs, "
        "per rank in closed form (numpy_reference builds every rank's output: too large at GPU "
        "sizes)"),
}


def _compared_names(node: ast.Compare, want: set) -> set:
  """The collectives' names (or FFI targets) `node` compares against: == / != a name, a name
  in / not in anything, anything in / not in a literal tuple, list or set holding one."""
  found = set()
  lefts = [node.left] + node.comparators[:-1]
  for cmp_op, left, right in zip(node.ops, lefts, node.comparators):
    if isinstance(cmp_op, (ast.Eq, ast.NotEq)):
      elts = [left, right]
    elif isinstance(cmp_op, (ast.In, ast.NotIn)):
      elts = [left] + (right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [])
    else:
      continue
    found |= {e.value.removeprefix("smddp_") for e in elts
              if isinstance(e, ast.Constant) and isinstance(e.value, str)} & want
  return found


def name_comparisons(root: str) -> dict[tuple[str, str], set]:
  """Every comparison in the package's Python (outside _startup.py and _collectives.py) of a
  value against a collective's name: (file, the function it is in) -> the names compared."""
  want = set(_collectives.NAMES)
  found: dict[tuple[str, str], set] = {}
  for dirpath, _, files in os.walk(os.path.join(root, "jax_smddp")):
    for f in sorted(files):
      rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
      if not f.endswith(".py") or rel in ("jax_smddp/_startup.py", "jax_smddp/_collectives.py"):
        continue
      tree = ast.parse(open(os.path.join(dirpath, f)).read(), rel)

      def visit(node, where):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
          where = f"{where}.{node.name}" if where else node.name
        if isinstance(node, ast.Compare):
          names = _compared_names(node, want)
          if names:
            found.setdefault((rel, where or "<module>"), set()).update(names)
        for child in ast.iter_child_nodes(node):
          visit(child, where)

      visit(tree, "")
  return found


def test_no_python_file_branches_on_a_collectives_name():
  """What a collective is (reduces, its sizes, passes, routes) is its description's: code asks
  _collectives (reduces, spec(op).routed, output_bytes, ...), not `op == "all_gather"`. The
  comparisons that stay are COMPARISONS, each with its reason."""
  found = name_comparisons(REPO)
  new = {f"{path} {fn}: {sorted(names - COMPARISONS.get((path, fn), (frozenset(), ''))[0])}"
         for (path, fn), names in found.items()
         if names - COMPARISONS.get((path, fn), (frozenset(), ""))[0]}
  assert not new, ("a collective's name compared (read jax_smddp._collectives: reduces, "
                   "spec(op).routed, .passes, output_bytes, ...; or, for a fact of one collective "
                   "that no description holds, add it to COMPARISONS with the reason): "
                   + ", ".join(sorted(new)))
  stale = sorted(f"{path} {fn}" for (path, fn), (names, _) in COMPARISONS.items()
                 if not names <= found.get((path, fn), set()))
  assert not stale, f"COMPARISONS names comparisons the code no longer makes: {stale}"


def test_the_check_finds_a_comparison(tmp_path):
  (tmp_path / "jax_smddp" / "tools").mkdir(parents=True)
  (tmp_path / "jax_smddp" / "a.py").write_text(
      "def f(op):\n  if op == 'all_gather':\n    return 1\n  return op != 'sum'\n"
      "class C:\n  def g(self, op):\n    return op not in ('x', 'reduce_scatter')\n"
      "X = 'smddp_all_to_all' == TARGET\n")
  (tmp_path / "jax_smddp" / "tools" / "b.py").write_text(
      "def h(op):\n  return op in ['all_reduce'] or op < 'all_gather' or op == OTHER\n"
      "def k(ops):\n  return 'collective_permute' not in ops or 'all_gather' < 'x' in ops\n")
  (tmp_path / "jax_smddp" / "_collectives.py").write_text("def f(op):\n  return op == 'all_gather'\n")
  (tmp_path / "jax_smddp" / "_startup.py").write_text("def f(op):\n  return op == 'all_gather'\n")
  assert name_comparisons(str(tmp_path)) == {
      ("jax_smddp/a.py", "f"): {"all_gather"}, ("jax_smddp/a.py", "C.g"): {"reduce_scatter"},
      ("jax_smddp/a.py", "<module>"): {"all_to_all"}, ("jax_smddp/tools/b.py", "h"): {"all_reduce"},
      ("jax_smddp/tools/b.py", "k"): {"collective_permute"}}
