"""jax_smddp across real processes: jax.distributed jobs on this machine.

Every job starts real Python processes (jax_smddp/tools/launch.py) that
check jax_smddp's collectives against numpy; two simulated hosts (network
namespaces joined by veth) exercise the libfabric path over the tcp provider.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from helpers import need_netns, ran_in_first_suite
from jax_smddp.tools import launch, netns

# The second suite (scripts/test.sh) leaves these to the first: their subject is the C++
# transports and routes between processes, which Python and jax do not change.
BETWEEN_HOSTS = "the transports and routes between processes"

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")



def run_job(*args, **kwargs):
  return launch.run_job(*args, script=WORKER, **kwargs)


def shm_names() -> set:
  return set(glob.glob("/dev/shm/jax_smddp-*"))


def oversubscribed_here(nprocs: int) -> bool:
  """What initialize() finds for `nprocs` processes started on this machine: more of them than
  this process's cores, where the kernel's boot id (the machine's id) can be read."""
  return os.access("/proc/sys/kernel/random/boot_id", os.R_OK) and nprocs > len(
      os.sched_getaffinity(0))


def assert_all_ok(procs):
  assert all(p.result and p.result.get("ok") for p in procs), launch.describe(procs)
  assert all(p.returncode == 0 for p in procs), launch.describe(procs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_collectives_across_processes(nprocs, devices):
  before = shm_names()
  procs = run_job(["collectives"], nprocs, devices, timeout=240)
  assert_all_ok(procs)
  topo = procs[0].result["topology"]
  assert topo["shared_memory_peers"] == list(range(1, nprocs)) and topo["network_peers"] == []
  # This test's processes share this machine (and its kernel's boot id) with this process.
  crowded = oversubscribed_here(nprocs)
  assert topo["oversubscribed"] == crowded, topo
  assert topo["wait_polls"] == ({"spin": 16, "yield": 32} if crowded else
                                {"spin": 256, "yield": 4096}), topo
  assert shm_names() - before == set(), "shared-memory segments left in /dev/shm after exit"


@pytest.mark.timeout(300)
def test_cpu_helpers_are_the_hosts_share():
  """Two processes on this host: each gets the helpers of its half of the cores it may use
  (JAX_SMDDP_CPU_HELPERS' default), not every core less one."""
  procs = run_job(["cpu_helpers"], 2, 2, timeout=240)
  assert_all_ok(procs)
  for p in procs:
    cores = len(os.sched_getaffinity(0))
    assert p.result["cores"] == cores and p.result["local_processes"] == 2, p.result
    assert p.result["helpers"] == max(cores // 2 - 1, 0), p.result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 1), (2, 2)])
def test_staged_collectives_of_changing_sizes(nprocs, devices):
  """Independent collectives in one program, each begun on XLA's thread and perhaps finished
  on an engine worker, their staging reused across calls of other sizes, right against
  numpy."""
  assert_all_ok(run_job(["independent"], nprocs, devices, timeout=240))


@pytest.mark.timeout(300)
def test_small_chunks_and_rings():
  """Messages far larger than the chunk and the ring: chunking and ring wrap-around
  (single copy off: every byte through the ring)."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], 2, 2, timeout=240,
                  env={"JAX_SMDDP_CHUNK_BYTES": "192", "JAX_SMDDP_SHM_RING_BYTES": "4096",
                       "JAX_SMDDP_SHM_SINGLE_COPY_BYTES": "0"})
  assert_all_ok(procs)
  for p in procs:
    for peer in p.result["traffic"].values():
      assert peer["single_copy"].startswith("off: turned off") and peer["single_copy_received"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (3, 1)])
def test_single_copy_every_op_and_dtype(nprocs, devices):
  """Every collective and dtype against numpy with every message read in place
  from the sender's memory (process_vm_readv), as large messages are by default."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], nprocs, devices, timeout=240,
                  env={"JAX_SMDDP_SHM_SINGLE_COPY_BYTES": "1", "JAX_SMDDP_CHUNK_BYTES": "4096"})
  assert_all_ok(procs)
  for p in procs:
    for peer in p.result["traffic"].values():
      assert peer["single_copy"] == "on", p.result["traffic"]
      # Everything but the per-call agreement headers (104 bytes) was read in place.
      assert peer["single_copy_received"] >= 0.9 * peer["received"] > 0, p.result["traffic"]


@pytest.mark.timeout(300)
def test_streaming_stores_every_op_and_dtype():
  """Every collective and dtype against numpy with every output written by
  non-temporal stores (JAX_SMDDP_STREAMING_STORE_BYTES=1): own blocks and the
  copies into the other local devices' outputs."""
  ran_in_first_suite(BETWEEN_HOSTS)
  assert_all_ok(run_job(["collectives"], 2, 2, timeout=240,
                        env={"JAX_SMDDP_STREAMING_STORE_BYTES": "1"}))


@pytest.mark.timeout(300)
def test_single_copy_forbidden_falls_back_to_the_ring():
  """Processes that may not read each other's memory (no CAP_SYS_PTRACE, not
  dumpable): every collective still right, through the ring, and traffic()
  says why single copy is off."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], 2, 2, timeout=240,
                  env={"JAX_SMDDP_SHM_SINGLE_COPY_BYTES": "1", "SMDDP_TEST_FORBID_PTRACE": "1"})
  assert_all_ok(procs)
  for p in procs:
    for peer in p.result["traffic"].values():
      why = peer["single_copy"]
      assert why.startswith("off: ") and "Operation not permitted" in why, why
      assert peer["single_copy_received"] == 0 and peer["received"] > 0, peer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices", [(2, 1), (2, 2)])
def test_permutes_across_processes(nprocs, devices):
  """jax_smddp.ppermute on the engine's cross-process body: ring and partial, three dtypes."""
  assert_all_ok(run_job(["permute"], nprocs, devices, timeout=240))


@pytest.mark.timeout(300)
def test_gradients_match_jax_lax():
  assert_all_ok(run_job(["grad"], 2, 2, timeout=240))


@pytest.mark.timeout(300)
def test_initialize_is_idempotent_and_restartable():
  assert_all_ok(run_job(["reinitialize"], 2, 2, timeout=240))


@pytest.mark.timeout(300)
def test_backend_swap_flag_across_processes():
  assert_all_ok(run_job(["swap"], 2, 2, timeout=240, env={"JAX_SMDDP_COLLECTIVES": "1"}))


def assert_typed(result: dict, cls: str, status: str, op: str, peer_process: int):
  """The failure's JAX text starts with `status` and jax_smddp's tag, and
  jax_smddp.errors.classify made it a `cls` naming `op` and the peer process
  from the engine's record, with a remedy. (A failure that surfaces while XLA
  dispatches a later computation comes rewrapped as INTERNAL: the tag stays.)"""
  typed = result["typed"]
  assert typed is not None, result
  assert typed["class"] == cls, typed
  assert re.match(rf"({status}|INTERNAL: Error dispatching computation): .*?"
                  rf"jax_smddp\[{typed['code']}\] {op} \(op ", result["error"]), result["error"]
  assert typed["jax_status"] in (status, "INTERNAL"), typed
  assert typed["original"] and typed["from_record"], typed
  assert typed["op"] == op, typed
  assert peer_process in typed["peer_processes"], typed
  assert typed["peer_ranks"] and typed["peer_devices"], typed  # as ranks and as device ids
  assert typed["remedy"], typed
  assert result["last_failure"]["code"] == typed["code"], result


def _mismatch_errors(scenario: str, nprocs: int, devices: int) -> list[tuple[int, dict]]:
  """Runs `scenario`, whose processes run different calls, and checks that every process
  reported the disagreement; returns each process's index and result."""
  procs = run_job([scenario], nprocs, devices, timeout=240, env={"JAX_SMDDP_TIMEOUT_S": "60"})
  for p in procs:
    assert p.result is not None, launch.describe(procs)
    assert "processes disagree on the call" in p.result.get("error", ""), launch.describe(procs)
  return [(p.index, p.result) for p in procs]


@pytest.mark.timeout(300)
def test_mismatched_shapes_are_reported():
  for i, r in _mismatch_errors("mismatch", 2, 2):
    assert "24 bytes in" in r["error"] and "40 bytes in" in r["error"], r["error"]
    assert_typed(r, "CallMismatchError", "FAILED_PRECONDITION", "all_gather", peer_process=1 - i)


@pytest.mark.timeout(300)
def test_mismatched_dtypes_are_reported():
  for i, r in _mismatch_errors("mismatch_dtype", 2, 1):
    assert "all_reduce of float32" in r["error"] and "all_reduce of int32" in r["error"], r
    assert_typed(r, "CallMismatchError", "FAILED_PRECONDITION", "all_reduce", peer_process=1 - i)


@pytest.mark.timeout(300)
def test_mismatched_ops_are_reported_at_once():
  """Each process starts moving data before it has its peer's view of the call; one waiting
  for a message the other never sends still reports the disagreement, within seconds."""
  for _, r in _mismatch_errors("mismatch_op", 2, 1):
    assert "runs all_gather of float32" in r["error"], r["error"]
    assert "runs all_to_all of float32" in r["error"], r["error"]
    assert r["seconds"] < 20 and r["typed"]["class"] == "CallMismatchError", r


def _check_peer_failure(procs, dead: int, within_s: float, cls: str = "PeerFailedError",
                        status: str = "UNAVAILABLE", op: str = "all_reduce"):
  survivors = [p for p in procs if p.index != dead]
  for p in survivors:
    assert p.result is not None and not p.result["ok"], launch.describe(procs)
    assert f"process {dead} (devices" in p.result["error"], p.result["error"]
    assert p.result["seconds"] < within_s, p.result
    assert_typed(p.result, cls, status, op, peer_process=dead)


@pytest.mark.timeout(300)
def test_dead_peer_raises_within_seconds():
  before = shm_names()
  procs = run_job(["peer_dies"], 3, 1, timeout=240, env={"JAX_SMDDP_TIMEOUT_S": "120"})
  _check_peer_failure(procs, dead=2, within_s=10)
  assert "exited" in procs[0].result["error"]
  assert shm_names() - before == set()


@pytest.mark.timeout(300)
def test_peer_killed_mid_collective():
  before = shm_names()
  procs = run_job(["peer_killed_midway"], 2, 2, timeout=240,
                         env={"JAX_SMDDP_TIMEOUT_S": "120"})
  assert procs[1].returncode == -9, launch.describe(procs)
  _check_peer_failure(procs, dead=1, within_s=15)
  assert shm_names() - before == set()


@pytest.mark.timeout(300)
def test_stalled_peer_times_out_naming_it():
  procs = run_job(["peer_stalls"], 2, 1, timeout=240)
  _check_peer_failure(procs, dead=1, within_s=20, cls="PeerTimeoutError",
                      status="DEADLINE_EXCEEDED", op="all_gather")
  assert "timed out" in procs[0].result["error"]


@pytest.mark.timeout(300)
def test_stalled_peer_in_a_ring_is_named_by_every_process():
  """Four hosts (by JAX_SMDDP_HOST_ID), one process each: a ring, where only
  the next process receives from the stalled one and the others wait on a
  live neighbour. Every survivor times out naming the stalled process, whose
  view of the call never came, not the neighbour it waited on."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["peer_stalls"], 4, 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in "abcd"])
  _check_peer_failure(procs, dead=3, within_s=20, cls="PeerTimeoutError",
                      status="DEADLINE_EXCEEDED", op="all_gather")
  for p in procs[:3]:
    err = p.result["error"]
    assert "process 3 (devices [3]) never reached this collective" in err, p.result
    # not the neighbour's wait as the cause: "waiting for process 0 ... to send its data"
    assert "to send its data" not in err, p.result
  for p in procs[1:3]:  # they waited on a live neighbour (process 0, then 1)
    assert f"the wait that timed out was for process {p.index - 1} (devices" in p.result["error"]


def _protocol_version() -> int:
  from jax_smddp import capabilities
  return int(capabilities.build()["protocol_built"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts,odd", [("aa", 1), ("aab", 2)], ids=["one-host", "three-processes-two-hosts"])
def test_processes_of_another_protocol_version_fail_at_initialize(hosts, odd):
  """Two builds that differ only in their wire protocol version (process `odd`
  poses as the next version): initialize() raises BuildMismatchError at once
  in every process concerned, naming both sides and only the protocol as
  different, and connects nothing (same host: no shared memory; other hosts:
  no libfabric link)."""
  version = _protocol_version()
  before = shm_names()
  procs = run_job(["build_mismatch"], len(hosts), 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h,
                                    **({"JAX_SMDDP_TEST_PROTOCOL_VERSION": str(version + 1)}
                                       if q == odd else {})}
                                   for q, h in enumerate(hosts)])
  for p in procs:
    r = p.result
    assert r is not None and r["ok"] is False, launch.describe(procs)
    assert r["cls"] == "BuildMismatchError" and r["process"] == p.index, r
    mine, others = (version + 1, version) if p.index == odd else (version, version + 1)
    differing = [q for q in range(len(hosts)) if q != p.index] if p.index == odd else [odd]
    assert r["peer_processes"] == differing, r
    assert r["differences"] == {str(q): {"protocol": [mine, others]} for q in differing}, r
    for q in differing:
      assert f"process {q} (host {hosts[q]}, pid " in r["message"], r["message"]
      assert f"wire protocol version {others} there, {mine} here" in r["message"], r["message"]
    assert f"this one, process {p.index} (host {hosts[p.index]}, pid " in r["message"], r["message"]
    assert "same jax_smddp build" in r["remedy"], r
    assert r["initialized"] is False and r["topology"] is None, r
    assert r["seconds"] < 30, r  # at the bootstrap, not at a deadline
    assert p.returncode == 0, launch.describe(procs)  # every process told, none killed by JAX
  assert shm_names() - before == set()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("corrupt,detail", [
    ("magic", "magic 0x46444d73 instead of jax_smddp's 0x46444d53"),
    ("version", "wire protocol version {next}, but this process speaks {version}"),
    ("length", "payload bytes, the chunk holds"),
    ("short", "only 32 bytes, shorter than the 64-byte header"),
    ("sender", "malformed chunk from an unknown sender (id 0x"),
])
def test_malformed_chunks_are_dropped_naming_the_sender(corrupt, detail):
  """Every libfabric chunk process 1 sends is malformed (JAX_SMDDP_FABRIC_TEST_CORRUPT):
  process 0 drops them unread and its all_gather fails at once with a
  ProtocolError (DATA_LOSS) naming process 1 and what was wrong, not with a
  timeout or a dead peer's error. Process 1 finishes too (its peer left)."""
  ran_in_first_suite(BETWEEN_HOSTS)
  version = _protocol_version()
  procs = run_job(["malformed_chunks"], 2, 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm", "JAX_SMDDP_TIMEOUT_S": "60"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": "a"},
                                   {"JAX_SMDDP_HOST_ID": "b", "JAX_SMDDP_FABRIC_TEST_CORRUPT": corrupt}])
  r = procs[0].result
  assert r is not None and not r["ok"], launch.describe(procs)
  assert_typed(r, "ProtocolError", "DATA_LOSS", "all_gather", peer_process=1)
  assert "process 1 (devices [1]) sent what this process cannot parse" in r["error"], r["error"]
  assert detail.format(next=version + 1, version=version) in r["error"], r["error"]
  if corrupt != "sender":
    assert "malformed chunk from process 1: " in r["error"], r["error"]
  assert "the chunk was dropped" in r["error"], r["error"]
  assert r["seconds"] < 20, r  # at once, not at the 60 s deadline
  assert procs[1].result is not None, launch.describe(procs)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("hosts,devices,env", [
    # 2 hosts x 2 processes: rails, relays and per-host combining
    ("aabb", 2, {"JAX_SMDDP_ALGORITHM": "hierarchical"}),
    ("aabb", 1, {"JAX_SMDDP_HIERARCHICAL": "0"}),  # the engine's veto: flat routes
    ("aaab", 1, {}),  # uneven hosts: flat routes whatever the tuner says
    ("aabbcc", 1, {"JAX_SMDDP_ALGORITHM": "hierarchical", "JAX_SMDDP_CHUNK_BYTES": "65536"}),
    # every chunk direct, in several chunks: the combined partials and results are announced at
    # the call's start and their bytes handed over chunk by chunk (Messages::Announce)
    ("aabb", 1, {"JAX_SMDDP_ALGORITHM": "hierarchical", "JAX_SMDDP_CHUNK_BYTES": "4096",
                 "JAX_SMDDP_FABRIC_DIRECT_BYTES": "1"}),
    # more than 2 hosts, one process each: a ring of the hosts (Routes::ring), every block
    # relayed and every partial combined hop by hop, chunk by chunk; several chunks per message,
    # direct (announced) and not, two devices per process (two blocks per hop). On rails
    # (aabbcc): staggered rounds (Routes::stagger_to), each chunk held until the previous
    # round's arrived
    ("abcd", 2, {"JAX_SMDDP_CHUNK_BYTES": "4096", "JAX_SMDDP_FABRIC_DIRECT_BYTES": "1"}),
    ("abc", 1, {"JAX_SMDDP_CHUNK_BYTES": "4096", "JAX_SMDDP_FABRIC_DIRECT_BYTES": "0"}),
    ("aabbcc", 1, {"JAX_SMDDP_ALGORITHM": "hierarchical", "JAX_SMDDP_CHUNK_BYTES": "4096",
                   "JAX_SMDDP_FABRIC_DIRECT_BYTES": "1"}),
])
def test_hosts_by_host_id(hosts, devices, env):
  """Hosts told apart by JAX_SMDDP_HOST_ID: libfabric (tcp on loopback)
  between them, shared memory within, without network namespaces."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], len(hosts), devices, timeout=300,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm", **env},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in hosts])
  assert_all_ok(procs)
  for p, h in zip(procs, hosts):
    topo = p.result["topology"]
    assert len(topo["network_peers"]) == sum(1 for g in hosts if g != h), topo


@pytest.mark.timeout(300)
def test_peer_killed_during_a_ring_is_named():
  """Four hosts (by JAX_SMDDP_HOST_ID), one process each: psum runs round a
  ring of the hosts, each hop relaying and combining chunk by chunk (bounce
  chunks here: 128 KiB). The last process is killed mid-call: every survivor
  raises within seconds, not at the timeout, naming it, though only the next
  one receives from it (the others wait on a live previous hop, which does
  not exit for 2 s after its own failure)."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["peer_killed_midway"], 4, 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm", "JAX_SMDDP_TIMEOUT_S": "120"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in "abcd"])
  assert procs[3].returncode == -9, launch.describe(procs)
  named = []
  for p in procs[:3]:
    assert p.result is not None and not p.result["ok"], launch.describe(procs)
    assert p.result["seconds"] < 15, p.result
    typed = p.result["typed"]
    assert typed["class"] == "PeerFailedError" and typed["op"] == "all_reduce", p.result
    assert len(typed["peer_processes"]) == 1, p.result
    named.append(typed["peer_processes"][0])
    assert f"process {named[-1]} (devices" in p.result["error"], p.result["error"]
  assert named == [3, 3, 3], named


