"""Simulated hosts on one machine: network namespaces joined by a veth pair
(two_hosts), or several on one bridge (hosts).

Processes started with `ip netns exec <ns>` in different namespaces reach each
other only over the veth links (10.199.<k>.1, 10.199.<k>.2, ...), so jax_smddp
treats them as different hosts (its host id includes the network namespace)
and connects them through libfabric's tcp provider, as it would machines.
Needs root (CAP_NET_ADMIN) and iproute2.

With `rate` (tc's notation: "1gbit", "100mbit") each host's link is capped in
both directions by a token-bucket qdisc (`tc ... tbf`; `netem` is not in every
kernel), so that the link, not the machine's cores, bounds what crosses it, as
on a cluster's network.

With `nics` > 1 each host gets that many interfaces, eth0 .. eth<nics-1>, each
its own veth pair (to the other host, or to a bridge of its own) on a subnet of
its own (NIC i: 10.<199 - i>.<k>.<host + 1>), each capped at `rate`: a rail per
NIC, as on a cluster whose hosts have several NICs. `nic_ips(ips, i)` gives
NIC i's addresses. Both namespaces' eth0 carry the addresses yielded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def available() -> str | None:
  """None when namespaces can be made here, else why not."""
  if shutil.which("ip") is None:
    return "iproute2 (`ip`) is not installed"
  if os.geteuid() != 0:
    return "creating network namespaces needs root"
  return None


def _ip(*args: str) -> None:
  subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


# The token bucket: a burst of two GSO packets' worth, a queue deep enough that TCP is never
# starved by drops at these rates. A full bucket passes BURST_BYTES at the interface's own
# speed, so a call's first BURST_BYTES can beat the cap: the benchmark bounds that
# (link_floor_us; with 256 KiB, rows of 256 KiB per host read up to 1.8x "the link").
# 64 KiB, one GSO packet, cost the kernel a core's time per capped link here (2x2x1
# --nics 2: 100 ms of CPU per 4 MiB all_gather against 24 ms at 128 KiB).
BURST_BYTES = 128 << 10
TBF = ("burst", f"{BURST_BYTES >> 10}kb", "latency", "200ms")


def cap(namespace: str, device: str, rate: str) -> None:
  """Caps what `device` (in `namespace`) sends to `rate` (tc's notation); raises naming tc's
  complaint when the rate is not one tc reads."""
  run = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device,
                        "root", "tbf", "rate", rate, *TBF], capture_output=True, text=True)
  if run.returncode != 0:
    raise ValueError(f"cannot cap {device} in {namespace} at {rate!r} (tc: "
                     f"{run.stderr.strip()}); give a rate as tc writes it, e.g. 1gbit, 500mbit")


def nic_ips(ips: list[str], nic: int) -> list[str]:
  """The addresses of NIC `nic` of the hosts whose NIC 0 has `ips` (as two_hosts and hosts
  number them)."""
  return [f"10.{199 - nic}.{ip.split('.', 2)[2]}" for ip in ips]


def _check_nics(nics: int) -> None:
  if not 1 <= nics <= 8:
    raise ValueError(f"{nics} NICs per simulated host: 1 to 8 are supported")


@contextlib.contextmanager
def two_hosts(rate: str | None = None, nics: int = 1):
  """Yields ([ns_a, ns_b], [ip_a, ip_b]) (NIC 0's addresses); removes both namespaces after.
  `rate` caps each end's sending (so the link, each way), on every NIC."""
  _check_nics(nics)
  tag = f"{os.getpid() % 100000}"
  k = os.getpid() % 200 + 20
  names = [f"smddp_a{tag}", f"smddp_b{tag}"]
  ips = [f"10.199.{k}.1", f"10.199.{k}.2"]
  # Names of this process id that exist already are a killed run's leftovers
  # (process ids are reused): removed, or the adds below would fail.
  for ns in names:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
  for i in range(nics):
    subprocess.run(["ip", "link", "del", f"sva{tag}n{i}"], capture_output=True)
  try:
    for ns in names:
      _ip("netns", "add", ns)
      _ip("-n", ns, "link", "set", "lo", "up")
    for i in range(nics):
      veth = [f"sva{tag}n{i}", f"svb{tag}n{i}"]
      _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
      for ns, dev, ip in zip(names, veth, nic_ips(ips, i)):
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", ns, "link", "set", dev, "name", f"eth{i}")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", f"eth{i}")
        _ip("-n", ns, "link", "set", f"eth{i}", "up")
        if rate:
          cap(ns, f"eth{i}", rate)
    yield names, ips
  finally:
    for ns in names:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def hosts(count: int, rate: str | None = None, nics: int = 1):
  """Yields (namespaces, ips) of `count` simulated hosts (NIC 0's addresses), each NIC of each
  host joined by a veth pair to a bridge of that NIC's (a rail) that lives in a namespace of
  its own (the machine's own network is not touched); removes them all after. `rate` caps
  each host's link both ways on every NIC (its sending, and the bridge port's sending to
  it)."""
  if count == 2:
    with two_hosts(rate, nics) as joined:
      yield joined
    return
  if not 2 <= count <= 32:
    raise ValueError(f"{count} simulated hosts: 2 to 32 are supported")
  _check_nics(nics)
  tag = f"{os.getpid() % 100000}"
  k = os.getpid() % 200 + 20
  switch = f"smddp_s{tag}"
  names = [f"smddp_{h}h{tag}" for h in range(count)]
  ips = [f"10.199.{k}.{h + 1}" for h in range(count)]
  for ns in (switch, *names):  # a killed run's leftovers of this process id
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
  try:
    _ip("netns", "add", switch)
    for i in range(nics):
      _ip("-n", switch, "link", "add", f"br{i}", "type", "bridge")
      _ip("-n", switch, "link", "set", f"br{i}", "up")
    for h, ns in enumerate(names):
      _ip("netns", "add", ns)
      _ip("-n", ns, "link", "set", "lo", "up")
      for i in range(nics):
        ip, port = nic_ips(ips, i)[h], f"p{h}n{i}"
        # Made inside the switch's namespace, one end moved to the host's.
        _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", f"eth{i}",
            "netns", ns)
        _ip("-n", switch, "link", "set", port, "master", f"br{i}")
        _ip("-n", switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", f"eth{i}")
        _ip("-n", ns, "link", "set", f"eth{i}", "up")
        if rate:
          cap(ns, f"eth{i}", rate)
          cap(switch, port, rate)
    yield names, ips
  finally:
    for ns in (*names, switch):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def interface_bytes(namespace: str | None = None) -> dict[str, dict[str, int]]:
  """{interface: {"tx": bytes sent, "rx": bytes received}} of every interface but loopback,
  from the kernel's counters (/sys/class/net/*/statistics; in `namespace` through `ip -n
  <namespace> -s -j link` when given, since a process's /sys shows its own namespace's)."""
  if namespace is None:
    out = {}
    root = "/sys/class/net"
    for name in sorted(os.listdir(root)):
      if name == "lo":
        continue
      try:
        with open(f"{root}/{name}/statistics/tx_bytes") as f:
          tx = int(f.read())
        with open(f"{root}/{name}/statistics/rx_bytes") as f:
          rx = int(f.read())
      except OSError:
        continue
      out[name] = {"tx": tx, "rx": rx}
    return out
  import json
  run = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link"], check=True,
                       capture_output=True, text=True)
  return {d["ifname"]: {"tx": d["stats64"]["tx"]["bytes"], "rx": d["stats64"]["rx"]["bytes"]}
          for d in json.loads(run.stdout) if d["ifname"] != "lo"}
