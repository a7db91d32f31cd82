"""jax_smddp.tools.trace_summary: the interval arithmetic against a grid, the reading of a GPU
trace's streams (a trace built here in the layout XLA's profiler writes), and a real CPU trace
of a program whose collectives are known."""

import gzip
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_smddp.tools import trace_summary as ts


def grid(intervals, size):
  cells = np.zeros(size, bool)
  for s, e in intervals:
    cells[s:e] = True
  return cells


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(20))
def test_union_and_intersection_equal_a_grid(seed):
  rng = np.random.default_rng(seed)
  size = 200
  def draw():
    starts = rng.integers(0, size, rng.integers(0, 12))
    return [(int(s), int(min(size, s + rng.integers(0, 40)))) for s in starts]
  a, b = draw(), draw()
  ma, mb = ts.merge(a), ts.merge(b)
  assert all(s < e for s, e in ma) and all(ma[i][1] < ma[i + 1][0] for i in range(len(ma) - 1))
  assert ts.length(ma) == grid(a, size).sum()
  assert ts.intersection(ma, mb) == (grid(a, size) & grid(b, size)).sum()


@pytest.mark.timeout(30)
def test_classify_reads_names_and_ops_not_operands():
  def ev(name, **args):
    return {"name": name, "args": args}
  assert ts.classify(ev("smddp_all_gather.7")) == ("jax_smddp", "all_gather")
  assert ts.classify(ev("smddp_reduce_scatter.2")) == ("jax_smddp", "reduce_scatter")
  assert ts.classify(ev("all-reduce.3")) == ("xla", "all_reduce")
  assert ts.classify(ev("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)")) == \
      ("xla", "all_gather")
  assert ts.classify(ev("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL")) == \
      ("xla", "reduce_scatter")
  assert ts.classify(ev("all-to-all.1")) == ("xla", "all_to_all")
  # A kernel of jax_smddp's named by the op that launched it, or by its namespace alone.
  assert ts.classify(ev("void smddp::cuda::(anonymous namespace)::Copy2DKernel(...)",
                        hlo_op="smddp_all_gather.3")) == ("jax_smddp", "all_gather")
  assert ts.classify(ev("void smddp::cuda::(anonymous namespace)::WaitFlagKernel(...)")) == \
      ("jax_smddp", "kernel")
  # Compute that reads a collective's output is not a collective.
  assert ts.classify(ev("loop_add_fusion", hlo_op="add_fusion",
                        long_name="%add_fusion = f32[8] fusion(%all-gather.3)")) is None
  assert ts.classify(ev("sm90_xmma_gemm_f32f32", hlo_op="dot.4")) is None


HLO = """
ENTRY %main.0_spmd (param.1: f32[1024]) -> f32[1024] {
  %param.1 = f32[1024]{0} parameter(0), sharding={devices=[4]<=[4]}, metadata={op_name="a"}
  %smddp_all_gather.6 = u32[] partition-id(), metadata={op_name="jit(body)/smddp_all_gather"}
  %psum_invariant.7 = f32[1024]{0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%region_0.0
  %smddp_all_gather.7 = f32[4096]{0} custom-call(%param.1, %smddp_all_gather.6), custom_call_target="smddp_all_gather", api_version=API_VERSION_TYPED_FFI
  %broadcast_multiply_fusion = f32[4096]{0} fusion(%smddp_all_gather.7), kind=kLoop, calls=%fused_computation
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%param.1), channel_id=2, dimensions={0}
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  ROOT %wrapped_add = f32[1024]{0} fusion(%smddp_reduce_scatter.6, %psum_invariant.7), kind=kLoop
}
"""


@pytest.mark.timeout(30)
def test_hlo_tells_collectives_by_instruction_not_name():
  hlo = ts.hlo_instructions(HLO)
  assert hlo == {"param.1": None, "smddp_all_gather.6": None,
                 "psum_invariant.7": ("xla", "all_reduce"),
                 "smddp_all_gather.7": ("jax_smddp", "all_gather"),
                 "broadcast_multiply_fusion": None, "ag-start": ("xla", "all_gather"),
                 "ag-done": ("xla", "all_gather"), "wrapped_add": None}
  thunk = lambda name: {"name": name, "args": {"hlo_op": name, "device_ordinal": "0"}}
  assert ts.classify(thunk("smddp_all_gather.6")) == ("jax_smddp", "all_gather")  # by name
  assert ts.classify(thunk("smddp_all_gather.6"), hlo) is None  # a partition-id
  assert ts.classify(thunk("psum_invariant.7")) is None
  assert ts.classify(thunk("psum_invariant.7"), hlo) == ("xla", "all_reduce")
  assert ts.classify(thunk("all-gather.9"), hlo) == ("xla", "all_gather")  # not in the HLO


