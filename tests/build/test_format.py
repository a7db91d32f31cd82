"""The tree's C++/CUDA formatting (.clang-format) and Python lint (ruff's
configuration in pyproject.toml), checked with the versions scripts/test.sh
pins: a file that strays fails here, naming it and the command that fixes it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ran_in_first_suite

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_CI = os.environ.get("CI") == "true"
NATIVE = ("*.cc", "*.h", "*.cu", "*.cuh")


def _pinned(name: str) -> str:
  """The version scripts/test.sh installs."""
  with open(os.path.join(REPO, "scripts", "test.sh")) as f:
    found = re.search(rf'"{re.escape(name)}==([\d.]+)"', f.read())
  assert found, f"scripts/test.sh pins no {name} version"
  return found.group(1)


def _tool(name: str) -> str:
  """The pinned tool's path, or a skip (a failure under CI) saying how to get it."""
  want = _pinned(name)
  here = os.path.join(os.path.dirname(sys.executable), name)
  path = here if os.path.exists(here) else shutil.which(name)
  why = ""
  if path is None:
    why = f"{name} is not installed"
  else:
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    if want not in version:
      why = f"{path} is not version {want} ({version.strip()})"
  if why:
    assert not IN_CI, why
    pytest.skip(f"{why}: pip install {name}=={want}")
  return path


def _tracked(*patterns: str) -> list[str]:
  if not os.path.isdir(os.path.join(REPO, ".git")) or shutil.which("git") is None:
    assert not IN_CI, "CI checks a git clone"
    pytest.skip("not a git checkout")
  out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True,
                       text=True, check=True).stdout
  return out.split()


def unformatted(clang_format: str, files: list[str], cwd: str = REPO) -> list[str]:
  """The files clang-format would change."""
  bad = []
  for f in files:
    run = subprocess.run([clang_format, "--style=file", "--dry-run", "--Werror", f], cwd=cwd,
                         capture_output=True, text=True)
    if run.returncode != 0:
      bad.append(f)
  return bad


@pytest.mark.timeout(300)
def test_native_sources_are_formatted():
  ran_in_first_suite("clang-format")
  clang_format = _tool("clang-format")
  files = _tracked(*NATIVE)
  assert len(files) > 50, files
  bad = unformatted(clang_format, files)
  assert not bad, (f"{len(bad)} files stray from .clang-format: {bad}; fix them with "
                   f"`clang-format -i --style=file {' '.join(bad)}` (clang-format {_pinned('clang-format')})")


@pytest.mark.timeout(300)
def test_a_planted_stray_is_caught(tmp_path):
  """The check itself: the repository's style applied to a copy of a tracked
  file passes, and the same file with one line mangled fails."""
  clang_format = _tool("clang-format")
  shutil.copy(os.path.join(REPO, ".clang-format"), tmp_path / ".clang-format")
  source = os.path.join(REPO, "xla_ffi", "common", "status.h")
  with open(source) as f:
    text = f.read()
  (tmp_path / "good.h").write_text(text)
  (tmp_path / "bad.h").write_text(text.replace("namespace smddp {", "namespace smddp {\n  int  x ;", 1))
  assert unformatted(clang_format, ["good.h", "bad.h"], cwd=str(tmp_path)) == ["bad.h"]


@pytest.mark.timeout(300)
def test_python_passes_ruff():
  ran_in_first_suite("ruff")
  ruff = _tool("ruff")
  run = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise"], cwd=REPO,
                       capture_output=True, text=True)
  assert run.returncode == 0, (f"`ruff check` (ruff {_pinned('ruff')}, pyproject.toml's "
                               f"configuration) finds:\n{run.stdout}{run.stderr}")
  assert "All checks passed" in run.stdout, run.stdout
