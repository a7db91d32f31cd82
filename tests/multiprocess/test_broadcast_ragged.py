"""jax_smddp.pbroadcast across real processes (the engine's cross-process collective_permute
with one source feeding every rank), against numpy."""

from __future__ import annotations

import os

import pytest

from jax_smddp.tools import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def _ok(procs):
  assert all(p.result and p.result.get("ok") for p in procs), launch.describe(procs)
  assert all(p.returncode == 0 for p in procs), launch.describe(procs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 1), (2, 2)])
def test_pbroadcast_across_processes(nprocs, devices):
  _ok(launch.run_job(["pbroadcast"], nprocs, devices, script=WORKER, timeout=240))
