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


# The token bucket: a burst of a few packets' worth, a queue deep enough that TCP is never
# starved by drops at these rates.
TBF = ("burst", "256kb", "latency", "200ms")


def cap(namespace: str, device: str, rate: str) -> None:
  """Caps what `device` (in `namespace`) sends to `rate` (tc's notation); raises naming tc's
  complaint when the rate is not one tc reads."""
  run = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device,
                        "root", "tbf", "rate", rate, *TBF], capture_output=True, text=True)
  if run.returncode != 0:
    raise ValueError(f"cannot cap {device} in {namespace} at {rate!r} (tc: "
                     f"{run.stderr.strip()}); give a rate as tc writes it, e.g. 1gbit, 500mbit")


@contextlib.contextmanager
def two_hosts(rate: str | None = None):
  """Yields ([ns_a, ns_b], [ip_a, ip_b]); removes both namespaces after. `rate` caps each
  end's sending (so the link, each way)."""
  tag = f"{os.getpid() % 100000}"
  k = os.getpid() % 200 + 20
  names = [f"smddp_a{tag}", f"smddp_b{tag}"]
  ips = [f"10.199.{k}.1", f"10.199.{k}.2"]
  veth = [f"sva{tag}", f"svb{tag}"]
  # Names of this process id that exist already are a killed run's leftovers
  # (process ids are reused): removed, or the adds below would fail.
  for ns in names:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
  subprocess.run(["ip", "link", "del", veth[0]], capture_output=True)
  try:
    for ns in names:
      _ip("netns", "add", ns)
      _ip("-n", ns, "link", "set", "lo", "up")
    _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
    for ns, dev, ip in zip(names, veth, ips):
      _ip("link", "set", dev, "netns", ns)
      _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
      _ip("-n", ns, "link", "set", dev, "up")
      if rate:
        cap(ns, dev, rate)
    yield names, ips
  finally:
    for ns in names:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def hosts(count: int, rate: str | None = None):
  """Yields (namespaces, ips) of `count` simulated hosts, each joined by a
  veth pair to one bridge that lives in a namespace of its own (the machine's
  own network is not touched); removes them all after. `rate` caps each host's
  link both ways (its sending, and the bridge port's sending to it)."""
  if count == 2:
    with two_hosts(rate) as joined:
      yield joined
    return
  if not 2 <= count <= 32:
    raise ValueError(f"{count} simulated hosts: 2 to 32 are supported")
  tag = f"{os.getpid() % 100000}"
  k = os.getpid() % 200 + 20
  switch = f"smddp_s{tag}"
  names = [f"smddp_{h}h{tag}" for h in range(count)]
  ips = [f"10.199.{k}.{h + 1}" for h in range(count)]
  for ns in (switch, *names):  # a killed run's leftovers of this process id
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
  try:
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for h, (ns, ip) in enumerate(zip(names, ips)):
      _ip("netns", "add", ns)
      _ip("-n", ns, "link", "set", "lo", "up")
      # Made inside the switch's namespace, one end moved to the host's.
      _ip("-n", switch, "link", "add", f"p{h}", "type", "veth", "peer", "name", "eth0",
          "netns", ns)
      _ip("-n", switch, "link", "set", f"p{h}", "master", "br0")
      _ip("-n", switch, "link", "set", f"p{h}", "up")
      _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
      _ip("-n", ns, "link", "set", "eth0", "up")
      if rate:
        cap(ns, "eth0", rate)
        cap(switch, f"p{h}", rate)
    yield names, ips
  finally:
    for ns in (*names, switch):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
