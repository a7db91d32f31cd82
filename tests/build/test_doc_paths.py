"""Docs that cannot go stale: every repository path and every jax_smddp name the
docs and the source comments give must exist.

Where: README.md and docs/*.md (all their text), and the comments of the sources
(C++ `//` and `/* */` comments under xla_ffi/, cuda/ and tests/; Python `#`
comments and docstrings under jax_smddp/, tests/, scripts/ and examples/; shell
`#` comment lines). Code is left out: its strings are keys and templates, not
references (e.g. the key-value store's "jax_smddp/gpu/rail/0").

What counts as a path: a token that starts with one of the checkout's top-level
folders and a slash (`xla_ffi/`, `cuda/`, `jax_smddp/`, `tests/`, `scripts/`,
`docs/`, `examples/`, `cmake/`), backticked or not, not preceded by another path
character (so `$CUDA_HOME/cuda/include` and URLs are not ours). Braces expand
(`cuda/gpu_call.{h,cc}` is two paths); a token with `*` is a pattern and is left
out; a name without an extension may be a folder or the stem of files
(`cuda/gpu_communicator` for its .h and .cc). Bare file names (`shm_link.cc`)
are not checked: they name a file of the folder being described.

What counts as a name: `jax_smddp.a.b` (a dotted name starting with the
package, as `python -m jax_smddp.tools.bench` or `jax_smddp.errors.classify`)
must import or resolve as an attribute.
"""

from __future__ import annotations

import ast
import importlib
import io
import os
import re
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPS = ("xla_ffi", "cuda", "jax_smddp", "tests", "scripts", "docs", "examples", "cmake")
PATH = re.compile(r"(?<![\w./~$}-])((?:%s)/[\w./{},*-]*)" % "|".join(TOPS))
NAME = re.compile(r"(?<![\w./-])jax_smddp(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"pth", "py", "so", "md", "json"}
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def expand(token: str) -> list[str]:
  m = re.search(r"\{([^{}]*)\}", token)
  if not m:
    return [token]
  return [p for alt in m.group(1).split(",") for p in expand(token[:m.start()] + alt + token[m.end():])]


def path_exists(root: str, path: str) -> bool:
  full = os.path.join(root, path.rstrip("/"))
  if os.path.exists(full):
    return True
  folder, stem = os.path.split(full)
  return "." not in stem and os.path.isdir(folder) and any(
      f.startswith(stem + ".") for f in os.listdir(folder))


def python_comments(text: str) -> str:
  parts = []
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.COMMENT:
        parts.append(tok.string)
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=False)
        if doc:
          parts.append(doc)
  except (SyntaxError, tokenize.TokenError):
    return text
  return "\n".join(parts)


def referring_text(root: str) -> dict[str, str]:
  """{file: the text of it that refers to things}."""
  out = {}
  docs = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs"))
                                if f.endswith(".md"))
  for f in docs:
    with open(os.path.join(root, f), errors="replace") as fh:
      out[f] = fh.read()
  for top in ("xla_ffi", "cuda", "jax_smddp", "tests", "scripts", "examples"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
      for name in files:
        path = os.path.relpath(os.path.join(dirpath, name), root)
        if path == os.path.join("tests", "build", "test_doc_paths.py"):
          continue  # (its docstring shows what is not a path)
        try:
          with open(os.path.join(root, path), errors="replace") as fh:
            text = fh.read()
        except OSError:
          continue
        if name.endswith((".cc", ".h", ".cu", ".cuh", ".inc")):
          out[path] = "\n".join(C_COMMENT.findall(text))
        elif name.endswith(".py"):
          out[path] = python_comments(text)
        elif name.endswith(".sh"):
          out[path] = "\n".join(l for l in text.splitlines() if l.lstrip().startswith("#"))
        elif name.endswith(".md"):
          out[path] = text
  return out


def missing_paths(root: str) -> list[str]:
  found = []
  for f, text in referring_text(root).items():
    for line_no, line in enumerate(text.splitlines(), 1):
      for token in PATH.findall(line):
        token = token.rstrip(".,;:")
        if "*" in token:
          continue
        for path in expand(token):
          path = path.rstrip(".,;:")
          if not path_exists(root, path):
            found.append(f"{f}: {path}")
  return found


def resolves(name: str) -> bool:
  parts = name.split(".")
  obj = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], 1):
    if hasattr(obj, part):
      obj = getattr(obj, part)
      continue
    try:
      obj = importlib.import_module(".".join(parts[:i + 1]))
    except ImportError:
      return False
  return True


def test_every_path_the_docs_and_comments_name_exists():
  missing = missing_paths(REPO)
  assert not missing, "paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_jax_smddp_name_the_docs_and_comments_give_resolves():
  names = {}
  for f, text in referring_text(REPO).items():
    for name in NAME.findall(text):
      if name.rsplit(".", 1)[1] not in FILE_SUFFIXES:  # jax_smddp.pth is a file
        names.setdefault(name.rstrip("."), f)
  assert len(names) > 20, names  # the check sees the docs
  wrong = {n: f for n, f in sorted(names.items()) if not resolves(n)}
  assert not wrong, f"jax_smddp names that neither import nor resolve: {wrong}"


def test_the_check_fails_on_a_planted_stale_path(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "cuda").mkdir()
  (tmp_path / "cuda" / "gpu_call.h").write_text("// see cuda/gpu_call.cc and tests/gone.py\n")
  (tmp_path / "cuda" / "gpu_call.cc").write_text('const char* k = "cuda/not/a/comment";\n')
  (tmp_path / "README.md").write_text("`cuda/gpu_call.{h,cc}`, cuda/gpu_call, `cuda/gpu_cal.h`, "
                                      "$CUDA_HOME/cuda/include, cuda/*.cu\n")
  assert sorted(missing_paths(str(tmp_path))) == ["README.md: cuda/gpu_cal.h", "cuda/gpu_call.h: tests/gone.py"]
