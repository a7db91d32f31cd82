"""No import circle in jax_smddp/, imports inside functions included.

The graph is built from the package's sources (their ASTs, nothing is imported): a module
imports another by `import a.b`, `from a import b` (the submodule a.b where b is one, else the
module a), relative imports resolved, and `importlib.import_module("a.b")` with a literal
name. Every import counts, at module level or inside a function: a circle of imports deferred
into functions still ties its modules together (neither can be read, tested or moved without
the other) and fails at import time as soon as one is hoisted. A circle is broken by moving the
shared piece down a floor, into a module both import (docs/architecture.md); the native
extensions (CMakeLists.txt's nanobind modules) import nothing of the package.
"""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "jax_smddp"


def modules(root: str) -> dict[str, tuple[str, bool]]:
  """{dotted name: (path, is a package)} of every .py file under root/jax_smddp."""
  found = {}
  for dirpath, dirs, files in os.walk(os.path.join(root, PACKAGE)):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
        package = rel.endswith(".__init__")
        found[rel[:-len(".__init__")] if package else rel] = (os.path.join(dirpath, f), package)
  return found


def native_modules(root: str) -> set[str]:
  path = os.path.join(root, "CMakeLists.txt")
  text = open(path).read() if os.path.exists(path) else ""
  return set(re.findall(r"nanobind_add_module\((\w+)", text))


def imports(root: str) -> dict[str, dict[str, str]]:
  """{module: {module it imports: 'path:line' of the first such import}}, within the package."""
  mods = modules(root)
  native = native_modules(root)

  def known(name: str) -> str:  # the module `name` lies in (a.b.C -> a.b)
    while name not in mods:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for name, (path, package) in mods.items():
    base = name if package else name.rpartition(".")[0]
    out: dict[str, str] = {}

    def add(target: str, node) -> None:
      out.setdefault(target, f"{os.path.relpath(path, root)}:{node.lineno}")

    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.split(".")[0] == PACKAGE:
            add(known(alias.name), node)
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          parts = base.split(".")[:len(base.split(".")) - (node.level - 1)]
          source = ".".join(parts + ([node.module] if node.module else []))
        else:
          source = node.module or ""
        if source.split(".")[0] != PACKAGE:
          continue
        for alias in node.names:
          if source == PACKAGE and alias.name in native:
            continue  # a native extension: imports nothing back
          sub = f"{source}.{alias.name}"
          add(sub if sub in mods else known(source), node)
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == PACKAGE):
        add(known(node.args[0].value), node)
    out.pop(name, None)
    graph[name] = out
  return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
  """One circle of each strongly connected group of modules (Tarjan), as [a, b, ..., a]."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  groups: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  found = []
  for group in groups:  # a shortest way back to the group's first module
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier and start not in [w for v in frontier for w in graph[v]]:
      nxt = []
      for v in frontier:
        for w in sorted(graph[v]):
          if w in members and w not in paths:
            paths[w] = paths[v] + [w]
            nxt.append(w)
      frontier = nxt
    last = next(v for v in frontier if start in graph[v])
    found.append(paths[last] + [start])
  return found


def describe(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
  return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_no_import_circle_in_the_package():
  graph = imports(REPO)
  found = cycles(graph)
  assert not found, ("import circles in jax_smddp/ (break each by moving the shared piece into a "
                     "module both import, not by importing inside a function):\n"
                     + "\n\n".join(describe(graph, c) for c in found))


def test_the_graph_sees_the_package():
  # A graph that missed the package's imports would make the check vacuous.
  graph = imports(REPO)
  assert len(graph) > 40, sorted(graph)
  assert "jax_smddp._collective" in graph["jax_smddp.all_gather"]
  assert "jax_smddp.swap.lax" in graph["jax_smddp.swap"]  # an absolute import in a package
  assert "jax_smddp.tools.bench.core" in graph["jax_smddp.tools.bench"]
  assert "jax_smddp.all_reduce" in graph["jax_smddp.swap.lax"]  # importlib.import_module
  assert "jax_smddp.distributed" in graph["jax_smddp._collective"]  # inside a function


def test_the_check_names_a_planted_circle(tmp_path):
  # A package where a imports b at module level and b imports a inside a function (relative
  # and `from pkg import sub` spellings), c imports d.e by importlib, and d.e imports c back.
  def write(rel: str, text: str) -> None:
    p = tmp_path / PACKAGE / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
  write("__init__.py", "from jax_smddp import _ext\n")
  write("a.py", "from . import b\n")
  write("b.py", "def f():\n  from jax_smddp import a\n  return a\n")
  write("c.py", "import importlib\nd = importlib.import_module('jax_smddp.d.e')\n")
  write("d/__init__.py", "")
  write("d/e.py", "from ..c import d\n")
  write("f.py", "import jax_smddp.a\nfrom jax_smddp import b\n")  # into a circle, not part of one
  (tmp_path / "CMakeLists.txt").write_text("nanobind_add_module(_ext NB_STATIC x.cc)\n")
  graph = imports(str(tmp_path))
  found = sorted(cycles(graph))
  assert found == [["jax_smddp.a", "jax_smddp.b", "jax_smddp.a"],
                   ["jax_smddp.c", "jax_smddp.d.e", "jax_smddp.c"]], found
  assert "jax_smddp/b.py:2" in describe(graph, found[0]), describe(graph, found[0])
