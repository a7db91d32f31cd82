"""The cost model (jax_smddp.cost_model), the tuner (jax_smddp.tuning) and the
predicted p4d figure (jax_smddp.tools.figures): formulas on hand-computable cases,
presets, validation on recorded benchmark data (tests/tools/data), tuning choices."""

import glob
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from jax_smddp import calibration
from jax_smddp import cost_model as cm
from jax_smddp.tools import calibrate
from jax_smddp import tuning
from jax_smddp.tools import figures

L = cm.Layout
MiB = 1 << 20
DATA = os.path.join(os.path.dirname(__file__), "data")
RECORDED = sorted(glob.glob(os.path.join(DATA, "bench_*.json")))

# A toy machine for hand computation: 1 GB/s copies everywhere, round latencies.
TOY = replace(
    cm.CPU_REFERENCE, name="toy", cores=64, copy_bw=1e9, copy_bw_dram=1e9, cache_bytes=0,
    fault_bw=math.inf, reduce_bw=1e9, call_overhead_s=0.0, call_overhead_per_device_s=0.0,
    in_process=cm.Transport("memory", 0.0),
    intra_host=cm.Transport("shm", 10e-6, copies=1, per_message_s=1e-6),
    network=cm.Transport("net", 100e-6, bandwidth=1e9, copies=1, per_message_s=2e-6),
    oversubscribed_round_s=0.0, parallel_efficiency=1.0, hosts_share_cores=False)


# --------------------------------------------------------------------------- byte counts

@pytest.mark.timeout(30)
def test_flat_all_gather_bytes():
  S = 1 * MiB
  t = cm.traffic("all_gather", S, L(1, 2, 2), "flat")      # 2 processes x 2 devices
  assert t.out == {"intra": 2 * S, "net": 0} and t.inn == {"intra": 2 * S, "net": 0}
  # own blocks into both local outputs (4 S) + each remote block into the second output (2 S)
  assert t.local_copy == 6 * S and t.reduce_read == 0
  assert t.hops == ("intra",)


@pytest.mark.timeout(30)
def test_hierarchical_vs_flat_all_gather_bytes():
  S = 1 * MiB
  hier = cm.traffic("all_gather", S, L(2, 2, 1), "hierarchical")
  flat = cm.traffic("all_gather", S, L(2, 2, 1), "flat")
  # rails: one block over the network each way; the host mate's own block and one relay
  assert hier.out == {"net": S, "intra": 2 * S} and hier.inn == {"net": S, "intra": 2 * S}
  assert hier.hops == ("net", "intra")
  # flat: both remote processes directly, the host mate directly
  assert flat.out == {"net": 2 * S, "intra": S}
  # each byte crosses the network once per host: P times fewer host bytes
  assert flat.host_net_out == 2 * hier.host_net_out == 4 * S
  big = L(32, 8, 1)
  assert (cm.traffic("all_gather", S, big, "flat").host_net_out ==
          8 * cm.traffic("all_gather", S, big, "hierarchical").host_net_out ==
          8 * 31 * 8 * S)


@pytest.mark.timeout(30)
def test_reduce_scatter_and_all_to_all_bytes():
  S = 4 * MiB
  b = S // 4
  t = cm.traffic("reduce_scatter", S, L(2, 2, 1), "hierarchical")
  # own rank: host mate + same-rail peer; combines host mate's part for the rail peer;
  # sends partials to the host mate (its rank, and the other rail's remote rank)
  assert t.out == {"net": b, "intra": 2 * b} and t.inn == {"net": b, "intra": 2 * b}
  assert t.reduce_read == 3 * b + 2 * b
  assert t.hops == ("intra", "net")
  f = cm.traffic("reduce_scatter", S, L(1, 4, 1), "flat")
  assert f.out["intra"] == 3 * b and f.inn["intra"] == 3 * b and f.reduce_read == 4 * b
  a2a = cm.traffic("all_to_all", S, L(1, 2, 2), "flat")
  assert a2a.out["intra"] == S // 4 * 4 and a2a.local_copy == S  # 4 blocks of S/4 each way
  ar = cm.traffic("all_reduce", S, L(1, 2, 1), "flat")
  # contribution out and in (S/2), result out and in (S/2)
  assert ar.out["intra"] == S and ar.inn["intra"] == S and ar.hops == ("intra", "intra")