@pytest.mark.timeout(300)
def test_shutdown_waits_for_peers_on_other_hosts():
  """Two hosts (by JAX_SMDDP_HOST_ID), one process each. A process's shutdown() returns only
  once its peers on other hosts shut down too: its last bytes may still be on their way to a
  peer finishing its collectives (closing the links then failed the peer's collective, now and
  then, in CI). A process that shuts down while its peer runs a collective without it waits at
  most the timeout (1 s here), and the peer's error names it and says it shut down."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["farewell"], 2, 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in "ab"])
  first, last = procs[0].result, procs[1].result
  assert first and last and last["ok"], launch.describe(procs)
  assert first["waited"] > 1.0, first  # the last process slept 3 s before its shutdown()
  assert 0.9 < last["alone"] < 10, last
  # Process 0's psum without the last process failed (worker.failed), naming it.
  assert not first["ok"] and first["typed"]["class"] == "PeerFailedError", first
  assert first["typed"]["peer_processes"] == [1], first
  assert "process 1 shut jax_smddp down" in first["error"], first["error"]
  assert first["seconds"] < 30, first


@pytest.mark.timeout(400)
@pytest.mark.parametrize("direct_bytes", ["1", "0"])
def test_direct_transfers_between_hosts(direct_bytes):
  """2 hosts (by JAX_SMDDP_HOST_ID) x 1 process x 2 devices over libfabric tcp:
  every collective against numpy with every non-empty network message sent
  direct (tagged between the callers' buffers), or with none; traffic() says
  which path the received bytes took."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], 2, 2, timeout=300,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm",
                       "JAX_SMDDP_FABRIC_DIRECT_BYTES": direct_bytes},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in "ab"])
  assert_all_ok(procs)
  for p in procs:
    (peer,) = [v for v in p.result["traffic"].values() if v["link"].startswith("libfabric")]
    assert peer["received"] > 0, peer
    if direct_bytes == "1":
      assert peer["single_copy"] == "on" and peer["single_copy_received"] == peer["received"], peer
    else:
      assert peer["single_copy"] == "off: JAX_SMDDP_FABRIC_DIRECT_BYTES=0", peer
      assert peer["single_copy_received"] == 0, peer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", ["aaa", "abc"], ids=["one-host", "three-hosts"])
