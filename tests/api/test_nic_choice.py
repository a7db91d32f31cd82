"""NIC choice (jax_smddp/nics.py): the split by local rank, JAX_SMDDP_NICS, the NIC pairs two
processes stripe over, and EFA devices matched to GPUs by PCIe distance on a fake sysfs tree."""

from __future__ import annotations

import os

import pytest

from jax_smddp import nics

KNOWN = [{"name": "eth0", "address": "10.199.5.1", "network": "10.199.5.0/24"},
         {"name": "eth1", "address": "10.198.5.1", "network": "10.198.5.0/24"},
         {"name": "eth2", "address": "10.197.5.1", "network": "10.197.5.0/24"},
         {"name": "eth3", "address": "10.196.5.1", "network": "10.196.5.0/24"}]


def test_processes_split_a_hosts_nics_evenly():
  four = ["n0", "n1", "n2", "n3"]
  assert [nics.split_evenly(four, r, 2) for r in range(2)] == [["n0", "n2"], ["n1", "n3"]]
  assert [nics.split_evenly(four, r, 4) for r in range(4)] == [["n0"], ["n1"], ["n2"], ["n3"]]
  assert nics.split_evenly(four, 0, 1) == four
  # More processes than NICs: each takes one, shared round the processes.
  assert [nics.split_evenly(["n0", "n1"], r, 4) for r in range(4)] == [["n0"], ["n1"], ["n0"],
                                                                        ["n1"]]
  with pytest.raises(ValueError):
    nics.split_evenly(four, 2, 2)


def test_the_setting_names_interfaces_or_addresses_and_pins_them():
  chosen, how = nics.choose("eth0,eth1", 1, 2, "10.199.5.1", known=KNOWN)
  assert [c["name"] for c in chosen] == ["eth1"] and chosen[0]["node"] == "10.198.5.1"
  assert "JAX_SMDDP_NICS" in how
  chosen, _ = nics.choose("10.197.5.1", 0, 1, "10.199.5.1", known=KNOWN)  # one: pinned
  assert chosen == [{"name": "eth2", "node": "10.197.5.1", "network": "10.197.5.0/24"}]
  chosen, _ = nics.choose("domain:rdmap16s27-rdm", 0, 1, "", known=KNOWN)
  assert chosen[0]["node"] == "domain:rdmap16s27-rdm"
  with pytest.raises(ValueError, match="'eth9'.*eth0 \\(10.199.5.1\\)"):
    nics.choose("eth0,eth9", 0, 1, "10.199.5.1", known=KNOWN)


def test_auto_off_efa_takes_the_interface_that_reaches_the_coordinator(tmp_path):
  chosen, how = nics.choose(None, 0, 2, "10.198.5.1", sysfs=str(tmp_path), known=KNOWN)
  assert [c["name"] for c in chosen] == ["eth1"] and "coordinator" in how


def _pairs_both_ways(a, b):
  mine = nics.pairs(a, b, 0, 1)
  theirs = nics.pairs(b, a, 1, 0)
  assert [(j, i) for i, j in theirs] == mine, "both ends must list the same pairs in one order"
  return mine


def test_nic_pairs_are_rails_where_networks_say_so_and_agree_at_both_ends():
  e = [{"network": k["network"]} for k in KNOWN]
  assert _pairs_both_ways(e[:2], e[:2]) == [(0, 0), (1, 1)]  # rail to rail
  assert _pairs_both_ways([e[0]], e[:2]) == [(0, 0)]  # one NIC meets its rail only
  assert _pairs_both_ways([e[0]], [e[1]]) == [(0, 0)]  # no common rail: routed across
  one_net = [{"network": "10.0.0.0/16"}] * 2
  assert _pairs_both_ways(one_net, one_net) == [(0, 0), (1, 1)]  # one network: by index
  efa = [{"network": None}] * 4
  assert _pairs_both_ways(efa, efa[:2]) == [(0, 0), (1, 1), (2, 0), (3, 1)]


def _device(root, chain):
  """Makes /sys/devices/<chain...> and /sys/bus/pci/devices/<last> pointing at it."""
  path = os.path.join(root, "devices", *chain)
  os.makedirs(path, exist_ok=True)
  link_dir = os.path.join(root, "bus", "pci", "devices")
  os.makedirs(link_dir, exist_ok=True)
  os.symlink(os.path.relpath(path, link_dir), os.path.join(link_dir, chain[-1]))
  return path


