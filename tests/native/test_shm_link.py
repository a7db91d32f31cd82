"""The shared-memory link (xla_ffi/transports/shm_link.cc), tested by a standalone
C++ program (tests/native/shm_link_test.cc, CMake target shm_link_test) that
forks a peer process: no jax."""

import subprocess

import pytest

from helpers import native_program


@pytest.mark.timeout(300)
def test_shm_link():
    run = subprocess.run([native_program("shm_link_test")], capture_output=True, text=True,
                         timeout=120)
    print(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks passed" in run.stdout