def _gpu_trace():
  """One GPU, its compute on stream 7, jax_smddp's kernels on stream 13 (XLA's collective
  stream), a derived "XLA Ops" line that repeats the ops, and host events: times in µs."""
  m = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind,
                                    "args": {"name": name}}
  x = lambda tid, ts_, dur, name, **args: {"ph": "X", "pid": 3, "tid": tid, "ts": ts_,
                                           "dur": dur, "name": name, "args": args}
  compute = [(0, 40), (50, 30), (100, 60)]            # [0,40) [50,80) [100,160)
  gathers = [(30, 30), (150, 20)]                      # [30,60) [150,170)
  events = [m(1, 0, "process_name", "/host:CPU"), m(3, 0, "process_name", "/device:GPU:0"),
            m(3, 7, "thread_name", "Stream #7(Kernel)"),
            m(3, 13, "thread_name", "Stream #13(Kernel,MemcpyD2D)"),
            m(3, 99, "thread_name", "XLA Ops"),
            {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 500, "name": "smddp_all_gather.3",
             "args": {}}]
  events += [x(7, s, d, "sm90_xmma_gemm", hlo_op=f"dot.{i}") for i, (s, d) in enumerate(compute)]
  events += [x(13, s, d, "void smddp::cuda::(anonymous namespace)::Copy2DKernel()",
               hlo_op="smddp_all_gather.3") for s, d in gathers]
  events += [x(13, 200, 5, "void smddp::cuda::(anonymous namespace)::WaitFlagKernel()")]
  events += [x(99, s, d, "smddp_all_gather.3", hlo_op="smddp_all_gather.3")
             for s, d in gathers]
  return events, compute, gathers + [(200, 5)]


@pytest.mark.timeout(30)
def test_gpu_trace_streams_and_overlap(tmp_path):
  events, compute, collectives = _gpu_trace()
  path = tmp_path / "plugins" / "profile" / "run" / ts.TRACE_NAME
  path.parent.mkdir(parents=True)
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = ts.summarize(ts.load_events(ts.find_trace(str(tmp_path))))
  assert summary["kind"] == "device" and list(summary["devices"]) == ["gpu:0"]
  d = summary["devices"]["gpu:0"]
  assert d["collectives"] == {
      "jax_smddp:all_gather": {"count": 2, "time_s": pytest.approx(50e-6)},
      "jax_smddp:kernel": {"count": 1, "time_s": pytest.approx(5e-6)}}
  assert set(d["streams"]) == {"Stream #7(Kernel)", "Stream #13(Kernel,MemcpyD2D)"}
  assert d["streams"]["Stream #13(Kernel,MemcpyD2D)"]["collectives"] == 3
  assert d["streams"]["Stream #7(Kernel)"]["collective_s"] == 0
  to_cells = lambda spans: grid([(s, s + n) for s, n in spans], 300)
  coll, comp = to_cells(collectives), to_cells(compute)
  assert d["collective_s"] == pytest.approx(coll.sum() * 1e-6)
  assert d["other_s"] == pytest.approx(comp.sum() * 1e-6)
  assert d["overlap_s"] == pytest.approx((coll & comp).sum() * 1e-6)  # 10 + 10 + 10 µs
  assert d["overlap_fraction"] == pytest.approx((coll & comp).sum() / coll.sum())
  assert "beside other work" in ts.format_summary(summary)


@pytest.mark.timeout(30)
def test_a_directory_without_a_trace_says_how_to_record_one(tmp_path, capsys):
  assert ts.main([str(tmp_path)]) == 2
  assert "create_perfetto_trace=True" in capsys.readouterr().err


PROGRAM = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    import jax_smddp
    from jax.sharding import Mesh, PartitionSpec as P
    from jax_smddp.tools import trace_summary as ts
    mesh = Mesh(jax.devices(), ("x",))
    def body(a):
      g = jax_smddp.all_gather(a, "x", tiled=True)     # 1 jax_smddp all_gather per call
      s = jax_smddp.reduce_scatter(g * 2, "x", tiled=True)  # and 1 reduce_scatter
      return s + jax.lax.psum(a, "x")                  # and 1 of XLA's all-reduce
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    a = jnp.arange(4 * 1024, dtype=jnp.float32)
    expect = 2 * 4 * a + jnp.tile(a.reshape(4, -1).sum(0), 4)
    assert jnp.allclose(f(a), expect)
    with jax.profiler.trace(sys.argv[1], create_perfetto_trace=True):
      for _ in range(3):
        f(a).block_until_ready()
    hlo = f.lower(a).compile().as_text()
    print(json.dumps(ts.summarize(ts.load_events(ts.find_trace(sys.argv[1])), hlo)))
""")


@pytest.mark.timeout(180)
def test_cpu_trace_counts_each_device_collectives_by_library(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_SMDDP_COLLECTIVES")}
  proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=150)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["kind"] == "cpu"
  assert sorted(summary["devices"]) == [f"cpu:{i}" for i in range(4)]
  for d in summary["devices"].values():
    counts = {name: c["count"] for name, c in d["collectives"].items()}
    assert counts == {"jax_smddp:all_gather": 3, "jax_smddp:reduce_scatter": 3,
                      "xla:all_reduce": 3}, counts
    assert "streams" not in d and "overlap_s" not in d
