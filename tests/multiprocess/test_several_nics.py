"""Several NICs per simulated host (netns.hosts(nics=2), every NIC capped): every collective
and dtype against numpy over striped links (one process with both NICs) and over NICs split
between a host's processes; each NIC carries traffic; a peer killed mid-transfer still fails the
survivors naming it."""

from __future__ import annotations

import os

import pytest

from helpers import need_netns, ran_in_first_suite
from jax_smddp.tools import launch, netns

# The second suite (scripts/test.sh) leaves these to the first: their subject is the C++
# transports and routes between processes, which Python and jax do not change.
BETWEEN_HOSTS = "the transports and routes between processes"

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
# Small stripes, so that the test's small messages are cut over both NICs too.
STRIPED = {"JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm", "JAX_SMDDP_NICS": "eth0,eth1",
           "JAX_SMDDP_FABRIC_STRIPE_BYTES": "4K"}


def _ok(procs):
  assert all(p.result and p.result.get("ok") for p in procs), launch.describe(procs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_host", [1, 2], ids=["one process striping", "processes split"])
def test_collectives_over_two_capped_nics(per_host):
  ran_in_first_suite(BETWEEN_HOSTS)
  need_netns()
  with netns.two_hosts("1gbit", nics=2) as (names, ips):
    before = netns.interface_bytes(names[0])
    procs = launch.run_job(["collectives"], 2 * per_host, 1, script=WORKER, timeout=240,
                           namespaces=[n for n in names for _ in range(per_host)],
                           coordinator_ip=ips[0], env=STRIPED)
    after = netns.interface_bytes(names[0])
  _ok(procs)
  sent = {i: after[i]["tx"] - before[i]["tx"] for i in ("eth0", "eth1")}
  # eth0 also carries the coordinator's traffic; the collectives' bytes go over both.
  assert min(sent.values()) > 50_000, sent
  for p in procs:
    topo = p.result["topology"]
    names_ = [n["name"] for n in topo["nics"]]
    assert names_ == (["eth0", "eth1"] if per_host == 1 else [f"eth{p.index % 2}"]), topo
    links = {v["link"] for v in p.result["traffic"].values() if v["link"] != "shared memory"}
    if per_host == 1:
      assert links == {"libfabric tcp;ofi_rxm striped over 2 NIC pairs"}, links


@pytest.mark.timeout(300)
def test_peer_killed_mid_transfer_over_striped_nics_is_named():
  ran_in_first_suite(BETWEEN_HOSTS)
  need_netns()
  with netns.two_hosts("1gbit", nics=2) as (names, ips):
    procs = launch.run_job(["peer_killed_midway"], 2, 1, script=WORKER, timeout=240,
                           namespaces=names, coordinator_ip=ips[0],
                           env={**STRIPED, "JAX_SMDDP_FABRIC_STRIPE_BYTES": "256K",
                                "JAX_SMDDP_TIMEOUT_S": "120"})
  assert procs[1].returncode == -9, launch.describe(procs)
  survivor = procs[0]
  assert survivor.result is not None and not survivor.result["ok"], launch.describe(procs)
  assert "process 1 (devices" in survivor.result["error"], survivor.result["error"]
  assert survivor.result["seconds"] < 30, survivor.result


@pytest.mark.timeout(300)
def test_doctor_job_shows_each_processes_nics():
  """`python -m jax_smddp.doctor --job` in each process of 2 hosts x 2 processes with two NICs
  per host: each process names the NIC its local rank took."""
  ran_in_first_suite(BETWEEN_HOSTS)
  import json
  import subprocess
  import sys
  need_netns()
  with netns.two_hosts(None, nics=2) as (names, ips):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SMDDP_NICS": "eth0,eth1",
           "JAX_SMDDP_FABRIC_PROVIDER": "tcp;ofi_rxm"}
    port = 29000 + os.getpid() % 1000
    procs = [subprocess.Popen(["ip", "netns", "exec", names[i // 2], sys.executable, "-m",
                               "jax_smddp.doctor", "--job", "--coordinator", f"{ips[0]}:{port}",
                               "--num-processes", "4", "--process-id", str(i), "--json"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    outs = [p.communicate(timeout=200) for p in procs]
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out + err
    rows = {r["component"].strip(): r for r in json.loads(out)["rows"]}
    ip = netns.nic_ips(ips, i % 2)[i // 2]
    assert rows["nics"]["detail"].startswith(f"process {i}: eth{i % 2} ({ip}), chosen by "
                                             "JAX_SMDDP_NICS"), rows["nics"]


@pytest.mark.timeout(300)
def test_direct_exchange_over_a_capped_link():
  """Two hosts exchanging 4 MiB each way over a 1 Gbit/s link by direct transfers (the default
  above 512 KiB, each side's clear-to-send sent ahead of its own bytes), started together and
  right against numpy; the cap held (the link was the bound)."""
  ran_in_first_suite(BETWEEN_HOSTS)
  need_netns()
  with netns.two_hosts("1gbit") as (names, ips):
    procs = launch.run_job(["capped_exchange"], 2, 1, script=WORKER, timeout=240,
                           namespaces=names, coordinator_ip=ips[0],
                           env={"JAX_SMDDP_FABRIC_DIRECT_BYTES": "512K"})
  _ok(procs)
  for p in procs:
    assert min(p.result["walls"]) > 0.9 * (4 << 20) / 125e6, p.result["walls"]
