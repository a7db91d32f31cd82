"""The raw link reference of the benchmark between hosts
(jax_smddp.tools.link_probe), over loopback, and the bytes each host must
receive that it is compared with (bench.interhost_bytes_per_host)."""

from __future__ import annotations

import socket
import threading

import pytest

from jax_smddp.tools import bench, link_probe


@pytest.mark.timeout(300)
def test_link_probe_over_loopback():
  link = link_probe.measure(nbytes=4 << 20, rounds=3)
  assert link["bytes"] == 4 << 20 and len(link["rounds_gbs"]) == 3
  assert all(rate > 0 for rate in link["rounds_gbs"]), link
  assert sorted(link["rounds_gbs"])[1] == link["each_way_gbs"]


@pytest.mark.timeout(120)
def test_link_probe_checks_what_arrives():
  """A round whose bytes are another round's is an error, not a rate, on both ends."""
  a, b = socket.socketpair()
  with a, b:
    peer_error = []

    def peer():  # sends round 1's bytes where round 0's are expected
      try:
        link_probe._exchange(b, 1 << 16, 1, 1)
      except ValueError as e:
        peer_error.append(e)

    thread = threading.Thread(target=peer)
    thread.start()
    with pytest.raises(ValueError, match="another round or side"):
      link_probe._exchange(a, 1 << 16, 0, 0)
    thread.join()
    assert peer_error and "another round or side" in str(peer_error[0])


def test_interhost_bytes_per_host():
  two_by_one = bench.Layout(2, 1, 1)   # 2 hosts x 1 process x 1 device: n = 2
  two_by_two = bench.Layout(2, 2, 1)   # n = 4, 2 ranks per host
  size = 1 << 20
  assert bench.interhost_bytes_per_host("all_gather", size, two_by_one) == size
  assert bench.interhost_bytes_per_host("all_gather", size, two_by_two) == 2 * size
  assert bench.interhost_bytes_per_host("reduce_scatter", size, two_by_one) == size // 2
  assert bench.interhost_bytes_per_host("reduce_scatter", size, two_by_two) == size // 2
  assert bench.interhost_bytes_per_host("all_reduce", size, two_by_one) == size
  assert bench.interhost_bytes_per_host("all_to_all", size, two_by_two) == size
  # 1 ms at 1 GB/s: the link reference of a 1 MB all_gather between 2 hosts.
  assert bench.link_us("all_gather", 10**6, two_by_one, 1.0) == pytest.approx(1000.0)
  # The floor: a capped link's full bucket passes its burst at once (never below nothing).
  assert bench.link_us("all_gather", 10**6, two_by_one, 1.0, burst_bytes=10**5) == \
      pytest.approx(900.0)
  assert bench.link_us("reduce_scatter", 10**5, two_by_one, 1.0, burst_bytes=10**5) == 0.0


def _namespaces_here():
  from jax_smddp.tools import netns
  import shutil
  why = netns.available() or (None if shutil.which("tc") else "tc (iproute2) is not installed")
  if why:
    pytest.skip(why)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("count", [2, 3], ids=["veth pair", "bridge"])
def test_a_capped_link_runs_at_its_cap(count):
  """--link-rate: simulated hosts' links capped by tbf read at the cap both ways (the probe
  sends both directions at once), well below what the uncapped veth carries here."""
  from jax_smddp.tools import netns
  _namespaces_here()
  with netns.hosts(count, "200mbit") as (names, ips):
    capped = link_probe.measure(names, ips, nbytes=4 << 20, rounds=3, capped=True)
  cap_gbs = 200e6 / 8 / 1e9
  assert 0.6 * cap_gbs <= capped["each_way_gbs"] <= 1.1 * cap_gbs, capped


def test_a_capped_link_is_its_fastest_round_once_two_agree():
  """On a capped link noise only slows a round: the probe keeps measuring until its two
  fastest rounds agree within 2 % and reports the fastest (rounds measured in a benchmark run
  right after another, 0.100-0.112 GB/s, on a link that reads 0.119 when quiet)."""
  assert not link_probe.settled([0.100, 0.101, 0.105, 0.109, 0.112])
  assert link_probe.settled([0.100, 0.101, 0.105, 0.109, 0.112, 0.118, 0.119])
  assert not link_probe.settled([0.119])
  link = link_probe.measure(nbytes=1 << 20, rounds=2, capped=True, max_rounds=6)
  rates = link["rounds_gbs"]
  assert 2 <= len(rates) <= 6 and link["each_way_gbs"] == max(rates), link
  assert len(rates) == 6 or link_probe.settled(rates), link
  assert link_probe.settled(rates) or not link_probe.settled(rates[:-1]), link
  uncapped = link_probe.measure(nbytes=1 << 20, rounds=3)
  assert len(uncapped["rounds_gbs"]) == 3, uncapped


def test_a_rate_tc_cannot_read_is_named():
  from jax_smddp.tools import netns
  _namespaces_here()
  with pytest.raises(ValueError, match="cannot cap .* at 'fast'"):
    with netns.hosts(2, "fast"):
      pass