def test_call_phases_say_where_a_call_waits(hosts):
  """distributed.call_phases() counts every call across processes and splits its time: 20
  all_gathers are 20 calls whose phases sum to less than the loop's wall time; in a call the
  last process reaches 0.3 s late, the others wait in the body (it starts at once, the
  agreement's views compared as they arrive), not before it, and the late process hardly waits
  at all. Between hosts (by JAX_SMDDP_HOST_ID, one libfabric endpoint per process and no
  shared-memory peer) that wait sleeps on the endpoint's descriptor up to 10 ms at a time
  (wait_polls.h, kOneDescriptorSleepUs): tens of sleeps, not one per millisecond."""
  if hosts != "aaa":
    ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["phases"], 3, 1, timeout=240,
                  env=None if hosts == "aaa" else {"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in hosts])
  assert_all_ok(procs)
  for p in procs:
    r = p.result
    loop, late = r["loop"], r["late"]
    assert r["ops"] == ["all_gather"], r
    assert loop["calls"] == 20 and late["calls"] == 1, r
    assert loop["local_s"] < 0.01 and late["local_s"] < 0.01, r  # one device per process
    for part in (loop, late):
      assert all(part[k] >= 0 for k in part), r
      assert part["wait_s"] <= part["agree_s"] + part["body_s"] + 1e-3, r
      assert part["sleep_s"] <= part["wait_s"] + 1e-3, r
    total = loop["queue_s"] + loop["agree_s"] + loop["body_s"]
    assert 0 < total < r["loop_s"], r
    if p.index == len(procs) - 1:  # the late one: its peers were there already
      assert late["agree_s"] < 0.15 and late["body_s"] < 0.15, r
    else:
      assert late["body_s"] > 0.2 and late["agree_s"] < 0.15, r
      assert late["wait_s"] > 0.2, r  # the body waited on its links, it did not compute
      if hosts != "aaa":  # 1 ms bounds: about 300 sleeps
        assert 0 < late["sleeps"] < 80, r
      # XLA's thread polled JAX_SMDDP_INLINE_ONE_HOST_WAIT_US (2 ms; between hosts
      # JAX_SMDDP_INLINE_WAIT_US, 50 us) for the late peer, then left the call to a worker
      assert late["inline_calls"] == 0, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,devices,hosts", [(2, 1, "aa"), (2, 2, "aa"), (2, 1, "ab")],
                         ids=["2x1-one-host", "2x2-one-host", "2x1-two-hosts"])
