"""Which NICs a process sends by to other hosts (JAX_SMDDP_NICS), and which NIC pairs link
two processes.

A p4d node has 8 GPUs and 4 EFA NICs, a p5 8 GPUs and 32: one NIC per host leaves most of a
node's network idle. Each process therefore opens one libfabric endpoint per NIC it is given
and stripes its messages to a peer over the NIC pairs between them (the engine's striped link,
xla_ffi/transports/striped_link.h). Which NICs:

- JAX_SMDDP_NICS, a comma list (interface names, IP addresses, ``domain:<libfabric domain>``)
  names the host's NICs; the host's processes split them evenly by local rank
  (split_evenly()); a list of one pins a process to it.
- auto, on EFA (devices bound to the ``efa`` driver in /sys/class/infiniband): one libfabric
  domain per EFA device, each GPU taking the devices nearest it on the PCIe tree (fewest hops
  between the two in /sys/devices, as aws-ofi-nccl groups NICs with GPUs), the GPUs that share
  the same nearest devices splitting them by their order (efa_choice()).
- auto, elsewhere: the interface that reaches the coordinator (one NIC).

Everything that reads the machine takes its root (``sysfs``) so that the tests run it on a
fake tree.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _ioctl_ipv4(sock, request: int, name: str) -> str | None:
  try:
    packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name[:15].encode()))
  except OSError:
    return None
  return socket.inet_ntoa(packed[20:24])


def interfaces() -> list[dict]:
  """This network namespace's interfaces with an IPv4 address, loopback left out:
  [{"name", "address", "network"}] ("network": "10.199.5.0/24")."""
  out = []
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in sorted(socket.if_nameindex()):
      if name == "lo":
        continue
      address = _ioctl_ipv4(s, _SIOCGIFADDR, name)
      mask = _ioctl_ipv4(s, _SIOCGIFNETMASK, name)
      if address is None:
        continue
      network = str(ipaddress.ip_network(f"{address}/{mask or '255.255.255.255'}", strict=False))
      out.append({"name": name, "address": address, "network": network})
  return out


def split_evenly(items: list, local_rank: int, local_count: int) -> list:
  """The share of `items` (a host's NICs) of the process with `local_rank` among
  `local_count` processes: every local_count-th one from local_rank when there are at least as
  many items as processes (4 NICs, 2 processes: 0 and 2, 1 and 3), else one, shared by the
  processes local_rank % len(items) picks."""
  if not items:
    return []
  if local_count <= 0 or not 0 <= local_rank < local_count:
    raise ValueError(f"local rank {local_rank} of {local_count} processes")
  if len(items) >= local_count:
    return items[local_rank::local_count]
  return [items[local_rank % len(items)]]


def parse_nics(text: str, known: list[dict]) -> list[dict]:
  """JAX_SMDDP_NICS's list as NICs ({"name", "node", "network"}): an interface name or an
  address of this host's (`known`: interfaces()), or ``domain:<name>``; raises ValueError
  naming an entry that is none of these."""
  out = []
  for entry in (e.strip() for e in text.split(",")):
    if not entry:
      continue
    if entry.startswith("domain:"):
      out.append({"name": entry[len("domain:"):], "node": entry, "network": None})
      continue
    match = next((i for i in known if entry in (i["name"], i["address"])), None)
    if match is None:
      have = ", ".join(f"{i['name']} ({i['address']})" for i in known) or "none"
      raise ValueError(f"JAX_SMDDP_NICS names {entry!r}, which is neither an interface nor an "
                       f"address of this host (its interfaces: {have}) nor domain:<name>")
    out.append({"name": match["name"], "node": match["address"], "network": match["network"]})
  return out


# ---- the PCIe tree (sysfs), for EFA -------------------------------------------------------


def pcie_path(sysfs: str, bdf: str) -> list[str]:
  """The chain of PCI devices from the root complex down to device `bdf` ("0000:10:1c.0"):
  the directories of its /sys/devices path ("pci0000:00", "0000:00:01.0", ..., bdf)."""
  real = os.path.realpath(os.path.join(sysfs, "bus", "pci", "devices", bdf))
  devices = os.path.realpath(os.path.join(sysfs, "devices"))
  rel = os.path.relpath(real, devices)
  if rel.startswith(".."):
    raise ValueError(f"PCI device {bdf} is not under {devices}")
  return rel.split(os.sep)


def pcie_distance(a: list[str], b: list[str]) -> int:
  """Hops between two devices on the PCIe tree (pcie_path()s): up from one to the nearest bridge
  they share, down to the other; across root complexes, both paths' lengths plus one."""
  common = 0
  for x, y in zip(a, b):
    if x != y:
      break
    common += 1
  return (len(a) - common) + (len(b) - common) + (1 if common == 0 else 0)


def efa_devices(sysfs: str = "/sys") -> list[dict]:
  """The EFA devices (/sys/class/infiniband/* bound to the efa driver), in PCI order:
  [{"name": "rdmap16s27", "pci": "0000:10:1b.0", "domain": "rdmap16s27-rdm"}] (libfabric's efa
  provider names its RDM domain after the device)."""
  root = os.path.join(sysfs, "class", "infiniband")
  out = []
  try:
    names = sorted(os.listdir(root))
  except OSError:
    return []
  for name in names:
    device = os.path.join(root, name, "device")
    driver = os.path.basename(os.path.realpath(os.path.join(device, "driver")))
    if driver != "efa":
      continue
    out.append({"name": name, "pci": os.path.basename(os.path.realpath(device)),
                "domain": f"{name}-rdm"})
  return sorted(out, key=lambda d: d["pci"])


def gpus(sysfs: str = "/sys") -> list[str]:
  """The PCI addresses of the NVIDIA GPUs (devices bound to the nvidia driver), sorted: CUDA's
  order with CUDA_DEVICE_ORDER=PCI_BUS_ID, the usual one-process-per-GPU launch's."""
  root = os.path.join(sysfs, "bus", "pci", "drivers", "nvidia")
  try:
    return sorted(e for e in os.listdir(root) if e.count(":") == 2)
  except OSError:
    return []


def nearest(sysfs: str, gpu: str, nics: list[dict]) -> list[dict]:
  """The NICs (each with "pci") at the fewest PCIe hops from GPU `gpu`, in their order."""
  where = pcie_path(sysfs, gpu)
  hops = [pcie_distance(where, pcie_path(sysfs, n["pci"])) for n in nics]
  best = min(hops)
  return [n for n, h in zip(nics, hops) if h == best]


def efa_choice(sysfs: str, gpu_index: int) -> list[dict]:
  """The EFA devices of the process driving the host's `gpu_index`-th GPU (gpus()'s order): the
  devices nearest its GPU, split evenly among the GPUs whose nearest devices are the same ones
  (a p4d's 2 GPUs per NIC share it; a p5's GPU takes its 4). Without GPUs the devices are
  split by `gpu_index` as a local rank. [] where there is no EFA device."""
  devices = efa_devices(sysfs)
  if not devices:
    return []
  all_gpus = gpus(sysfs)
  if not all_gpus:
    return devices  # split by the caller, by local rank
  gpu_index %= len(all_gpus)
  near = {g: tuple(d["name"] for d in nearest(sysfs, g, devices)) for g in all_gpus}
  mine = near[all_gpus[gpu_index]]
  group = [g for g in all_gpus if near[g] == mine]
  share = split_evenly(list(mine), group.index(all_gpus[gpu_index]), len(group))
  return [d for d in devices if d["name"] in share]


def choose(setting: str | None, local_rank: int, local_count: int, coordinator_node: str,
           *, sysfs: str = "/sys", provider: str = "", known: list[dict] | None = None
           ) -> tuple[list[dict], str]:
  """This process's NICs ({"name", "node", "network"}; "node" is what the endpoint opens on)
  and how they were chosen (for messages and the doctor). `setting`: JAX_SMDDP_NICS (None or
  "auto": the platform's topology); `coordinator_node`: the address that reaches the
  coordinator (auto's one NIC off EFA); `provider`: JAX_SMDDP_FABRIC_PROVIDER as set ("" when
  unset)."""
  if setting and setting.strip().lower() != "auto":
    listed = parse_nics(setting, interfaces() if known is None else known)
    if not listed:
      raise ValueError("JAX_SMDDP_NICS lists no NIC")
    return (split_evenly(listed, local_rank, local_count),
            f"JAX_SMDDP_NICS, split by local rank {local_rank} of {local_count}")
  if provider in ("", "efa"):
    devices = efa_devices(sysfs)
    if devices:
      chosen = efa_choice(sysfs, local_rank)
      how = "EFA devices nearest this process's GPU (PCIe hops)"
      if not gpus(sysfs):
        chosen = split_evenly(chosen, local_rank, local_count)
        how = f"EFA devices split by local rank {local_rank} of {local_count}"
      return ([{"name": d["name"], "node": f"domain:{d['domain']}", "network": None}
               for d in chosen], how)
  known = interfaces() if known is None else known
  match = next((i for i in known if i["address"] == coordinator_node), None)
  return ([{"name": match["name"] if match else (coordinator_node or "default"),
            "node": coordinator_node, "network": match["network"] if match else None}],
          "the interface that reaches the coordinator")


def pairs(mine: list[dict], theirs: list[dict], me: int, peer: int) -> list[tuple[int, int]]:
  """The NIC pairs (this process's NIC index, the peer's) that link process `me` to `peer`, in
  an order both derive alike: NICs on one network (rails) are paired where some but not all
  pairs share a network; otherwise the i-th stripe pairs NIC i % len of each side, over
  max(len) stripes (one per NIC of the side with more)."""
  a, b = (mine, theirs) if me < peer else (theirs, mine)
  same = [(i, j) for i, x in enumerate(a) for j, y in enumerate(b)
          if x.get("network") and x.get("network") == y.get("network")]
  if not same or len(same) == len(a) * len(b):
    n = max(len(a), len(b))
    same = [(s % len(a), s % len(b)) for s in range(n)]
  return same if me < peer else [(j, i) for i, j in same]
