"""The layering the tree promises: the runtime loads no tool, and CUDA headers
stay in cuda/ (and the GPU handlers and bindings)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_loads_no_tool(tmp_path):
  probe = ("import sys, jax_smddp\n"
           "print(sorted(m for m in sys.modules if m.startswith('jax_smddp.tools') or "
           "m.split('.')[0] == 'matplotlib'))\n")
  run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == "[]", run.stdout


def test_cuda_headers_only_in_cuda_and_the_gpu_boundary():
  allowed = {"xla_ffi/ffi/gpu_handlers.cc", "xla_ffi/bindings/cuda_module.cc"}
  offenders = []
  for top in ("xla_ffi", "cuda"):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for f in files:
        path = os.path.relpath(os.path.join(root, f), REPO)
        with open(os.path.join(REPO, path), errors="ignore") as fh:
          text = fh.read()
        if re.search(r'#include\s*[<"](cuda\.h|cuda_runtime[^>"]*|cuda_runtime_api\.h)[>"]', text):
          if not path.startswith("cuda/") and path not in allowed:
            offenders.append(path)
  assert not offenders, offenders


def test_the_installed_engine_exposes_no_test_probe():
  from jax_smddp import _native
  names = dir(_native.engine())
  probes = [n for n in names if "probe" in n or n in ("SharedBlock", "watch_process")]
  assert not probes, probes
  cuda = _native.cuda_engine()
  if cuda is not None:  # its test entry is compiled in only with -DJAX_SMDDP_TESTING=ON
    assert not hasattr(cuda, "stream_run")
  assert "rendezvous_probe" in dir(__import__("helpers").engine_probes())
