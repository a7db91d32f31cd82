"""Two simulated hosts on one machine: network namespaces joined by a veth pair.

Processes started with `ip netns exec <ns>` in different namespaces reach each
other only over the veth link (10.199.<k>.1 <-> 10.199.<k>.2), so jax_smddp
treats them as different hosts (its host id includes the network namespace)
and connects them through libfabric's tcp provider, as it would two machines.
Needs root (CAP_NET_ADMIN) and iproute2.
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


@contextlib.contextmanager
def two_hosts():
  """Yields ([ns_a, ns_b], [ip_a, ip_b]); removes both namespaces after."""
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
    yield names, ips
  finally:
    for ns in names:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
