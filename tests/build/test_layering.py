"""The native layers' include direction, checked (docs/architecture.md describes it).

Each folder of native code is one layer; a file may include files of its own
layer and of layers below it, never above, and never a layer beside it. From
the bottom:

  0  xla_ffi/common       status, element types, hashing, settings
  1  xla_ffi/transports   links between processes, liveness, the world
  2  xla_ffi/algorithms   the Plan and the three families of bodies
  3  xla_ffi/engine       rendezvous, communicators, scheduler, GPU call log
  4  cuda                 everything that includes a CUDA header (above the engine)
  5  xla_ffi/ffi          front ends, side by side: the XLA FFI handlers,
     xla_ffi/mpiabi         the MPI ABI library (XLA's CPU collectives),
     cuda/ncclapi           the NCCL API library (XLA's GPU collectives)
  6  xla_ffi/bindings     the nanobind modules

CMake links each static library only to the ones below it (CMakeLists.txt), so
a call upward already fails to link; an upward #include of a header-only type
would not, and is what this test catches. Project headers are included by
their path from the checkout's root ("xla_ffi/...", "cuda/..."), so every
include is attributed to a layer. nanobind is included in bindings/ only, XLA's
FFI headers in ffi/ and bindings/ only; CUDA headers stay in cuda/ (with the
GPU handlers and the CUDA bindings: test_package_layout.py).
"""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (folder, rank): the most specific folder a file lies in decides its layer.
LAYERS = {
    "xla_ffi/common": 0,
    "xla_ffi/transports": 1,
    "xla_ffi/algorithms": 2,
    "xla_ffi/engine": 3,
    "cuda": 4,
    "xla_ffi/ffi": 5,
    "xla_ffi/mpiabi": 5,
    "cuda/ncclapi": 5,
    "xla_ffi/bindings": 6,
}
SOURCE = re.compile(r"\.(h|cc|cu|cuh|inc)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
ANGLE_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.M)
# Quoted includes that are not the project's own, and where they may appear.
EXTERNAL = {
    "nanobind/": {"xla_ffi/bindings"},
    "xla/": {"xla_ffi/ffi", "xla_ffi/bindings"},
}
GENERATED = {"smddp_source_hash.h": {"xla_ffi/bindings"}}  # cmake/source_hash.cmake
# Test code (tests/native: test doubles) may be included by the test-only module alone.
TEST_ONLY = {"xla_ffi/bindings/testing_module.cc"}


def layer_of(path: str) -> str | None:
  best = None
  for folder in LAYERS:
    if path == folder or path.startswith(folder + "/"):
      if best is None or len(folder) > len(best):
        best = folder
  return best


def native_sources(root: str) -> list[str]:
  paths = []
  for top in ("xla_ffi", "cuda"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
      for f in files:
        if SOURCE.search(f):
          paths.append(os.path.relpath(os.path.join(dirpath, f), root))
  return sorted(paths)


def violations(root: str) -> list[str]:
  """Every include that breaks the layering, as 'file: #include "x" (why)'."""
  found = []
  for path in native_sources(root):
    layer = layer_of(path)
    if layer is None:
      found.append(f"{path}: in no layer (add its folder to LAYERS and docs/architecture.md)")
      continue
    with open(os.path.join(root, path), errors="replace") as f:
      text = f.read()
    for inc in INCLUDE.findall(text):
      where = f'{path}: #include "{inc}"'
      external = next((p for p in EXTERNAL if inc.startswith(p)), None)
      if external or inc in GENERATED:
        allowed = EXTERNAL[external] if external else GENERATED[inc]
        if layer not in allowed:
          found.append(f"{where} (only in {', '.join(sorted(allowed))})")
        continue
      if inc.startswith("tests/"):
        if path not in TEST_ONLY:
          found.append(f"{where} (test code: only in {', '.join(sorted(TEST_ONLY))})")
        elif not os.path.exists(os.path.join(root, inc)):
          found.append(f"{where} (no such file)")
        continue
      target = layer_of(inc)
      if target is None:
        found.append(f"{where} (not a path from the checkout's root in a known layer)")
      elif not os.path.exists(os.path.join(root, inc)):
        found.append(f"{where} (no such file)")
      elif target != layer and LAYERS[target] >= LAYERS[layer]:
        rel = "above" if LAYERS[target] > LAYERS[layer] else "beside"
        found.append(f"{where} ({target} is {rel} {layer})")
    for inc in ANGLE_INCLUDE.findall(text):
      if inc.startswith("nanobind/") and layer != "xla_ffi/bindings":
        found.append(f"{path}: #include <{inc}> (nanobind only in xla_ffi/bindings)")
  return found


def test_includes_go_only_downward():
  found = violations(REPO)
  assert not found, "includes against the layering:\n" + "\n".join(found)


def test_the_check_sees_every_layer():
  # A layer folder that no longer exists (renamed, moved) would make the check vacuous.
  missing = [folder for folder in LAYERS if not os.path.isdir(os.path.join(REPO, folder))]
  assert not missing, missing
  counts = {folder: 0 for folder in LAYERS}
  for path in native_sources(REPO):
    counts[layer_of(path)] += 1
  assert all(counts.values()), counts


def test_the_check_fails_on_a_planted_violation(tmp_path):
  # The checker on a copy of two layers with one upward include, one beside,
  # nanobind outside bindings/ and a relative include: each is reported.
  def write(rel, text):
    p = tmp_path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
  write("xla_ffi/engine/rendezvous.h", "")
  write("xla_ffi/mpiabi/abi.h", "")
  write("xla_ffi/algorithms/plan.h", '#include "xla_ffi/engine/rendezvous.h"\n')
  write("xla_ffi/ffi/handler.cc", '#include "xla_ffi/mpiabi/abi.h"\n')
  write("xla_ffi/transports/link.h", '#include "nanobind/nanobind.h"\n#include "link_impl.h"\n')
  # A test double included by a library file, and by the test-only module (allowed).
  write("tests/native/double.h", "")
  write("xla_ffi/engine/uses_double.cc", '#include "tests/native/double.h"\n')
  write("xla_ffi/bindings/testing_module.cc", '#include "tests/native/double.h"\n')
  for folder in LAYERS:
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
  found = violations(str(tmp_path))
  assert any("plan.h" in v and "above" in v for v in found), found
  assert any("handler.cc" in v and "beside" in v for v in found), found
  assert any("nanobind" in v and "link.h" in v for v in found), found
  assert any("link_impl.h" in v for v in found), found
  assert any("uses_double.cc" in v and "test code" in v for v in found), found
  assert len(found) == 5, found
