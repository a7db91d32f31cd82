"""BUILD (Bazel targets for teams that vendor jax_smddp into a jaxlib build) names every
source and header of the native layers that CMakeLists.txt builds (the pip build), and
nothing that does not exist: nothing builds BUILD here, so this is what keeps it true."""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_ONLY = {"xla_ffi/bindings/testing_module.cc"}  # the probes' module, never shipped


def _read(name: str) -> str:
  return open(os.path.join(REPO, name)).read()


def test_build_names_every_source_cmake_builds():
  pattern = r"((?:xla_ffi|cuda)/[\w/]+\.(?:cc|cu))\b"
  cmake = set(re.findall(pattern, _read("CMakeLists.txt"))) - TEST_ONLY
  bazel = set(re.findall(pattern, _read("BUILD")))
  assert cmake - bazel == set(), f"built by CMake, missing from BUILD: {sorted(cmake - bazel)}"
  assert bazel - cmake == set(), f"in BUILD, not built by CMake: {sorted(bazel - cmake)}"


def test_build_names_every_header_and_only_files_that_exist():
  build = _read("BUILD")
  headers = {os.path.relpath(p, REPO) for ext in ("h", "cuh", "inc")
             for top in ("xla_ffi", "cuda")
             for p in glob.glob(os.path.join(REPO, top, "**", f"*.{ext}"), recursive=True)}
  missing = sorted(h for h in headers if f'"{h}"' not in build)
  assert not missing, f"headers BUILD does not name: {missing}"
  named = set(re.findall(r'"((?:xla_ffi|cuda|jax_smddp)/[^"*]+)"', build))
  gone = sorted(p for p in named if not os.path.exists(os.path.join(REPO, p)))
  assert not gone, f"BUILD names files that do not exist: {gone}"
