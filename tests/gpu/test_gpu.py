"""The CUDA backend on a real GPU: several processes share one GPU (CUDA IPC
between processes on one device) and run every collective against numpy, in
each data-movement mode. Skipped where there is no GPU (CI); run by
scripts/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

from jax_smddp.tools import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def _gpu_present() -> bool:
  if shutil.which("nvidia-smi") is None:
    return False
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return out.returncode == 0 and "GPU" in out.stdout


# A hang is a failure; JAX_SMDDP_GPU_TEST_TIMEOUT shortens the wait on a short GPU lease.
TIMEOUT = int(os.environ.get("JAX_SMDDP_GPU_TEST_TIMEOUT", "600"))
pytestmark = [pytest.mark.skipif(not _gpu_present(), reason="no GPU on this machine"),
              pytest.mark.timeout(TIMEOUT)]

MODES = {
    "copy engines, stream memory operations": {},
    "copy kernels within 2 blocks": {"JAX_SMDDP_GPU_COPIES": "kernel", "JAX_SMDDP_GPU_MAX_BLOCKS": "2"},
    "flag kernels": {"JAX_SMDDP_GPU_FLAGS": "kernel"},
    "64 KiB slots (many steps per call)": {"JAX_SMDDP_GPU_SLOT_BYTES": "65536",
                                           "JAX_SMDDP_GPU_DIRECT_READS": "0"},
    "compute stream (no annotation)": {"JAX_SMDDP_GPU_STREAM": "compute"},
    # Host flag memory is the default (since 2026-12-02); device flags meet the peers on the host.
    "step flags in device memory": {"JAX_SMDDP_GPU_FLAG_MEMORY": "device"},
    "device flags and flag kernels": {"JAX_SMDDP_GPU_FLAG_MEMORY": "device",
                                      "JAX_SMDDP_GPU_FLAGS": "kernel"},
    # XLA captures the custom calls into its CUDA graphs (any sequence of one command or more).
    "custom calls in CUDA graphs": {"JAX_SMDDP_GPU_GRAPHS": "1",
                                    "XLA_FLAGS": "--xla_gpu_graph_min_graph_size=1"},
    # The default reads peers' XLA buffers in place (mapped by CUDA IPC, one step per call);
    # these stage every call through the slots instead.
    "staged through the slots": {"JAX_SMDDP_GPU_DIRECT_READS": "0"},
    "staged with copy kernels": {"JAX_SMDDP_GPU_DIRECT_READS": "0",
                                 "JAX_SMDDP_GPU_COPIES": "kernel"},
}


def run(nprocs: int, env: dict, scenario: str = "collectives", per_process_env=None):
  procs = launch.run_job([scenario], nprocs, 1, script=WORKER, timeout=TIMEOUT * 0.9,
                         env={"JAX_PLATFORMS": "cuda", **env}, per_process_env=per_process_env)
  for p in procs:
    assert p.returncode == 0 and p.result and p.result["ok"], launch.describe(procs)
  return procs


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("mode", list(MODES))
def test_processes_sharing_one_gpu(nprocs, mode):
  procs = run(nprocs, MODES[mode])
  counters = procs[0].result["counters"]
  assert procs[0].result["checked"] > 0
  if MODES[mode].get("JAX_SMDDP_GPU_COPIES") == "kernel":
    assert counters["engine_copies"] == 0 and counters["copy_kernels"] > 0, counters
  else:
    # The copy-engine mode launches no kernel to move data (reductions excepted).
    assert counters["copy_kernels"] == 0 and counters["engine_copies"] > 0, counters
  if MODES[mode].get("JAX_SMDDP_GPU_FLAGS") == "kernel":
    assert counters["flag_memops"] == 0 and counters["flag_kernels"] > 0, counters
  # Direct reads happen where asked (XLA's buffers could be shared), never otherwise; the
  # environment's setting is every mode's default (scripts/gpu_check.sh's stage "staged" runs
  # this file with JAX_SMDDP_GPU_DIRECT_READS=0).
  if MODES[mode].get("JAX_SMDDP_GPU_DIRECT_READS",
                     os.environ.get("JAX_SMDDP_GPU_DIRECT_READS", "1")) == "1":
    assert counters["direct_reads"] > 0, (counters, procs[0].result["direct_staged_because"])
  else:
    assert counters["direct_reads"] == 0, counters


def test_single_process():
  run(1, {})


@pytest.mark.parametrize("nprocs", [2, 3])
def test_dead_peer_is_an_error_naming_it(nprocs):
  """One process exits without a word after a good all_gather: the others'
  next calls fail within seconds naming its rank and process, instead of
  their streams waiting on it forever (step flags in host memory, which the
  watchdog releases)."""
  procs = launch.run_job(["dead_peer"], nprocs, 1, script=WORKER, timeout=min(TIMEOUT, 180),
                         env={"JAX_PLATFORMS": "cuda", "JAX_SMDDP_GPU_FLAG_MEMORY": "host"})
  assert procs[-1].result and procs[-1].result.get("died"), launch.describe(procs)
  for p in procs[:-1]:
    assert p.result and p.result["ok"], launch.describe(procs)


def test_processes_that_disagree_on_a_call_fail_naming_it():
  """Two processes run all_gathers of different sizes as their second call:
  the one that enqueues second fails naming both calls (the call log), exits,
  and the watchdog then fails the other instead of letting it wait."""
  procs = launch.run_job(["mismatch"], 2, 1, script=WORKER, timeout=min(TIMEOUT, 180),
                         env={"JAX_PLATFORMS": "cuda", "JAX_SMDDP_GPU_FLAG_MEMORY": "host"})
  for p in procs:
    assert p.result and p.result["ok"], launch.describe(procs)
  assert any(p.result["disagree"] for p in procs), launch.describe(procs)


@functools.cache
def _no_libfabric() -> str | None:
  """Why the groups across simulated hosts cannot run here (None when they can): this build
  has no libfabric transport (its headers were not found at build time: on a GPU image
  without libfabric, carry scripts/carry_libfabric.sh's .fab/), or libfabric.so.1 does not
  load."""
  from jax_smddp import capabilities
  fabric = capabilities.fabric()
  if not fabric.get("built"):
    return ("jax_smddp was built without libfabric's headers (no links between hosts): "
            "carry .fab/ from scripts/carry_libfabric.sh and rebuild")
  if not fabric.get("loaded"):
    return f"libfabric.so.1 does not load ({fabric.get('error') or 'not found'})"
  return None


HOST_MODES = {
    "copy engines, stream memory operations": {"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
    "flag kernels": {**MODES["flag kernels"], "JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
    # Slots in device memory where this libfabric registers CUDA memory with shm
    # (FI_HMEM_CUDA; Debian's build cannot, then the group stages: either way
    # the results must be right).
    "FI_HMEM rails where libfabric can (auto, shm)": {"JAX_SMDDP_FABRIC_PROVIDER": "shm",
                                                       "JAX_SMDDP_FABRIC_HMEM": "auto"},
}


@pytest.mark.skipif(_no_libfabric() is not None, reason=str(_no_libfabric()))
@pytest.mark.parametrize("nprocs,per_host", [(2, 1), (4, 2)])
@pytest.mark.parametrize("mode", list(HOST_MODES))
def test_across_simulated_hosts(nprocs, per_host, mode):
  """Processes on one GPU named as different hosts (JAX_SMDDP_HOST_ID): the
  hierarchical all_gather, reduce_scatter and all_to_all (psum as two of them), the network
  proxy over libfabric, signals in
  GDRCopy memory where gdrdrv is loaded, else mapped host memory."""
  hosts = [{"JAX_SMDDP_HOST_ID": f"host{i // per_host}"} for i in range(nprocs)]
  procs = run(nprocs, HOST_MODES[mode], "hosts", hosts)
  assert procs[0].result["checked"] > 0
  groups = procs[0].result["across_hosts"]
  assert groups and all(g["hosts"] == nprocs // per_host for g in groups.values()), groups
  if "HMEM" not in mode:
    assert not any(g["device_slots"] for g in groups.values()), groups
  print(f"{mode}: {groups}")  # whether the rails ran (device_slots) goes in the GPU log


@pytest.mark.skipif(_no_libfabric() is not None, reason=str(_no_libfabric()))
def test_fi_hmem_required_but_missing_is_an_error_naming_why():
  """JAX_SMDDP_FABRIC_HMEM=1 over tcp;ofi_rxm (no FI_HMEM): set-up fails in
  every process, saying which process cannot and why, instead of staging."""
  hosts = [{"JAX_SMDDP_HOST_ID": f"host{i}"} for i in range(2)]
  procs = launch.run_job(["hosts"], 2, 1, script=WORKER, timeout=TIMEOUT * 0.9,
                         env={"JAX_PLATFORMS": "cuda", "JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm",
                              "JAX_SMDDP_FABRIC_HMEM": "1"}, per_process_env=hosts)
  text = launch.describe(procs)
  assert all(p.returncode != 0 or (p.result and not p.result["ok"]) for p in procs), text
  assert "JAX_SMDDP_FABRIC_HMEM=1" in text and "FI_HMEM" in text, text
