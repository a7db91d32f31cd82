"""jax's private modules (``jax._src``) are reached through one module, jax_smddp/_jax_internals.py.

A jax release may move any internal without notice. This test fails (a) when a module of jax_smddp/
other than the shim names ``jax._src`` (imports at module level or in functions, ``jax._src``
attributes, importlib's literal names), naming the file and line; (b) when an internal the shim
lists is missing from the installed jax: the shim's error names the internal, the installed jax
and the versions it was checked against (a moved internal is simulated through sys.modules).
"""

from __future__ import annotations

import ast
import os
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM = "jax_smddp._jax_internals"
SHIMS = {"jax_smddp/_jax_internals.py"}  # at most two (issue 68)
IMPORTERS = {"import_module", "__import__", "find_spec"}

pytestmark = pytest.mark.timeout(120)


def _private(name: str | None) -> bool:
  return bool(name) and (name == "jax._src" or name.startswith("jax._src."))


def jax_src_uses(source: str, path: str = "<source>") -> list[str]:
  """'path:line: what' for every place `source` names jax._src."""
  found = []
  for node in ast.walk(ast.parse(source, path)):
    what = None
    if isinstance(node, ast.ImportFrom) and not node.level:
      if _private(node.module) or (node.module == "jax" and any(a.name == "_src" for a in node.names)):
        what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names if _private(a.name)]
      what = f"import {', '.join(names)}" if names else None
    elif (isinstance(node, ast.Attribute) and node.attr == "_src" and isinstance(node.value, ast.Name)
          and node.value.id == "jax"):
      what = "jax._src"
    elif isinstance(node, ast.Call) and node.args:
      fn = node.func
      called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
      arg = node.args[0]
      if (called in IMPORTERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str)
          and _private(arg.value)):
        what = f"{called}({arg.value!r})"
    if what:
      found.append(f"{path}:{node.lineno}: {what}")
  return found


def package_files() -> list[str]:
  out = []
  for dirpath, dirs, files in os.walk(os.path.join(REPO, "jax_smddp")):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    out += [os.path.relpath(os.path.join(dirpath, f), REPO) for f in files if f.endswith(".py")]
  return sorted(out)


def test_the_detector_finds_every_form():
  source = ("import jax._src.core\nfrom jax._src import core\nfrom jax import _src\n"
            "def f():\n  from jax._src.lax import parallel\n  import importlib\n"
            "  importlib.import_module('jax._src.pjit')\n  __import__('jax._src.xla_bridge')\n"
            "  return jax._src\n"
            "from jax import lax\nimport jax.extend\nfrom . import _src\n")
  assert [u.split(": ", 1)[0] for u in jax_src_uses(source)] == [f"<source>:{n}" for n in (1, 2, 3, 5, 7, 8, 9)]


def test_only_the_shim_names_jax_src():
  uses = []
  for path in package_files():
    if path.replace(os.sep, "/") not in SHIMS:
      uses += jax_src_uses(open(os.path.join(REPO, path)).read(), path)
  assert not uses, (
      "these modules name jax's private modules directly; import the internal from "
      "jax_smddp/_jax_internals.py instead (add it to its INTERNALS, with what it is for), or use "
      "jax's public API where one exists:\n  " + "\n  ".join(uses))


def test_the_shim_imports_nothing_of_jax_smddp():
  assert len(SHIMS) <= 2
  for path in SHIMS:
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read(), path)):
      names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
               [a.name for a in node.names] if isinstance(node, ast.Import) else [])
      assert not any(n.startswith("jax_smddp") or getattr(node, "level", 0) for n in names), (
          f"{path}:{node.lineno} imports jax_smddp: the shim sits below every module of the package")


def test_every_name_taken_from_the_shim_is_listed_and_every_listed_one_used():
  from jax_smddp import _jax_internals as shim
  taken = {}
  for path in package_files():
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read(), path)):
      if isinstance(node, ast.ImportFrom) and node.module == SHIM:
        for a in node.names:
          taken.setdefault(a.name, f"{path}:{node.lineno}")
  unknown = {n: where for n, where in taken.items() if n not in shim.INTERNALS}
  assert not unknown, f"imported from the shim but not in its INTERNALS: {unknown}"
  unused = set(shim.INTERNALS) - set(taken)
  assert not unused, f"INTERNALS lists {sorted(unused)}, which no module of jax_smddp imports: remove them"


@pytest.mark.parametrize("name", sorted(__import__(SHIM, fromlist=["INTERNALS"]).INTERNALS))
def test_each_internal_resolves_in_the_installed_jax(name):
  from jax_smddp import _jax_internals as shim
  obj = shim.resolve(name)  # raises JaxInternalMoved, naming the internal, when this jax lacks it
  spec = shim.INTERNALS[name]
  module = sys.modules[spec.module]
  assert obj is (module if spec.attr is None else getattr(module, spec.attr))
  assert getattr(shim, name) is obj


def _assert_says(err: Exception, internal: str):
  import jax

  from jax_smddp import _jax_internals as shim
  text = str(err)
  assert internal in text, text
  assert f"jax {jax.__version__}" in text, text
  for version in shim.CHECKED:
    assert version in text, text


def test_a_moved_attribute_is_named_with_the_versions(monkeypatch):
  from jax_smddp import _jax_internals as shim
  real = sys.modules["jax._src.xla_bridge"]
  moved = types.ModuleType(real.__name__)
  moved.__dict__.update({k: v for k, v in vars(real).items() if k != "_backend_factories"})
  monkeypatch.setitem(sys.modules, real.__name__, moved)
  monkeypatch.delitem(vars(shim), "xla_bridge", raising=False)  # resolved afresh on the next import
  with pytest.raises(ImportError) as err:
    from jax_smddp._jax_internals import xla_bridge  # noqa: F401
  assert isinstance(err.value, shim.JaxInternalMoved)
  _assert_says(err.value, "jax._src.xla_bridge._backend_factories")


def test_a_moved_module_is_named_with_the_versions(monkeypatch):
  from jax_smddp import _jax_internals as shim
  monkeypatch.setitem(sys.modules, "jax._src.pjit", None)  # as if a release had removed it
  with pytest.raises(shim.JaxInternalMoved) as err:
    shim.resolve("pjit")
  _assert_says(err.value, "jax._src.pjit")
