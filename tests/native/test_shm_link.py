"""The shared-memory link (xla_ffi/transports/shm_link.h), tested by a standalone
C++ program (tests/native/shm_link_test.cc, CMake target shm_link_test) that
forks a peer process: no jax. The script runs with single copy on (messages
from 64 KiB read in place; then refused by a seccomp filter) and off
(everything through the ring). The ring's defences against a corrupt peer, in one
process: tests/native/shm_corruption_test.cc (target shm_corruption_test); both programs
on tests/native/shm_harness.h."""

import os
import subprocess

import pytest

from helpers import native_program


@pytest.mark.timeout(300)
@pytest.mark.parametrize("single_copy_bytes", ["64K", "0"])
def test_shm_link(single_copy_bytes):
    env = {**os.environ, "JAX_SMDDP_SHM_SINGLE_COPY_BYTES": single_copy_bytes}
    run = subprocess.run([native_program("shm_link_test")], capture_output=True, text=True,
                         timeout=120, env=env)
    print(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks passed" in run.stdout
    refused = "child single copy: off: this process may not read" in run.stdout
    assert refused == (single_copy_bytes != "0"), run.stdout


@pytest.mark.timeout(300)
def test_shm_ring_refuses_corruption():
    run = subprocess.run([native_program("shm_corruption_test")], capture_output=True, text=True,
                         timeout=120)
    print(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "corruption checks passed" in run.stdout and "all checks passed" in run.stdout
