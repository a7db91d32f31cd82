"""The engine's in-process rendezvous (xla_ffi/engine/inprocess_rendezvous.cc)
through _smddp_testing's rendezvous_probe: all_reduce on a private
communicator whose ranks are threads, some of which never arrive or arrive
late or with another call. The deadline fails every arrived rank naming the
missing ones, a late rank fails at once without touching buffers, ranks that
disagree are refused, and a complete group sums right afterwards. What a JAX
program sees of the same failures is in tests/api/test_errors.py."""

import time

import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")


@pytest.mark.timeout(60)
def test_engine_deadline_when_a_rank_never_arrives():
  start = time.monotonic()
  results = engine_probes().rendezvous_probe(4, [0, 1, 2], 0.5)
  elapsed = time.monotonic() - start
  assert elapsed < 10
  assert [r for r, _ in results] == [0, 1, 2]
  for rank, err in results:
    assert "timed out" in err or "never arrived" in err or "gave up" in err, err
    assert "3" in err.split("rank(s)")[1].split()[0], err   # names the missing rank
    assert "all_reduce" in err
  # The engine recorded it as a timeout concerning rank 3, with what to do.
  last = engine_probes().last_failure()
  assert last["code"] == "timeout" and last["op"] == "all_reduce", last
  assert last["peer_ranks"] == [3] and last["rank"] in (0, 1, 2), last
  assert last["devices"] == [-1000000, -1000001, -1000002, -1000003], last
  assert "JAX_SMDDP_TIMEOUT_S" in last["remedy"], last
  # The engine stays healthy: a complete group succeeds afterwards.
  ok = engine_probes().rendezvous_probe(4, [0, 1, 2, 3], 5.0)
  assert all(err == "" for _, err in ok), ok


@pytest.mark.timeout(60)
def test_engine_late_rank_fails_fast_without_touching_buffers():
  # Rank 3 arrives after the others gave up: it must fail too, at once.
  results = engine_probes().rendezvous_probe(4, [0, 1, 2], 0.3)
  assert all(err for _, err in results)
  # Its failure keeps the first cause's kind: the peers' timeout.
  assert engine_probes().last_failure()["code"] == "timeout"


@pytest.mark.timeout(60)
def test_engine_refuses_ranks_that_disagree_on_the_call():
  results = engine_probes().rendezvous_probe(4, [0, 1, 2, 3], 5.0, count=1000, odd_rank=2)
  for rank, err in results:
    assert "ranks disagree" in err and "4000 bytes" in err and "4004 bytes" in err, err
  last = engine_probes().last_failure()
  assert last["code"] == "mismatch" and last["peer_ranks"] == [0, 2], last


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [0, 1, 5, 4096, 300_000])
def test_engine_all_reduce_sums(count):
  ok = engine_probes().rendezvous_probe(8, list(range(8)), 10.0, count=count)
  assert all(err == "" for _, err in ok), ok
