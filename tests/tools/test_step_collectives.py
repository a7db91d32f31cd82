"""jax_smddp.tools.step_collectives: the collectives of a compiled module, counted by hand
on a module written for the purpose (loops, calls, async pairs, tuples, custom calls), and
the library each is named after."""

from __future__ import annotations

import pytest

from jax_smddp.tools import step_collectives as sc
from jax_smddp.tools import trace_summary as ts

# ENTRY runs a while loop of 3 iterations (its body: an all-gather f32[8,4] and a
# collective-permute f32[16]), a call to a computation holding an all-reduce of a tuple
# (f32[10], s32[6]), an async all-gather pair (f32[64] at -done), an all-to-all of a tuple
# and jax_smddp's reduce_scatter (f32[32]); the all-reduce's reducer and a fusion hold
# nothing to count.
HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_computation (p: f32[32]) -> f32[32] {
  %p = f32[32]{0} parameter(0)
  ROOT %neg = f32[32]{0} negate(%p)
}

%body.1 (t: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %t = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[2,4]{1,0} get-tuple-element(%t), index=1
  %all-gather.3 = f32[8,4]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %collective-permute.2 = f32[16]{0} collective-permute(%y), channel_id=2, source_target_pairs={{0,1},{1,0}}
  ROOT %out = (s32[], f32[8,4]{1,0}) tuple(%i, %all-gather.3)
}

%cond.1 (t: (s32[], f32[8,4])) -> pred[] {
  %t = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%reduce_both (u: f32[10], v: s32[6]) -> (f32[10], s32[6]) {
  %u = f32[10]{0} parameter(0)
  %v = s32[6]{0} parameter(1)
  ROOT %all-reduce.5 = (f32[10]{0}, s32[6]{0}) all-reduce(%u, %v), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%region_add
}

ENTRY %main.9_spmd (param: f32[4]) -> f32[4] {
  %param = f32[4]{0} parameter(0)
  %while.7 = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %call.2 = (f32[10]{0}, s32[6]{0}) call(%u0, %v0), to_apply=%reduce_both
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%z), channel_id=4, dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %all-to-all.1 = (f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%q, %r), channel_id=5, replica_groups={{0,1}}
  %rs = f32[32]{0} custom-call(%param, %pid), custom_call_target="smddp_reduce_scatter", api_version=API_VERSION_TYPED_FFI
  %f = f32[32]{0} fusion(%rs), kind=kLoop, calls=%fused_computation
  ROOT %r = f32[4]{0} slice(%f), slice={[0:4]}
}
"""


def test_counts_calls_and_bytes_as_counted_by_hand():
  assert sc.in_hlo(HLO) == {
      # 3 iterations of f32[8,4] (128 B); plus the async pair, once: f32[64] (256 B).
      "all-gather": {"instructions": 2, "calls": 4, "bytes": 3 * 128 + 256, "loops_known": True},
      # Once, through the call: f32[10] + s32[6] = 64 B.
      "all-reduce": {"instructions": 1, "calls": 1, "bytes": 64, "loops_known": True},
      "all-to-all": {"instructions": 1, "calls": 1, "bytes": 32, "loops_known": True},
      "collective-permute": {"instructions": 1, "calls": 3, "bytes": 3 * 64,
                             "loops_known": True},
      "smddp_reduce_scatter": {"instructions": 1, "calls": 1, "bytes": 128,
                               "loops_known": True},
  }


def test_a_loop_without_a_trip_count_counts_once_and_says_so():
  found = sc.in_hlo(HLO.replace('backend_config={"known_trip_count":{"n":"3"},', "backend_config={"))
  assert found["all-gather"]["calls"] == 2 and found["collective-permute"]["calls"] == 1
  assert not any(o["loops_known"] for o in found.values())
  assert "counted once" in sc.format_report(sc.report(found, {}, {}, 1, 1, "gloo", False))


def test_element_sizes():
  assert sc.shape_bytes("(f32[2,3]{1,0}, bf16[4]{0}, pred[], s8[5], f64[1], c64[2])") == \
      24 + 8 + 1 + 5 + 8 + 16
  assert sc.shape_bytes("u32[]") == 4 and sc.shape_bytes("token[]") == 0


@pytest.mark.parametrize("xla, counted, want", [
    ("jax_smddp", True, "xla (via jax_smddp)"),
    ("gloo", False, "xla (gloo)"),
    ("in-process", False, "xla (in-process)"),
    ("nccl", False, "xla (nccl)"),
    ("jax_smddp", False, "xla (not counted by jax_smddp)"),
])
def test_library_of_xla_ops(xla, counted, want):
  assert sc.library("all-gather", counted, xla) == want
  assert sc.library("smddp_all_gather", counted, xla) == "jax_smddp"  # its own custom call


def test_report_per_device_and_step_from_the_counts():
  ops = sc.in_hlo(HLO)
  # 5 steps on 2 devices: 4 all-gathers per device and step through jax_smddp, plus calls
  # from before the steps that must not count; no all-reduce reached it.
  before = {"all-gather": {"calls": 7, "bytes": 700}}
  after = {"all-gather": {"calls": 7 + 40, "bytes": 700 + 10 * 640},
           "smddp_reduce_scatter": {"calls": 10, "bytes": 1280}}
  rep = sc.report(ops, before, after, runs=5, devices=2, xla_collectives="gloo", counting=True)
  assert rep["all-gather"]["library"] == "xla (via jax_smddp)"
  assert (rep["all-gather"]["jax_smddp_calls"], rep["all-gather"]["jax_smddp_bytes"]) == (4, 640)
  assert rep["all-reduce"]["library"] == "xla (gloo)"
  assert (rep["all-reduce"]["jax_smddp_calls"], rep["all-reduce"]["jax_smddp_bytes"]) == (0, 0)
  assert rep["smddp_reduce_scatter"]["library"] == "jax_smddp"
  assert rep["smddp_reduce_scatter"]["jax_smddp_bytes"] == 128
  text = sc.format_report(rep)
  assert "all-gather" in text and "xla (via jax_smddp)" in text and "640 B" in text
  # Where jax_smddp keeps no count (one process), its columns are empty, not zero.
  alone = sc.report(ops, {}, {}, 5, 2, "in-process", counting=False)
  assert all(o["jax_smddp_bytes"] is None for o in alone.values())
  assert alone["all-gather"]["library"] == "xla (in-process)"


def test_a_trace_names_xla_collectives_by_the_library_given():
  thunk = lambda name: {"ph": "X", "ts": 0, "dur": 5, "name": name,
                        "args": {"hlo_op": name, "device_ordinal": "0"}}
  events = [thunk("all-gather.3"), thunk("all-gather.3"), thunk("collective-permute.2"),
            thunk("rs")]
  found = ts.summarize(events, HLO, {"all_gather": "xla (via jax_smddp)"})
  assert set(found["devices"]["cpu:0"]["collectives"]) == {
      "xla (via jax_smddp):all_gather", "xla:collective_permute", "jax_smddp:reduce_scatter"}
  assert found["devices"]["cpu:0"]["collectives"]["xla (via jax_smddp):all_gather"]["count"] == 2
