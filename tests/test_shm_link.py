"""The shared-memory link (xla_ffi/transports/shm_link.cc), tested by a standalone
C++ program (tests/native/shm_link_test.cc) that forks a peer process: no jax,
no build of the package."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compiler():
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return cxx
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    return None


@pytest.mark.timeout(300)
def test_shm_link(tmp_path):
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path / "shm_link_test")
    build = subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", f"-I{ROOT}",
         os.path.join(ROOT, "xla_ffi/transports/shm_link.cc"),
         os.path.join(ROOT, "xla_ffi/transports/shm_file.cc"),
         os.path.join(ROOT, "xla_ffi/transports/process_liveness.cc"),
         os.path.join(ROOT, "xla_ffi/common/settings.cc"),
         os.path.join(ROOT, "tests/native/shm_link_test.cc"),
         "-o", exe, "-lpthread", "-lrt"],
        capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    print(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks passed" in run.stdout
