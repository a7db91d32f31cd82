"""jax_smddp.pbroadcast (the engine's cross-process collective_permute with one source feeding
every rank) and jax_smddp.ragged_all_to_all (its all_to_alls) across real processes, against
numpy."""

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 1), (2, 2)])
def test_ragged_all_to_all_across_processes(nprocs, devices):
  _ok(launch.run_job(["ragged_all_to_all"], nprocs, devices, script=WORKER, timeout=240))
