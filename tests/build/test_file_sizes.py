"""Rooms: no source, test or doc file over 800 lines (split it at its seams, a long native
test by scenario on a shared harness, as tests/native/nccl_harness.h)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPS = ("xla_ffi", "cuda", "jax_smddp", "tests", "scripts", "examples", "docs")
SUFFIXES = (".py", ".cc", ".h", ".cu", ".cuh", ".md", ".sh")
MAX_LINES = 800


def test_no_file_is_over_800_lines():
  long = []
  for top in TOPS:
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
      dirs[:] = [d for d in dirs if d not in ("data", "__pycache__")]
      for f in files:
        if f.endswith(SUFFIXES):
          path = os.path.join(root, f)
          with open(path, errors="ignore") as fh:
            n = sum(1 for _ in fh)
          if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, REPO)}: {n} lines")
  for f in ("README.md", "CMakeLists.txt", "BUILD"):
    with open(os.path.join(REPO, f)) as fh:
      n = sum(1 for _ in fh)
    if n > MAX_LINES:
      long.append(f"{f}: {n} lines")
  assert not long, "over 800 lines:\n" + "\n".join(long)