def test_small_calls_run_on_xlas_thread_once_the_peers_are_in_them(nprocs, devices, hosts):
  """Calls whose output in a process is below JAX_SMDDP_INLINE_BYTES (between hosts) or
  JAX_SMDDP_INLINE_ONE_HOST_BYTES (processes of one host) run on the last local arrival's XLA
  thread when every peer announces the call within the wait (a whole second here, so that
  every call qualifies on a loaded machine); larger calls on an engine worker. The large calls
  here are above the first threshold and below the second: on XLA's thread within one host,
  on a worker between hosts (told apart by JAX_SMDDP_HOST_ID). Both kinds, and an XLA psum
  after each small call in the same program, right against numpy."""
  if hosts != "aa":
    ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["inline"], nprocs, devices, timeout=240,
                  env={"JAX_SMDDP_INLINE_WAIT_US": "1000000", "JAX_SMDDP_INLINE_BYTES": "256K",
                       "JAX_SMDDP_INLINE_ONE_HOST_WAIT_US": "1000000",
                       "JAX_SMDDP_INLINE_ONE_HOST_BYTES": "16M",
                       **({} if hosts == "aa" else {"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"})},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in hosts])
  assert_all_ok(procs)
  for p in procs:
    r = p.result
    assert 256 << 10 <= r["output_bytes"] < 16 << 20, r  # the large calls: between the thresholds
    assert r["small"] == {"calls": 20, "inline_calls": 20}, r
    assert r["large"] == {"calls": 5, "inline_calls": 5 if hosts == "aa" else 0}, r