@pytest.mark.timeout(30)
def test_closed_forms_match_route_walk():
  """The docstring's closed forms against the walk, over several layouts."""
  S = 3 * 1024 * 1024 * 8
  for H, P, D in [(1, 2, 2), (1, 4, 1), (2, 1, 3), (2, 2, 1), (3, 2, 2), (4, 3, 1), (2, 4, 2)]:
    lay = L(H, P, D)
    n, Pt = lay.ranks, lay.processes
    s = S - S % n
    flat = cm.traffic("all_gather", s, lay, "flat")
    assert flat.out["intra"] + flat.out["net"] == (Pt - 1) * D * s
    rs = cm.traffic("reduce_scatter", s, lay, "flat")
    assert rs.out["intra"] + rs.out["net"] == (n - D) * (s // n)
    a2a = cm.traffic("all_to_all", s, lay, "flat")
    assert a2a.out["intra"] + a2a.out["net"] == (Pt - 1) * D * D * (s // n)
    if cm.hierarchical_valid(lay):
      h = cm.traffic("all_gather", s, lay, "hierarchical")
      assert h.out["net"] == (H - 1) * D * s and h.out["intra"] == (P - 1) * D * s * H
      hr = cm.traffic("reduce_scatter", s, lay, "hierarchical")
      assert hr.out["net"] == (H - 1) * D * (s // n)
      assert hr.out["intra"] == (P - 1) * D * H * (s // n)
      har = cm.traffic("all_reduce", s, lay, "hierarchical")
      assert har.out["net"] == 2 * (H - 1) * D * (s // n)


@pytest.mark.timeout(30)
def test_in_process_bytes():
  S = MiB
  assert cm.traffic("all_gather", S, L(1, 1, 8), "in_process").local_copy == 64 * S
  rs = cm.traffic("reduce_scatter", S, L(1, 1, 8), "in_process")
  assert rs.reduce_read == 8 * S and rs.local_copy == 0
  ar = cm.traffic("all_reduce", S, L(1, 1, 8), "in_process")
  assert ar.reduce_read == 8 * S and ar.local_copy == 7 * S


# --------------------------------------------------------------------------- times

@pytest.mark.timeout(30)
def test_flat_time_by_hand():
  S = MiB
  p = cm.predict("all_gather", S, L(1, 2, 1), TOY, "flat", chunk_bytes=MiB)
  # copies: own block (S) + into the ring (S) + out of it (S) at 1 GB/s; 2 messages at 1 us;
  # header: alpha + 2 x 1 peer x o; one hop of alpha
  data = 3 * S / 1e9 + 2 * 1e-6
  assert p.terms["data"] == pytest.approx(data)
  assert p.terms["header"] == pytest.approx(10e-6 + 2e-6)
  assert p.terms["hops"] == pytest.approx(10e-6)
  assert p.time_s == pytest.approx(data + 22e-6)
  # smaller chunks: more messages, same bytes
  q = cm.predict("all_gather", S, L(1, 2, 1), TOY, "flat", chunk_bytes=MiB // 4)
  assert q.terms["data"] - p.terms["data"] == pytest.approx(6 * 1e-6)


@pytest.mark.timeout(30)
def test_hierarchical_time_by_hand():
  S = MiB
  lay = L(2, 2, 1)
  h = cm.predict("all_gather", S, lay, TOY, "hierarchical", chunk_bytes=MiB)
  f = cm.predict("all_gather", S, lay, TOY, "flat", chunk_bytes=MiB)
  # hierarchical: copies own (S) + net out/in (2 S) + shm out/in (4 S) = 7 S;
  # the NIC carries 2 S per host at 1 GB/s, so the thread (7 ms) is the bottleneck
  assert h.terms["data"] == pytest.approx(7 * S / 1e9 + (2 * 2e-6 + 4 * 1e-6))
  assert h.bottleneck == "engine thread"
  # network, then the relay: one chunk's fill over shared memory (2 copies)
  assert h.terms["hops"] == pytest.approx(110e-6)
  assert h.terms["fill"] == pytest.approx(2 * S / 1e9)
  # flat: copies S + net 4 S + shm 2 S = 7 S too, but its host sends 4 S over one NIC
  assert f.terms["data"] == pytest.approx(max(7 * S / 1e9 + 4 * 2e-6 + 2 * 1e-6, 4 * S / 1e9))
  slow_net = replace(TOY, network=replace(TOY.network, bandwidth=0.25e9))
  hs = cm.predict("all_gather", S, lay, slow_net, "hierarchical")
  fs = cm.predict("all_gather", S, lay, slow_net, "flat")
  assert fs.bottleneck == hs.bottleneck == "network"
  assert fs.terms["data"] == pytest.approx(2 * hs.terms["data"])  # P = 2 times the bytes


@pytest.mark.timeout(30)
def test_ring_by_hand():
  """One process on each of 4 hosts: a ring (Routes::ring). Each host sends the
  all-to-all's bytes, but to its next host only, in the rounds' chunks, over
  3 network hops in a row (all_reduce: 6)."""
  S, K = MiB, cm.RING_CHUNK_BYTES
  lay = L(4, 1, 1)
  ag = cm.traffic("all_gather", S, lay, "flat")
  assert ag.ring and ag.hops == ("net",) * 3
  # its own block to the next host, two blocks relayed on; three in from the previous
  assert ag.out == ag.inn == {"net": 3 * S, "intra": 0} and ag.sizes["net"] == {S: 6}
  rs = cm.traffic("reduce_scatter", 4 * S, lay, "flat")
  assert rs.out["net"] == rs.inn["net"] == 3 * S and rs.hops == ("net",) * 3
  # it starts one reduction (its part sent as it is) and adds its part to the partial that
  # came in for the other three, its own shard's included
  assert rs.reduce_read == 3 * 2 * S
  ar = cm.traffic("all_reduce", 4 * S, lay, "flat")
  assert ar.out["net"] == ar.inn["net"] == 6 * S and ar.hops == ("net",) * 6
  assert not cm.traffic("all_gather", S, L(2, 1, 1), "flat").ring    # two hosts: no ring
  assert not cm.traffic("all_gather", S, L(4, 2, 1), "hierarchical").ring
  p = cm.predict("all_gather", S, lay, TOY, "flat", chunk_bytes=MiB)
  assert p.chunk_bytes == K
  assert p.terms["hops"] == pytest.approx(3 * 100e-6)
  # no fill: every host sends from the start, each hop's chunk arriving while it sends
  assert p.terms["fill"] == 0
  assert cm.predict("all_gather", S, L(2, 1, 1), TOY, "flat").terms["fill"] == 0  # one hop
  assert cm.predict("all_gather", S, L(2, 2, 1), TOY, "hierarchical").terms["fill"] > 0
  # copies: own block + 6 S through the links; 6 S / K chunks at 2 us
  assert p.terms["data"] == pytest.approx(7 * S / 1e9 + 6 * (S // K) * 2e-6)


@pytest.mark.timeout(30)
def test_contention_by_hand():
  """Other load (measured CPUs busy with other work) slows CPU-bound calls by
  the share of the cores they lose: (busy + other) / cores, once that exceeds 1."""
  f = cm.contention_factor
  assert f(1, 0.0, 2) == 1.0 and f(1, 0.9, 2) == 1.0           # a free core remains
  assert f(2, 1.0, 2) == pytest.approx(1.5)                     # 3 threads on 2 cores
  assert f(4, 1.0, 2) == pytest.approx(5 / 4)                   # already oversubscribed
  S, lay = MiB, L(1, 2, 2)
  base = cm.predict("all_gather", S, lay, cm.CPU_REFERENCE, "flat")
  loaded = cm.predict("all_gather", S, lay, cm.CPU_REFERENCE, "flat", other_load=1.0)
  assert loaded.time_s == pytest.approx(1.5 * base.time_s)
  assert loaded.terms["contention"] == pytest.approx(0.5 * base.time_s)
  assert cm.busy_threads("all_gather", S, L(2, 2, 1), cm.CPU_REFERENCE) == 4   # shared cores
  assert cm.busy_threads("all_gather", 1024, L(1, 1, 8), cm.CPU_REFERENCE) == 1
  gpu = cm.predict("all_gather", S, L(2, 8, 1), cm.P4D, other_load=4.0)
  assert "contention" not in gpu.terms                                        # CPU only


@pytest.mark.timeout(30)
def test_nccl_ring_by_hand():
  S = MiB
  p = cm.nccl_predict("all_gather", S, 32, 8, cm.P4D, "ring")
  lat = (8.4 + (255 - 31) * 3.4 + 31 * 14.0) * 1e-6
  assert p.terms["latency"] == pytest.approx(lat)
  assert p.terms["data"] == pytest.approx(255 * S / (4 * 12.5e9 * 0.95))
  assert p.host_net_bytes == 255 * S
  t = cm.nccl_predict("all_reduce", S, 32, 8, cm.P4D, "tree")
  assert t.terms["latency"] == pytest.approx((8.4 + 2 * (7 * 4.0 + 5 * 14.0)) * 1e-6)
  r = cm.nccl_predict("all_reduce", S, 32, 8, cm.P4D, "ring")
  assert r.terms["latency"] == pytest.approx((8.4 + (510 - 64) * 3.4 + 64 * 14.0) * 1e-6)
  # tree: fewer latency terms; at large sizes the ring's bandwidth term is lower
  assert t.time_s < r.time_s
  big_t = cm.nccl_predict("all_reduce", 1 << 30, 32, 8, cm.P4D, "tree")
  big_r = cm.nccl_predict("all_reduce", 1 << 30, 32, 8, cm.P4D, "ring")
  assert big_r.time_s < big_t.time_s
  with pytest.raises(ValueError):
    cm.nccl_predict("all_gather", S, 2, 8, cm.P4D, "tree")


@pytest.mark.timeout(30)
def test_presets():
  p4d, p5 = cm.PRESETS["p4d.24xlarge"], cm.PRESETS["p5.48xlarge"]
  assert p4d.gpus_per_host == p5.gpus_per_host == 8
  assert p4d.nics_per_host * p4d.network.bandwidth * 8 == pytest.approx(400e9)   # 4 x 100 Gbps
  assert p5.nics_per_host * p5.network.bandwidth * 8 == pytest.approx(3200e9)   # 32 x 100 Gbps
  assert 2 * p4d.intra_host.bandwidth == pytest.approx(600e9)                    # NVLink3
  assert 2 * p5.intra_host.bandwidth == pytest.approx(900e9)                     # NVLink4
  assert [p4d.usable_nics(k) for k in (1, 2, 4, 8)] == [1, 2, 4, 4]              # 2 GPUs per NIC
  assert [p5.usable_nics(k) for k in (1, 2, 4, 8)] == [4, 8, 16, 32]             # 4 NICs per GPU
  for m in (p4d, p5):
    assert 0 < m.network.efficiency <= 1 and m.network.latency_s < 50e-6
    for op in cm.OPS:
      for S in (1 << 12, 1 << 20, 1 << 26):
        p = cm.predict(op, S, L(32, 8, 1), m)
        assert p.algorithm == ("flat" if op == "all_to_all" else "hierarchical") and p.time_s > 0
        # never faster than the NICs allow
        assert p.network_utilisation(m) <= m.network.efficiency + 1e-9
  cpu = cm.CPU_REFERENCE
  assert cpu.kind == "cpu" and cpu.copy_bw >= cpu.copy_bw_dram > 0


def test_the_models_helper_threshold_is_the_registrys_default():
  # The pure model cannot read the registry; this keeps its copy of the engine's default honest.
  from jax_smddp import config
  assert cm.HELPER_MIN_BYTES == config.default("JAX_SMDDP_CPU_HELPER_MIN_BYTES")


@pytest.mark.timeout(30)
def test_machine_json_roundtrip(tmp_path):
  path = str(tmp_path / "cal.json")
  calibration.save_machine(cm.P4D, path)
  assert calibration.load_machine(path) == cm.P4D
  calibration.save_machine(cm.CPU_REFERENCE, path)
  assert calibration.load_machine(path) == cm.CPU_REFERENCE


@pytest.mark.timeout(30)
def test_outputs_fault_from_the_heap_threshold_on(tmp_path):
  # 1 GB/s of first touch: 8 devices x 48 MiB outputs cost 8 * 48 MiB / 1e9 s more where they
  # are mapped afresh (glibc's 32 MiB), nothing where the heap keeps them (64 MiB).
  m = replace(TOY, cores=1, fault_bw=1e9)
  lay, per_rank = L(1, 1, 8), 6 * MiB        # all_gather output: 48 MiB per device
  fresh = cm.predict("all_gather", per_rank, lay, replace(m, fresh_output_bytes=32 * MiB)).time_s
  kept = cm.predict("all_gather", per_rank, lay, replace(m, fresh_output_bytes=64 * MiB)).time_s
  assert fresh - kept == pytest.approx(8 * 48 * MiB / 1e9, rel=1e-6)
  # A calibration written before the field existed reads as glibc's own threshold.
  path = tmp_path / "old.json"
  calibration.save_machine(m, str(path))
  data = json.loads(path.read_text())
  del data["machine"]["fresh_output_bytes"]
  path.write_text(json.dumps(data))
  assert calibration.load_machine(str(path)).fresh_output_bytes == cm.MMAP_THRESHOLD_MAX


@pytest.mark.timeout(60)
def test_local_machine_takes_this_processs_heap_policy():
  from jax_smddp import capabilities
  kept = capabilities.heap_reuse()["bytes"]
  assert calibration.heap_fresh_output_bytes() == max(cm.MMAP_THRESHOLD_MAX, kept)
  assert calibration.local_machine().fresh_output_bytes == calibration.heap_fresh_output_bytes()


# --------------------------------------------------------------------------- validation

def _records(statistic="min_us"):
  if not RECORDED:
    pytest.fail(f"no recorded benchmark data in {DATA}")
  return calibrate.load_records(RECORDED, statistic)


@pytest.mark.timeout(120)
def test_recorded_data_covers_the_cpu_layouts():
  specs = {r["layout"].spec for r in _records()}
  # one process x 8 devices; 2 and 4 processes on one host; two simulated hosts
  assert {"1x8", "2x2", "4x1", "2x2x1", "2x1x1"} <= specs, specs
  sizes = {r["bytes_per_rank"] for r in _records()}
  assert min(sizes) <= 64 << 10 and max(sizes) >= 16 << 20


# Acceptance: per layout, the median |error| is within 25% and at least this
# share of the points is within 25% (see docs/performance_model.md).
MIN_WITHIN = 0.70


@pytest.mark.timeout(120)
def test_model_predicts_recorded_times():
  stats = calibrate.error_stats(_records(), cm.CPU_REFERENCE)
  for spec, s in stats.items():
    assert s["median_abs_error"] <= 0.25, (spec, s)
    assert s["within"] >= MIN_WITHIN, (spec, s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrong", ["no ring copies", "no call overhead", "4x network",
                                   "no oversubscription", "flat across hosts"])
def test_wrong_models_miss(wrong):
  """The validation can fail: models missing one mechanism miss the data."""
  m = cm.CPU_REFERENCE
  records = _records()
  if wrong == "no ring copies":
    m = replace(m, intra_host=replace(m.intra_host, copies=0),
                network=replace(m.network, copies=0))
  elif wrong == "no call overhead":
    m = replace(m, call_overhead_s=0.0, call_overhead_per_device_s=0.0)
  elif wrong == "4x network":
    m = replace(m, network=replace(m.network, bandwidth=4 * m.network.bandwidth,
                                   latency_s=m.network.latency_s / 4))
    records = [r for r in records if r["layout"].hosts > 1]
  elif wrong == "no oversubscription":
    m = replace(m, oversubscribed_round_s=0.0, cores=64)
    records = [r for r in records if r["layout"].processes > 2]
  elif wrong == "flat across hosts":
    records = [r for r in records if cm.hierarchical_valid(r["layout"])]
    # what ran was the tuner's choice (flat or hierarchical); predict the other one
    records = [r for r in records if r["op"] != "all_to_all"]
    other = {"flat": "hierarchical", "hierarchical": "flat"}
    errs = [calibrate.predict_record(r, m, other[r["algorithm"]]).time_s / r["time_s"] - 1
            for r in records]
    med = sorted(abs(e) for e in errs)[len(errs) // 2]
    right = calibrate.error_stats(records, m)["all"]["median_abs_error"]
    assert med > right, (med, right)
    return
  s = calibrate.error_stats(records, m)
  failing = [spec for spec, v in s.items() if spec != "all" and
             (v["median_abs_error"] > 0.25 or v["within"] < MIN_WITHIN)]
  assert failing, s


@pytest.mark.timeout(300)
def test_fit_generalises_across_sizes():
  """Held out: fitted to every other size, the model predicts the sizes in between."""
  records = _records()
  sizes = sorted({r["bytes_per_rank"] for r in records})
  train = [r for r in records if sizes.index(r["bytes_per_rank"]) % 2 == 0]
  test = [r for r in records if sizes.index(r["bytes_per_rank"]) % 2 == 1]
  start = replace(cm.CPU_REFERENCE, call_overhead_s=100e-6, call_overhead_per_device_s=10e-6,
                  oversubscribed_round_s=1e-3, cache_bytes=32 << 20, fault_bw=4e9,
                  parallel_efficiency=0.7, oversubscribed_efficiency=1.0,
                  intra_host=replace(cm.CPU_REFERENCE.intra_host, latency_s=20e-6),
                  network=replace(cm.CPU_REFERENCE.network, latency_s=100e-6, kernel_bw=1e9))
  fitted = calibrate.fit(train, start)
  held_out = calibrate.error_stats(test, fitted)["all"]
  assert held_out["median_abs_error"] <= 0.25 and held_out["within"] >= MIN_WITHIN, held_out


@pytest.mark.timeout(300)
def test_fit_recovers_parameters():
  """fit() on data made by a known machine finds its parameters again."""
  truth = cm.CPU_REFERENCE
  records = []
  for lay in (L(1, 1, 8), L(1, 2, 2), L(1, 4, 1), L(2, 2, 1), L(2, 1, 1)):
    for op in cm.OPS:
      for S in (1 << 16, 1 << 19, 1 << 22, 1 << 24):
        records.append({"layout": lay, "op": op, "bytes_per_rank": S,
                        "time_s": cm.predict(op, S, lay, truth).time_s})
  start = calibrate.with_params(truth, call_overhead_s=truth.call_overhead_s * 3,
                         net_bandwidth=truth.network.bandwidth / 3,
                         intra_latency_s=truth.intra_host.latency_s * 4)
  fitted = calibrate.fit(records, start, params=("call_overhead_s", "net_bandwidth", "intra_latency_s"))
  assert fitted.call_overhead_s == pytest.approx(truth.call_overhead_s, rel=0.1)
  assert fitted.network.bandwidth == pytest.approx(truth.network.bandwidth, rel=0.1)
  assert calibrate.error_stats(records, fitted)["all"]["max_abs_error"] < 0.05


@pytest.mark.timeout(60)
def test_microbenchmarks_and_local_machine(tmp_path, monkeypatch):
  micro = calibrate.microbenchmarks(quick=True)
  for k in ("copy_bw", "copy_bw_dram", "reduce_bw", "reduce_bw_dram"):
    assert micro[k] > 1e8, (k, micro)
  m = calibrate.calibrated_machine(micro)
  path = str(tmp_path / "calibration.json")
  calibration.save_machine(m, path)
  monkeypatch.setenv("JAX_SMDDP_CALIBRATION", path)
  calibration.local_machine.cache_clear()
  try:
    assert calibration.local_machine() == m and calibration.local_machine().source == "calibrated"
    with open(path, "w") as f:
      f.write("not json")
    calibration.local_machine.cache_clear()
    assert calibration.local_machine().source == "default"     # a damaged cache is ignored
    assert calibration.local_machine().name == "cpu-reference"
  finally:
    calibration.local_machine.cache_clear()


# --------------------------------------------------------------------------- tuning

@pytest.fixture
def clean_tuning(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_SMDDP_ALGORITHM", raising=False)
  monkeypatch.delenv("JAX_SMDDP_CHUNK_BYTES", raising=False)
  monkeypatch.setenv("JAX_SMDDP_CALIBRATION", str(tmp_path / "none.json"))
  tuning.clear_cache()
  yield monkeypatch
  tuning.clear_cache()


@pytest.mark.timeout(60)
def test_choose_defaults(clean_tuning):
  one = tuning.choose("all_gather", MiB, tuning.Layout(1, 1, 8))
  assert one.algorithm == "in_process"
  flat = tuning.choose("all_gather", MiB, tuning.Layout(1, 4, 1))
  assert flat.algorithm == "flat" and flat.reason.startswith("model")
  for op in tuning.OPS:
    for S in (0, 1, 4096, MiB, 64 * MiB):
      for lay in (tuning.Layout(2, 2, 1), tuning.Layout(2, 1, 4), tuning.Layout(4, 8, 1),
                  tuning.Layout(1, 2, 2)):
        c = tuning.choose(op, S, lay)
        assert c.algorithm in ("flat", "hierarchical")
        assert c.chunk_bytes % 64 == 0 and c.chunk_bytes >= 4096
        if not cm.hierarchical_valid(lay):
          assert c.algorithm == "flat"
  # on a network slower than memory, rail routes win large gathers across hosts
  assert tuning.choose("all_gather", 16 * MiB, tuning.Layout(4, 8, 1)).algorithm == "hierarchical"


@pytest.mark.timeout(60)
def test_choose_env_overrides(clean_tuning):
  mp = clean_tuning
  mp.setenv("JAX_SMDDP_ALGORITHM", "flat")
  c = tuning.choose("all_gather", 16 * MiB, tuning.Layout(4, 8, 1))
  assert c.algorithm == "flat" and "forced by JAX_SMDDP_ALGORITHM=flat" in c.reason
  mp.setenv("JAX_SMDDP_ALGORITHM", "hierarchical")
  c = tuning.choose("reduce_scatter", MiB, tuning.Layout(2, 2, 1))
  assert c.algorithm == "hierarchical" and "forced" in c.reason
  c = tuning.choose("reduce_scatter", MiB, tuning.Layout(2, 1, 2))   # 1 process per host
  assert c.algorithm == "flat" and "not valid" in c.reason
  c = tuning.choose("reduce_scatter", MiB, tuning.Layout(1, 4, 1))   # one host
  assert c.algorithm == "flat"
  c = tuning.choose("all_to_all", MiB, tuning.Layout(2, 2, 1))       # always direct
  assert c.algorithm == "flat" and "always direct" in c.reason
  mp.setenv("JAX_SMDDP_CHUNK_BYTES", "100000")
  c = tuning.choose("all_reduce", MiB, tuning.Layout(2, 2, 1))
  assert c.chunk_bytes == 100032 and "JAX_SMDDP_CHUNK_BYTES" in c.reason
  mp.setenv("JAX_SMDDP_CHUNK_BYTES", "10")
  assert tuning.choose("all_reduce", MiB, tuning.Layout(2, 2, 1)).chunk_bytes == 4096
  mp.delenv("JAX_SMDDP_ALGORITHM")
  mp.setenv("JAX_SMDDP_CHUNK_BYTES", "65536")
  c = tuning.choose("all_gather", MiB, tuning.Layout(2, 2, 1))
  assert c.chunk_bytes == 65536 and "forced by JAX_SMDDP_CHUNK_BYTES" in c.reason
  mp.setenv("JAX_SMDDP_ALGORITHM", "ring")       # not a choice: an error naming the setting
  with pytest.raises(ValueError, match="JAX_SMDDP_ALGORITHM='ring' is not valid.*flat\\|hierarchical"):
    tuning.choose("all_gather", MiB, tuning.Layout(2, 2, 1))
  mp.delenv("JAX_SMDDP_ALGORITHM")
  mp.setenv("JAX_SMDDP_CHUNK_BYTES", "lots")
  with pytest.raises(ValueError, match="JAX_SMDDP_CHUNK_BYTES='lots' is not valid: it takes a byte"):
    tuning.choose("all_gather", MiB, tuning.Layout(2, 2, 1))


@pytest.mark.timeout(60)
def test_choose_is_fast_cached_and_logged(clean_tuning, caplog):
  lay = tuning.Layout(32, 8, 1)
  t0 = time.perf_counter()
  first = tuning.choose("all_gather", 4 * MiB, lay)
  cold = time.perf_counter() - t0
  warm = []  # the fastest of 5 batches: a batch that shared the cores with other work is slower
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(200):
      assert tuning.choose("all_gather", 4 * MiB, lay) == first
    warm.append((time.perf_counter() - t0) / 200)
  assert cold < 2.0 and min(warm) < 1e-4, (cold, warm)
  with caplog.at_level(logging.DEBUG, logger="jax_smddp"):
    tuning.choose("reduce_scatter", 12345 * 64, tuning.Layout(2, 2, 1))
  assert any("jax_smddp tuning: reduce_scatter" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_choose_never_raises(clean_tuning):
  c = tuning.choose("all_gather", -5, tuning.Layout(0, 0, 0))
  assert c.algorithm == "in_process"
  c = tuning.choose("not_an_op", MiB, tuning.Layout(2, 2, 1))
  assert c.algorithm == "hierarchical" and "model failed" in c.reason


# --------------------------------------------------------------------------- the figure

@pytest.mark.timeout(120)
def test_figure_numbers():
  data = figures.curves(cm.P4D, nodes=32)
  s8 = data["series"]["8"]["summary"]
  # ours reaches its peak at smaller buffers than the ring ...
  assert s8["ring_needs_x_larger_buffers"] >= 2
  # ... both peaks bounded by the NIC efficiency, ranks per node limit the usable NICs
  for k, series in data["series"].items():
    for impl in ("ours", "ring"):
      assert series["summary"][impl]["peak_utilisation"] <= cm.P4D.network.efficiency * \
          series["usable_share"] + 1e-9
  assert data["series"]["1"]["summary"]["ours"]["peak_utilisation"] <= 0.25
  at = lambda impl, size: s8[impl]["utilisation_at"][size]
  assert at("ours", "256M") > at("ring", "256M")


@pytest.mark.timeout(120)
def test_figure_cli(tmp_path):
  out = tmp_path / "fig"
  proc = subprocess.run([sys.executable, "-m", "jax_smddp.tools.figures", "--out", str(out),
                         "--preset", "p4d.24xlarge"], capture_output=True, text=True, timeout=100,
                        cwd=tmp_path)  # the installed package, not the source tree
  assert proc.returncode == 0, proc.stdout + proc.stderr
  data = json.loads((out / "allgather_network_utilisation.json").read_text())
  fig = data["figures"][0]
  assert fig["machine"] == "p4d.24xlarge" and fig["nodes"] == 32
  assert set(fig["series"]) == {"1", "2", "4", "8"}
  row = fig["series"]["8"]["rows"][0]
  assert {"output_bytes", "ours_utilisation", "ring_utilisation", "ours_algorithm"} <= set(row)
  assert "32 x p4d.24xlarge" in proc.stdout
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    pytest.skip("matplotlib not installed: no PNG")
  png = out / "allgather_network_utilisation.png"
  assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_calibrate_cli(tmp_path):
  """--calibrate --from DATA writes a machine that predicts DATA, and the tuner reads it."""
  out = tmp_path / "cal.json"
  data = os.path.join(DATA, "bench_2x2.json")
  proc = subprocess.run([sys.executable, "-m", "jax_smddp.tools.calibrate", "--calibrate", "--from",
                         data, "--out", str(out)], capture_output=True, text=True, timeout=100,
                        cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  m = calibration.load_machine(str(out))
  assert m.source == "fitted" and m.cores == (os.cpu_count() or 1)
  records = calibrate.load_records([data])
  s = calibrate.error_stats(records, m)["all"]
  # The same machine before the fit (this machine's microbenchmarks, the preset's other
  # parameters): the fit must predict DATA better. The bound is loose because the live
  # microbenchmarks read this machine's memory as it is now, and a build beside the tests
  # takes some of its bandwidth (the fitted error was 0.20-0.26 here).
  preset = calibrate.params_of(calibrate.CPU_REFERENCE)
  unfitted = calibrate.with_params(m, **{k: preset[k] for k in calibrate.FIT_PARAMS})
  before = calibrate.error_stats(records, unfitted)["all"]
  assert s["median_abs_error"] < before["median_abs_error"], (s, before)
  assert s["median_abs_error"] <= 0.35, s
  env = dict(os.environ, JAX_SMDDP_CALIBRATION=str(out))
  proc = subprocess.run([sys.executable, "-m", "jax_smddp.tools.calibrate", "--predict", "all_gather",
                         "1M", "2x2x1"], capture_output=True, text=True, timeout=100, env=env,
                        cwd=tmp_path)
  assert proc.returncode == 0 and "best:" in proc.stdout and "(local)" in proc.stdout, proc.stdout
