"""The cost model's routes (cost_model._Routes, which it counts traffic along)
are the engine's (ComputeRoutes in xla_ffi/algorithms/routes.cc): every
field, for every process of every layout below, flat and hierarchical, with
rounds (and so rings) allowed and not."""

from __future__ import annotations

import itertools

import pytest

from jax_smddp import cost_model
from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

LAYOUTS = [cost_model.Layout(h, p, d) for h, p, d in itertools.product((1, 2, 3), (1, 2, 4), (1, 2))
           if h * p > 1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec)
@pytest.mark.parametrize("hierarchical", [True, False])
@pytest.mark.parametrize("rounds", [True, False], ids=["rounds", "no_rounds"])
def test_cost_model_routes_are_the_engines(layout, hierarchical, rounds):
  engine = engine_probes()
  model = cost_model._Routes(layout, hierarchical, rounds)
  process_of_rank = [model.proc(s) for s in range(model.n)]
  hosts = [f"host{model.host(q)}" for q in range(model.Pt)]
  for p in range(model.Pt):
    r = engine.routes(process_of_rank, p, hosts, hierarchical, rounds)
    where = f"process {p} of {layout.spec}, hierarchical={hierarchical}, rounds={rounds}"
    assert r["hierarchical"] == model.hier, where
    assert r["ring"] == model.ring, where
    assert sorted(r["gather_targets"]) == sorted(model.gather_targets(p)), where
    for s in range(model.n):
      assert r["gather_source"][s] == model.gather_source(p, s), (where, "rank", s)
      assert sorted(r["gather_relay"][s]) == sorted(model.gather_relay(p, s)), (where, "rank", s)
      assert sorted(r["reduce_sources"][s]) == sorted(model.reduce_sources(p, s)), (where, "rank", s)
      assert r["reduce_dest"][s] == model.reduce_dest(p, s), (where, "rank", s)


@pytest.mark.parametrize("layout", [cost_model.Layout(h, p, d)
                                    for h, p, d in itertools.product((2, 3, 4, 5), (1, 2), (1, 2))],
                         ids=lambda l: l.spec)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_staggered_rounds_pair_every_host_once(layout, hierarchical):
  """Staggered rounds (JAX_SMDDP_STAGGER_CHUNK_BYTES): with more than 2 hosts and
  one peer per other host, a process sends in round k to host h+k and receives
  from host h-k, its round-k target receives from it in the same round, and
  every other host comes once; otherwise (2 hosts, several peers on a host, a
  ring: one process per host, or rounds off) there are none."""
  engine = engine_probes()
  model = cost_model._Routes(layout, hierarchical)
  H = layout.hosts
  process_of_rank = [model.proc(s) for s in range(model.n)]
  hosts = [f"host{model.host(q)}" for q in range(model.Pt)]
  routes = [engine.routes(process_of_rank, p, hosts, hierarchical, True) for p in range(model.Pt)]
  for p in range(model.Pt):
    assert engine.routes(process_of_rank, p, hosts, hierarchical, False)["stagger_to"] == []
    r, h = routes[p], model.host(p)
    across = [q for q in model.gather_targets(p) if model.host(q) != h]
    one_each = len(across) == H - 1 == len({model.host(q) for q in across})
    where = f"process {p} of {layout.spec}, hierarchical={hierarchical}"
    if H <= 2 or not one_each or layout.processes_per_host == 1:
      assert r["stagger_to"] == r["stagger_from"] == [], where
      assert r["ring"] == (H > 2 and layout.processes_per_host == 1), where
      continue
    assert [model.host(q) for q in r["stagger_to"]] == [(h + k) % H for k in range(1, H)], where
    assert [model.host(q) for q in r["stagger_from"]] == [(h - k) % H for k in range(1, H)], where
    assert sorted(r["stagger_to"]) == sorted(across), where
    for k, q in enumerate(r["stagger_to"]):
      assert routes[q]["stagger_from"][k] == p, (where, "round", k + 1)


@pytest.mark.parametrize("layout", [cost_model.Layout(h, 1, d)
                                    for h, d in itertools.product((2, 3, 4, 5), (1, 2))],
                         ids=lambda l: l.spec)
@pytest.mark.parametrize("stagger", [True, False])
def test_one_process_per_host_is_a_ring(layout, stagger):
  """One process on each of more than 2 hosts, rounds allowed: the hosts form a
  ring (Routes::ring). Followed hop by hop, every rank's block reaches every
  other process once, from its previous, and every rank's reduction visits
  every process once, ending at the rank's own; each process waits for what
  comes round first first. Otherwise (2 hosts, rounds off) there is no ring."""
  engine = engine_probes()
  model = cost_model._Routes(layout, True)
  H, n = layout.hosts, model.n
  process_of_rank = [model.proc(s) for s in range(n)]
  hosts = [f"host{model.host(q)}" for q in range(model.Pt)]
  routes = [engine.routes(process_of_rank, p, hosts, True, stagger) for p in range(H)]
  if H <= 2 or not stagger:
    assert not any(r["ring"] for r in routes)
    return
  nxt = {p: (p + 1) % H for p in range(H)}  # hosts numbered as sorted: host0 < host1 < ...
  for p, r in enumerate(routes):
    assert r["ring"] and r["gather_targets"] == [nxt[p]], p
    assert r["stagger_to"] == [], p
    dist = lambda s: (p - process_of_rank[s]) % H
    assert r["gather_order"] == sorted((s for s in range(n) if dist(s)), key=dist), p
    assert r["reduce_order"] == sorted(range(n), key=lambda s: (dist(s) - 1) % H), p
  for s in range(n):
    owner = process_of_rank[s]
    # The gather: from the owner round the ring, each hop relaying to the next.
    got, p = [], owner
    while True:
      q = nxt[p]
      if q == owner:
        break
      assert routes[q]["gather_source"][s] == p, (s, q)
      got.append(q)
      if nxt[q] != owner:
        assert routes[q]["gather_relay"][s] == [nxt[q]], (s, q)
      else:
        assert routes[q]["gather_relay"][s] == [], (s, q)
      p = q
    assert sorted(got + [owner]) == list(range(H)), s
    assert routes[owner]["gather_source"][s] == -1
    # The reduction: starts where nothing comes in, each hop adding its own and sending on.
    (start,) = [q for q in range(H) if routes[q]["reduce_sources"][s] == []]
    chain, q = [start], start
    while routes[q]["reduce_dest"][s] != -1:
      d = routes[q]["reduce_dest"][s]
      assert routes[d]["reduce_sources"][s] == [q], (s, d)
      chain.append(d)
      q = d
    assert q == owner and sorted(chain) == list(range(H)), (s, chain)