@pytest.mark.timeout(300)
def test_an_oversubscribed_host_takes_the_inline_policy_between_hosts():
  """With JAX_SMDDP_INLINE_ONE_HOST_BYTES unset, a host whose processes outnumber the cores they
  may use (2 processes bound to one core here) runs calls within it as calls between hosts:
  small ones (below JAX_SMDDP_INLINE_BYTES) on XLA's thread, large ones, which a host with the
  cores would run there too (64 MiB), on an engine worker. Right against numpy as above."""
  home = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(home)})  # the workers inherit it: 2 processes, 1 core
  try:
    procs = run_job(["inline"], 2, 1, timeout=240,
                    env={"JAX_SMDDP_INLINE_WAIT_US": "1000000", "JAX_SMDDP_INLINE_BYTES": "256K",
                         "JAX_SMDDP_INLINE_ONE_HOST_WAIT_US": "1000000"})
  finally:
    os.sched_setaffinity(0, home)
  assert_all_ok(procs)
  for p in procs:
    r = p.result
    assert 256 << 10 <= r["output_bytes"] < 16 << 20, r
    assert r["small"] == {"calls": 20, "inline_calls": 20}, r
    assert r["large"] == {"calls": 5, "inline_calls": 0}, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hierarchical", ["1", "0"])
