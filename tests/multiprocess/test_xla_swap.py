"""The XLA-level swap (JAX_SMDDP_COLLECTIVES=xla): XLA's own cross-process CPU
collectives, those its partitioner inserts into global-view jit programs
included, served by jax_smddp's MPI ABI library (jax_smddp/swap/xla.py), in
real jax.distributed jobs, against gloo and against one device."""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import need_netns
from jax_smddp import capabilities
from jax_smddp.tools import launch, netns

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
XLA = {"JAX_SMDDP_COLLECTIVES": "xla"}


def run_job(*args, **kwargs):
  return launch.run_job(*args, script=WORKER, **kwargs)


def results(procs):
  assert all(p.result and p.result.get("ok") for p in procs), launch.describe(procs)
  assert all(p.returncode == 0 for p in procs), launch.describe(procs)
  return [p.result for p in procs]


def _fsdp_against_gloo(nprocs, devices, **where):
  """The step with the swap (where `where` says) and on gloo (on loopback:
  gloo's answer does not depend on where the processes run)."""
  env = {**XLA, **where.pop("env", {})}
  swapped = results(run_job(["xla_fsdp"], nprocs, devices, timeout=300, env=env, **where))
  gloo = results(run_job(["xla_fsdp"], nprocs, devices, timeout=300))
  for s, g in zip(swapped, gloo):
    np.testing.assert_allclose(s["losses"], g["losses"], rtol=1e-6)
    np.testing.assert_allclose(s["checksum"], g["checksum"], rtol=1e-6)
    assert s["swapped"] and not g["swapped"], (s, g)
    assert g["moved"] == 0
    # The step's parameters and gradients crossed processes on jax_smddp's links.
    assert s["moved"] > 5 * 4 * 100, s
    assert s["collectives"], s
  return swapped


@pytest.mark.timeout(400)
def test_global_view_fsdp_step_2x2_equals_gloo():
  _fsdp_against_gloo(2, 2)


@pytest.mark.timeout(400)
def test_lax_collectives_lowered_by_xla_run_on_jax_smddp():
  for r in results(run_job(["xla_lax"], 2, 2, timeout=300, env=XLA)):
    assert r["swapped"] and r["moved"] > 0, r
    # MPI_Init set glibc's heap policy (JAX_SMDDP_HEAP_REUSE_BYTES): XLA's
    # large outputs are reused on this path too, where the policy (decided by
    # the environment the workers inherit) keeps 40 MiB blocks.
    if capabilities.heap_reuse()["bytes"] >= 40 << 20:
      assert r["refill_faults"] < 100, r


@pytest.mark.timeout(300)
def test_shape_mismatch_names_both_calls():
  procs = run_job(["xla_mismatch"], 2, 1, timeout=240, env={**XLA, "JAX_SMDDP_TIMEOUT_S": "60"})
  for p in procs:
    assert p.result is not None and not p.result["ok"], launch.describe(procs)
    err = p.result["error"]
    assert "MPI_Allreduce" in err and "processes disagree on the call" in err, err
    assert "(24 bytes in" in err and "(40 bytes in" in err, err
    # Typed by jax_smddp.errors.classify, as the custom calls' failures are.
    typed = p.result["typed"]
    assert typed and typed["class"] == "CallMismatchError" and typed["op"] == "all_reduce", typed


@pytest.mark.timeout(300)
def test_killed_peer_raises_naming_it():
  procs = run_job(["xla_peer_dies"], 2, 1, timeout=240, env={**XLA, "JAX_SMDDP_TIMEOUT_S": "120"})
  r = procs[0].result
  assert r is not None and not r["ok"], launch.describe(procs)
  assert "process 1" in r["error"] and "MPI_Allreduce" in r["error"], r["error"]
  assert r["seconds"] < 15, r
  typed = r["typed"]
  assert typed and typed["class"] == "PeerFailedError" and typed["op"] == "all_reduce", typed
  assert typed["remedy"], typed


@pytest.mark.timeout(600)
def test_global_view_fsdp_step_two_hosts_equals_gloo():
  need_netns()
  with netns.two_hosts() as (names, ips):
    swapped = _fsdp_against_gloo(2, 2, namespaces=names, coordinator_ip=ips[0],
                                 env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"})
  assert all(r["network"] for r in swapped), swapped