def _driver(root, device_path, driver, bdf):
  d = os.path.join(root, "bus", "pci", "drivers", driver)
  os.makedirs(d, exist_ok=True)
  if not os.path.exists(os.path.join(device_path, "driver")):
    os.symlink(os.path.relpath(d, device_path), os.path.join(device_path, "driver"))
  os.symlink(os.path.relpath(device_path, d), os.path.join(d, bdf))


def _efa(root, name, device_path):
  ib = os.path.join(root, "class", "infiniband", name)
  os.makedirs(ib)
  os.symlink(os.path.relpath(device_path, ib), os.path.join(ib, "device"))


def fake_node(root, switches, gpus_per_switch, nics_per_switch):
  """A node of PCIe switches under two root complexes, each switch with its GPUs and EFA
  devices (a p4d: 4 switches x 2 GPUs x 1 NIC; a p5-like: 4 x 2 x 4)."""
  for s in range(switches):
    rc = f"pci0000:{s // 2:02x}"
    sw = [rc, f"0000:{s // 2:02x}:0{s % 2 + 1}.0", f"0000:{16 * s + 1:02x}:00.0"]
    for g in range(gpus_per_switch):
      bdf = f"0000:{16 * s + 2 + g:02x}:00.0"
      _driver(root, _device(root, [*sw, bdf]), "nvidia", bdf)
    for k in range(nics_per_switch):
      bdf = f"0000:{16 * s + 8 + k:02x}:00.0"
      path = _device(root, [*sw, bdf])
      _driver(root, path, "efa", bdf)
      _efa(root, f"rdmap{16 * s + 8 + k}s0", path)


def test_pcie_distance_counts_hops_through_the_nearest_shared_bridge(tmp_path):
  root = str(tmp_path)
  fake_node(root, 2, 1, 1)
  gpu0, nic0, nic1 = "0000:02:00.0", "0000:08:00.0", "0000:18:00.0"
  a, b, c = (nics.pcie_path(root, x) for x in (gpu0, nic0, nic1))
  assert a[-1] == gpu0 and a[0] == "pci0000:00"
  assert nics.pcie_distance(a, b) == 2  # up to the switch, down to the NIC
  assert nics.pcie_distance(a, c) == 6  # up to the root complex's port, across, down
  assert nics.pcie_distance(a, a) == 0


def test_efa_gpus_take_their_nearest_nics_p4d_like(tmp_path):
  """4 switches, 2 GPUs and 1 NIC each: the 2 GPUs of a switch share its NIC."""
  root = str(tmp_path)
  fake_node(root, 4, 2, 1)
  assert len(nics.gpus(root)) == 8 and len(nics.efa_devices(root)) == 4
  got = [[d["name"] for d in nics.efa_choice(root, g)] for g in range(8)]
  assert got == [["rdmap8s0"]] * 2 + [["rdmap24s0"]] * 2 + [["rdmap40s0"]] * 2 + \
      [["rdmap56s0"]] * 2
  chosen, how = nics.choose(None, 3, 8, "10.0.0.1", sysfs=root, known=KNOWN)
  assert chosen == [{"name": "rdmap24s0", "node": "domain:rdmap24s0-rdm", "network": None}]
  assert "PCIe" in how


def test_efa_gpus_split_the_nics_of_their_switch_p5_like(tmp_path):
  """4 NICs and 2 GPUs behind each switch: each GPU takes 2 of its switch's NICs, none
  another switch's."""
  root = str(tmp_path)
  fake_node(root, 4, 2, 4)
  got = [[d["name"] for d in nics.efa_choice(root, g)] for g in range(8)]
  assert got[0] == ["rdmap8s0", "rdmap10s0"] and got[1] == ["rdmap9s0", "rdmap11s0"]
  assert sorted(got[0] + got[1]) == sorted(f"rdmap{8 + k}s0" for k in range(4))
  assert all(len(g) == 2 for g in got)
  assert len({n for g in got for n in g}) == 16  # every NIC used, once


def test_efa_without_gpus_splits_by_local_rank(tmp_path):
  root = str(tmp_path)
  fake_node(root, 2, 0, 2)
  chosen, how = nics.choose("auto", 1, 2, "", sysfs=root, known=KNOWN)
  assert [c["name"] for c in chosen] == ["rdmap9s0", "rdmap25s0"] and "local rank" in how