def test_hierarchical_routes_cross_the_network_once_per_host(hierarchical):
  """2 hosts x 2 processes, one all_gather: with rails each process sends its
  block over the network once (to its rail partner) and relays the partner's
  over shared memory; flat, it sends it to both processes of the other host."""
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["traffic"], 4, 1, timeout=240,
                  env={"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm",
                       "JAX_SMDDP_ALGORITHM": "hierarchical" if hierarchical == "1" else "flat"},
                  per_process_env=[{"JAX_SMDDP_HOST_ID": h} for h in "aabb"])
  assert_all_ok(procs)
  header = 112  # the per-call agreement check (process_algorithms.cc Header), to every peer
  for p in procs:
    per_rank, traffic = p.result["per_rank"], p.result["traffic"]
    net = sum(v["sent"] - header for v in traffic.values() if v["link"].startswith("libfabric"))
    shm = sum(v["sent"] - header for v in traffic.values() if v["link"] == "shared memory")
    if hierarchical == "1":
      assert net == per_rank and shm == 2 * per_rank, traffic  # own block + the relayed one
    else:
      assert net == 2 * per_rank and shm == per_rank, traffic


def _default_provider() -> str:
  from jax_smddp import capabilities
  return capabilities.fabric()["default_provider"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("devices,provider", [(1, "tcp;ofi_rxm"), (2, "tcp;ofi_rxm"), (2, None)],
                         ids=["1-tcp;ofi_rxm", "2-tcp;ofi_rxm", "2-default"])
def test_two_hosts_over_libfabric_tcp(devices, provider):
  """2 simulated hosts x 2 processes: shared memory within, libfabric tcp between
  (tcp;ofi_rxm, or the default when JAX_SMDDP_FABRIC_PROVIDER is unset: net where
  libfabric 1.17 offers it)."""
  ran_in_first_suite(BETWEEN_HOSTS)
  need_netns()
  before = shm_names()
  with netns.two_hosts() as (names, ips):
    procs = run_job(["collectives"], 4, devices, timeout=300,
                           namespaces=[names[0], names[0], names[1], names[1]],
                           coordinator_ip=ips[0],
                           env={"JAX_SMDDP_FABRIC_PROVIDER": provider} if provider else None)
  assert_all_ok(procs)
  for p in procs:
    topo = p.result["topology"]
    assert topo["fabric_provider"] == (provider or _default_provider()), topo
    assert len(topo["shared_memory_peers"]) == 1 and len(topo["network_peers"]) == 2, topo
  assert shm_names() - before == set()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", None], ids=["tcp;ofi_rxm", "default"])
def test_four_hosts_over_libfabric_tcp(provider):
  """4 simulated hosts x 1 process on one bridge (netns.hosts): every
  collective against numpy, every process's peers all over libfabric."""
  ran_in_first_suite(BETWEEN_HOSTS)
  need_netns()
  with netns.hosts(4) as (names, ips):
    procs = run_job(["collectives"], 4, 1, timeout=300, namespaces=names, coordinator_ip=ips[0],
                    env={"JAX_SMDDP_FABRIC_PROVIDER": provider} if provider else None)
  assert_all_ok(procs)
  for p in procs:
    topo = p.result["topology"]
    assert topo["fabric_provider"] == (provider or _default_provider()), topo
    assert not topo["shared_memory_peers"] and len(topo["network_peers"]) == 3, topo
    # Four hosts by their ids, one machine by its kernel's boot id: their cores are this one's.
    assert topo["oversubscribed"] == oversubscribed_here(4), topo


def test_processes_of_different_fabric_providers_fail_naming_them():
  """Endpoints of two libfabric providers cannot reach each other: a peer on
  another host that opened another provider fails initialize() naming both
  processes, their hosts and providers, and the setting that fixes it."""
  from jax_smddp import distributed
  hosts = ["a", "b", "c"]
  distributed.check_fabric_providers(0, "net", {1: "net", 2: "net"}, hosts)  # alike: nothing
  with pytest.raises(RuntimeError) as e:
    distributed.check_fabric_providers(0, "net", {1: "net", 2: "tcp;ofi_rxm"}, hosts)
  msg = str(e.value)
  assert "process 0 (host a) opened libfabric provider 'net'" in msg, msg
  assert "process 2 (host c) opened 'tcp;ofi_rxm'" in msg and "process 1" not in msg, msg
  assert "JAX_SMDDP_FABRIC_PROVIDER" in msg, msg


@pytest.mark.timeout(300)
def test_processes_whose_libfabric_offers_different_providers_fail_at_initialize():
  """Two hosts (by JAX_SMDDP_HOST_ID) with JAX_SMDDP_FABRIC_PROVIDER unset, where
  process 1's libfabric hides net (FI_PROVIDER=^net, libfabric's own filter): process 0
  opens net, process 1 tcp;ofi_rxm. Both raise at initialize() within seconds, naming
  the other's provider, and neither is initialized."""
  if _default_provider() != "net":
    pytest.skip(f"this libfabric's default is {_default_provider()}, not net")
  procs = run_job(["provider_mismatch"], 2, 1, timeout=240,
                  per_process_env=[{"JAX_SMDDP_HOST_ID": "a"},
                                   {"JAX_SMDDP_HOST_ID": "b", "FI_PROVIDER": "^net"}])
  mine = {0: "net", 1: "tcp;ofi_rxm"}
  for p in procs:
    r = p.result
    assert r is not None and r["ok"] is False, launch.describe(procs)
    other = 1 - p.index
    assert (f"process {p.index} (host {'ab'[p.index]}) opened libfabric provider "
            f"'{mine[p.index]}'") in r["message"], r["message"]
    assert f"process {other} (host {'ab'[other]}) opened '{mine[other]}'" in r["message"], r
    assert "JAX_SMDDP_FABRIC_PROVIDER" in r["message"], r["message"]
    assert r["initialized"] is False and r["seconds"] < 60, r


def test_oversubscribed_counts_this_machines_processes_against_its_cores():
  from jax_smddp import distributed
  cores = len(os.sched_getaffinity(0))
  procs = [{"machine": "a"}] * cores + [{"machine": "b"}] * (cores + 1) + [{"machine": ""}] * 9
  assert not distributed.oversubscribed(procs, 0)  # one process per core on machine a
  assert distributed.oversubscribed(procs, cores)  # one too many on machine b
  assert not distributed.oversubscribed(procs, len(procs) - 1)  # no machine id: never
  assert distributed.oversubscribed(procs + [{"machine": "a"}], 0)


@pytest.mark.timeout(300)
def test_wait_polls_given_in_the_environment_hold_either_way():
  ran_in_first_suite(BETWEEN_HOSTS)
  procs = run_job(["collectives"], 3, 1, timeout=240, env={"JAX_SMDDP_YIELD": "77"})
  assert_all_ok(procs)
  crowded = oversubscribed_here(3)
  for p in procs:
    topo = p.result["topology"]
    assert topo["oversubscribed"] == crowded, topo
    assert topo["wait_polls"] == {"spin": 16 if crowded else 256, "yield": 77}, topo


@pytest.mark.timeout(400)
@pytest.mark.parametrize("direct_bytes,provider", [("512K", "tcp;ofi_rxm"), ("1", "tcp;ofi_rxm"),
                                                   ("512K", None)],
                         ids=["default", "all-direct", "default-provider"])
def test_two_hosts_dead_peer(direct_bytes, provider):
  if direct_bytes != "512K" or provider is not None:
    ran_in_first_suite(BETWEEN_HOSTS)  # the second suite runs the default provider's
  need_netns()
  with netns.two_hosts() as (names, ips):
    procs = run_job(["peer_killed_midway"], 2, 1, timeout=300,
                           namespaces=names, coordinator_ip=ips[0],
                           env={"JAX_SMDDP_FABRIC_DIRECT_BYTES": direct_bytes,
                                "JAX_SMDDP_TIMEOUT_S": "120",
                                **({"JAX_SMDDP_FABRIC_PROVIDER": provider} if provider else {})})
  assert procs[1].returncode == -9, launch.describe(procs)
  _check_peer_failure(procs, dead=1, within_s=30)


def test_launch_wrapper_goes_before_every_process(tmp_path, monkeypatch):
  """JAX_SMDDP_LAUNCH_WRAPPER (e.g. a debugger for a crash's native stack)
  runs every process under it, with the process's own arguments intact."""
  script = tmp_path / "report.py"
  script.write_text("import json, os, sys\n"
                    "print('RESULT ' + json.dumps({'ok': True, 'wrapped': os.environ.get('WRAPPED'),"
                    " 'argv': sys.argv[1:]}))\n")
  monkeypatch.setenv("JAX_SMDDP_LAUNCH_WRAPPER", "env WRAPPED=yes")
  procs = launch.run_job(["a b"], 2, 1, script=str(script), timeout=60)
  for i, p in enumerate(procs):
    assert p.returncode == 0 and p.result, launch.describe(procs)
    assert p.result["wrapped"] == "yes"
    assert p.result["argv"][:3] == ["a b", str(i), "2"], p.result


@pytest.mark.timeout(300)
def test_processes_with_different_tuner_inputs_agree(tmp_path):
  """Each process has its own calibration file and tuner settings; the tuner
  takes process 0's (published at initialize), so calls agree and every
  process makes process 0's choices."""
  from dataclasses import replace
  from jax_smddp import calibration, cost_model
  files = []
  for name, scale in (("fast", 4.0), ("slow", 0.05)):
    m = cost_model.CPU_REFERENCE
    path = tmp_path / f"{name}.json"
    calibration.save_machine(replace(m, name=name, copy_bw=m.copy_bw * scale,
                                     copy_bw_dram=m.copy_bw_dram * scale, source="calibrated"),
                             str(path))
    files.append(str(path))
  procs = run_job(["tuner_inputs"], 2, 2, timeout=240, per_process_env=[
      {"JAX_SMDDP_CALIBRATION": files[0]},
      {"JAX_SMDDP_CALIBRATION": files[1], "JAX_SMDDP_CHUNK_BYTES": "65536",
       "JAX_SMDDP_ALGORITHM": "hierarchical"}])
  assert_all_ok(procs)
  assert procs[0].result["choices"] == procs[1].result["choices"], launch.describe(procs)
  assert not any("forced" in c["reason"] for c in procs[0].result["choices"]), procs[0].result


@pytest.mark.timeout(300)
def test_settings_that_must_agree_are_process_zeros_everywhere():
  procs = run_job(["agreed_settings"], 2, 2, timeout=240, per_process_env=[
      {"JAX_SMDDP_FABRIC_CHUNK_BYTES": "128K"},
      {"JAX_SMDDP_FABRIC_CHUNK_BYTES": "64K", "JAX_SMDDP_HIERARCHICAL": "0",
       "JAX_SMDDP_GPU_SLOT_BYTES": "1M"}])
  assert_all_ok(procs)
  want = {"JAX_SMDDP_FABRIC_CHUNK_BYTES": 128 << 10, "JAX_SMDDP_HIERARCHICAL": None,
          "JAX_SMDDP_GPU_SLOT_BYTES": None}
  for p in procs:
    assert p.result["values"] == want, launch.describe(procs)
  assert "JAX_SMDDP_FABRIC_CHUNK_BYTES='64K' here but '128K' in process 0" in procs[1].output, \
      procs[1].output[-3000:]
