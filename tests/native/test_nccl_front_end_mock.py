"""The NCCL API front end (cuda/ncclapi, libsmddp_nccl.so's sources) without
a GPU: a standalone C++ program (tests/native/nccl_front_end_test.cc) built
against the mock node's CUDA runtime (tests/native/mock_node), its served
calls on host threads, the real NCCL replaced by a mock
(tests/native/mock_nccl.cc) that records what is forwarded. Forked
processes, each on a GPU of its own, build a world of shared-memory links and create
communicators as XLA does (the unique id relayed as the key-value store
would): every collective the engine takes is served with the right values
and nothing reaches NCCL; broadcast, product reductions and send/recv are
forwarded with the real communicator (created once, blocking); a group of
sends and receives that forms an all-to-all is served as one, others are
forwarded; a group of one send and one receive at most (XLA's collective-permute, ring or
partial, a rank that makes no call) is served as jax_smddp's collective_permute between the
pairs (nccl_permute_test.cc); a group mixing both keeps its order; an unknown config or library version forwards
everything; an id the real library's does not fit in fails forwarded calls
saying why; JAX_SMDDP_REQUIRE=no-fallback refuses forwarding; splits; a
killed peer, or one that aborts the communicator, becomes the communicator's
async error naming it; a stalled peer and a rank that never joins hit the
deadline, and so does a forwarded call that rank 0 never makes (its real id never comes); a
forwarded call that fails in NCCL keeps NCCL's code and message;
a communicator across two simulated hosts (libfabric's shm provider between
them) runs all_gather, reduce_scatter and all_to_all on the hierarchical
bodies and forwards all_reduce; calls captured into a CUDA graph (their
stream operations recorded, then replayed three times on fresh inputs, between
uncaptured calls that stage or read in place) give the right values on every
replay. The real CUDA calls run in tests/gpu on a GPU machine."""

import glob
import os
import subprocess

import pytest

from helpers import native_program

SCENARIOS = ["served", "forwarded", "send_recv", "mixed_group", "unknown_config", "unknown_version", "id_full",
             "no_fallback", "split", "dead_peer", "stalled", "join_timeout", "forward_fails", "abort",
             "across_hosts", "partial_forward", "captured", "captured_direct"]


@pytest.fixture(scope="module")
def program():
  return native_program("nccl_front_end_test")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_front_end(program, scenario):
  mock = os.path.join(os.path.dirname(program), "mock_nccl", "libnccl.so.2")
  assert os.path.exists(mock), f"{mock} is not built (CMake target mock_nccl)"
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("JAX_SMDDP_") and not k.startswith("MOCK_NCCL")}
  env["JAX_SMDDP_NCCL_LIBRARY"] = mock
  regions = "/dev/shm/*-*:*:*"  # libfabric shm endpoints' regions (fabric_api.cc names them)
  before = set(glob.glob(regions))
  proc = subprocess.run([program, scenario], env=env, capture_output=True, text=True, timeout=100)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "all checks passed" in proc.stdout, out
  # Closed at exit, undestroyed communicators or not: no region is left.
  assert set(glob.glob(regions)) <= before, out
  if scenario == "dead_peer":
    assert "dead peer reported after" in proc.stdout, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["ring", "partial"])
def test_permutations(scenario):
  """XLA's collective-permute (send/recv groups) served by jax_smddp, nothing forwarded."""
  program = native_program("nccl_permute_test")
  mock = os.path.join(os.path.dirname(program), "mock_nccl", "libnccl.so.2")
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("JAX_SMDDP_") and not k.startswith("MOCK_NCCL")}
  env["JAX_SMDDP_NCCL_LIBRARY"] = mock
  proc = subprocess.run([program, scenario], env=env, capture_output=True, text=True, timeout=100)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "all checks passed" in proc.stdout, out
