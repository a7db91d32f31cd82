"""The CUDA backend where there is no GPU: the build (kernels for sm_80 and
sm_90, a CPU-only build that says so) and the lowering for CUDA (the plugin's
custom calls, each on XLA's collective stream; fallbacks to XLA's own
collectives). Runs on GPUs are in tests/gpu/."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_smddp
from jax_smddp import _native, gpu, requirements

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def fatbin_entries(path: str) -> set:
  """(kind, sm) of every entry of the CUDA fat binaries embedded in `path`."""
  data = open(path, "rb").read()
  magic = struct.pack("<I", 0xBA55ED50)
  out, pos = set(), data.find(magic)
  while pos >= 0:
    _, _, header, size = struct.unpack_from("<IHHQ", data, pos)
    off, end = pos + header, pos + header + size
    while off < end:
      kind, _, entry_header, padded = struct.unpack_from("<HHII", data, off)
      sm = struct.unpack_from("<I", data, off + 28)[0]
      out.add(({1: "ptx", 2: "cubin"}.get(kind, str(kind)), sm))
      if entry_header == 0:
        break
      off += entry_header + padded
    pos = data.find(magic, end)
  return out


@pytest.mark.skipif(NVCC is None, reason="no nvcc: the install is CPU only")
def test_built_with_kernels_for_a100_and_h100():
  assert gpu.available(), "nvcc is installed but the CUDA backend was not built"
  entries = fatbin_entries(_native.cuda_engine().__file__)
  assert ("cubin", 80) in entries and ("cubin", 90) in entries, entries
  assert ("ptx", 90) in entries, entries  # newer GPUs compile the PTX


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_extension_imports_without_a_gpu(monkeypatch):
  for name in ("JAX_SMDDP_GPU_COPIES", "JAX_SMDDP_GPU_FLAGS", "JAX_SMDDP_GPU_MAX_BLOCKS",
               "JAX_SMDDP_GPU_FLAG_MEMORY", "JAX_SMDDP_GPU_DIRECT_READS", "JAX_SMDDP_GPU_GRAPHS"):
    monkeypatch.delenv(name, raising=False)
  ext = _native.cuda_engine()
  if not os.path.exists("/dev/nvidiactl"):
    assert ext.device_count() == 0  # no driver here: reported, not raised
  assert ext.settings() == {"copies": "engine", "flags": "memops", "max_blocks": 16,
                            "flag_memory": "host", "direct_reads": True, "graphs": False}
  monkeypatch.setenv("JAX_SMDDP_GPU_FLAG_MEMORY", "device")
  assert ext.settings()["flag_memory"] == "device"
  monkeypatch.setenv("JAX_SMDDP_GPU_FLAG_MEMORY", "pinned")
  with pytest.raises(RuntimeError, match="JAX_SMDDP_GPU_FLAG_MEMORY='pinned' is not valid: it takes one of device\\|host"):
    ext.settings()
  monkeypatch.setenv("JAX_SMDDP_GPU_FLAG_MEMORY", "host")
  monkeypatch.setenv("JAX_SMDDP_GPU_DIRECT_READS", "0")
  assert ext.settings()["direct_reads"] is False
  monkeypatch.setenv("JAX_SMDDP_GPU_DIRECT_READS", "1")
  assert ext.settings()["direct_reads"] is True
  # Only with JAX_SMDDP_GPU_GRAPHS=1 do the handlers tell XLA it may capture them.
  assert _native.cuda_target_traits() == {}
  monkeypatch.setenv("JAX_SMDDP_GPU_GRAPHS", "1")
  assert ext.settings()["graphs"] is True
  from jaxlib import xla_client
  assert _native.cuda_target_traits() == {
      "traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
  monkeypatch.setenv("JAX_SMDDP_GPU_DIRECT_READS", "yes")
  with pytest.raises(RuntimeError, match="JAX_SMDDP_GPU_DIRECT_READS='yes' is not valid: it takes one of 0\\|1"):
    ext.settings()
  assert set(ext.counters()) == {"copy_kernels", "engine_copies", "reduce_kernels",
                                 "flag_kernels", "flag_memops", "direct_reads", "handler_calls",
                                 "handler_ns"}
  # The exit hook with no group set up: nothing to wait for, nothing to close.
  assert ext.close_at_exit() is True


def test_exit_hook_warns_when_the_network_stayed_busy(caplog):
  class Busy:  # a proxy still running steps: close_at_exit closed nothing
    def close_at_exit(self):
      return False
  from jax_smddp import gpu
  with caplog.at_level("WARNING", logger="jax_smddp"):
    gpu._close_at_exit(Busy())
  assert "libfabric endpoints left open" in caplog.text


def test_configure_without_cuda_says_so(tmp_path):
  """JAX_SMDDP_CUDA=OFF (what a machine without nvcc gets) configures the CPU
  backend only and warns that GPU collectives lower to XLA's."""
  cmake = os.path.join(os.path.dirname(sys.executable), "cmake")
  if not os.path.exists(cmake):
    cmake = shutil.which("cmake")
  if not cmake:
    pytest.skip("no cmake")
  run = subprocess.run([cmake, "-S", REPO, "-B", str(tmp_path), "-G", "Ninja",
                        f"-DPython_EXECUTABLE={sys.executable}", "-DJAX_SMDDP_CUDA=OFF"],
                       capture_output=True, text=True, timeout=110)
  if run.returncode != 0 and "Ninja" in run.stderr:
    run = subprocess.run([cmake, "-S", REPO, "-B", str(tmp_path / "make"),
                          f"-DPython_EXECUTABLE={sys.executable}", "-DJAX_SMDDP_CUDA=OFF"],
                         capture_output=True, text=True, timeout=110)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "building the CPU backend only" in " ".join(run.stderr.split())
  build_rules = "".join(p.read_text(errors="ignore") for p in tmp_path.rglob("*.ninja"))
  build_rules += "".join(p.read_text(errors="ignore") for p in tmp_path.rglob("Makefile2"))
  assert "_smddp_cpu" in build_rules and "_smddp_cuda" not in build_rules


# --- lowering for CUDA on CPU devices -------------------------------------

def lower_cuda(body, shape=(64,), dtype=jnp.float32, n=8, in_spec=P("x"), out_spec=P("x")):
  mesh = jax.make_mesh((n,), ("x",))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
  x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, in_spec))
  return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


def plugin_calls(text: str) -> list[str]:
  return re.findall(r"custom_call @(smddp_\w+)", text)


def annotated_calls(text: str) -> int:
  return len(re.findall(r'func\.call @compute_on\w*\(.*_xla_stream_annotation = "collective"', text))


needs_cuda_ext = pytest.mark.skipif(NVCC is None, reason="built without CUDA")


@needs_cuda_ext
@pytest.mark.parametrize("op,body,want", [
    ("all_gather", lambda x: jax_smddp.all_gather(x, "x", tiled=True), "smddp_all_gather"),
    ("all_gather untiled axis 1",
     lambda x: jax_smddp.all_gather(x.reshape(2, -1), "x", axis=1).reshape(-1)[:8],
     "smddp_all_gather"),
    ("psum_scatter", lambda x: jax_smddp.psum_scatter(x, "x", tiled=True), "smddp_reduce_scatter"),
    ("psum", lambda x: jax_smddp.psum(x, "x"), "smddp_all_reduce"),
    ("pmax", lambda x: jax_smddp.pmax(x, "x"), "smddp_all_reduce"),
    ("all_to_all", lambda x: jax_smddp.all_to_all(x, "x", 0, 0, tiled=True), "smddp_all_to_all"),
])
def test_each_collective_lowers_to_the_cuda_custom_call_on_the_collective_stream(op, body, want):
  shape = (8 * 64,)
  text = lower_cuda(body, shape=shape)
  calls = plugin_calls(text)
  assert calls == [want], (op, calls)
  assert annotated_calls(text) == len(calls), text[:3000]
  # The CUDA call takes the input only and names each partition's device.
  line = next(l for l in text.splitlines() if f"custom_call @{want}" in l)
  assert "ordinals = dense<[0, 1, 2, 3, 4, 5, 6, 7]>" in line
  assert "processes = dense<0>" in line
  assert re.search(rf"@{want}\(%\w+\) ", line), line


@needs_cuda_ext
def test_fsdp_step_lowers_every_collective_annotated():
  """A gradient step (gather forward, reduce-scatter backward): every plugin
  call, forward and backward, is on the collective stream."""
  def loss(w, x):
    full = jax_smddp.all_gather(w, "x", tiled=True)
    return jnp.sum(jnp.tanh(x @ full.reshape(16, -1)) ** 2)

  mesh = jax.make_mesh((8,), ("x",))
  step = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("x"), P()),
                               out_specs=P("x")))
  w = jax.ShapeDtypeStruct((16 * 32,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  x = jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
  text = step.trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
  calls = plugin_calls(text)
  assert sorted(calls) == ["smddp_all_gather", "smddp_reduce_scatter"], calls
  assert annotated_calls(text) == 2


@needs_cuda_ext
@pytest.mark.parametrize("mesh_shape,axis,annotated", [
    ((1,), "x", 0),          # one device: the whole group is this rank
    ((8, 1), "y", 0),        # an axis of size one in a bigger mesh
    ((4, 2), "y", 1),        # two ranks per group: on the collective stream
])
def test_groups_of_one_stay_on_the_compute_stream(mesh_shape, axis, annotated):
  """A group of one rank has nobody to overlap with: its call is a local copy, and the
  annotation's hand-off between streams is all it would add (measured on an H200: 4.5 ms
  per step annotated against 3.3 ms not, 1 process). Still jax_smddp's custom call."""
  names = ("x", "y")[:len(mesh_shape)]
  mesh = jax.make_mesh(mesh_shape, names)
  spec = P(names)
  body = lambda v: jax_smddp.psum_scatter(jax_smddp.all_gather(v, axis, tiled=True), axis,
                                          tiled=True)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  x = jax.ShapeDtypeStruct((8 * 64,), jnp.float32, sharding=NamedSharding(mesh, spec))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert plugin_calls(text) == ["smddp_all_gather", "smddp_reduce_scatter"], text[:2000]
  assert annotated_calls(text) == 2 * annotated, text[:3000]


@needs_cuda_ext
def test_stream_annotation_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("JAX_SMDDP_GPU_STREAM", "compute")
  text = lower_cuda(lambda x: jax_smddp.all_gather(x, "x", tiled=True))
  assert plugin_calls(text) == ["smddp_all_gather"]
  assert annotated_calls(text) == 0 and "_xla_stream_annotation" not in text
  monkeypatch.setenv("JAX_SMDDP_GPU_STREAM", "sideways")
  with pytest.raises(ValueError, match="JAX_SMDDP_GPU_STREAM"):
    lower_cuda(lambda x: jax_smddp.all_gather(x, "x", tiled=True) * 2)


@needs_cuda_ext
def test_unsupported_calls_lower_to_xla_without_annotation():
  """Element types the engine does not move stay XLA's collectives, and are
  not put on the collective stream by jax_smddp."""
  text = lower_cuda(lambda x: jax_smddp.all_gather(x, "x", tiled=True), dtype=jnp.complex64)
  assert plugin_calls(text) == []
  assert "all_gather" in text and "_xla_stream_annotation" not in text


def test_cpu_lowering_is_unchanged_by_the_cuda_rule():
  mesh = jax.make_mesh((8,), ("x",))
  f = jax.jit(jax.shard_map(lambda x: jax_smddp.all_gather(x, "x", tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
  x = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  text = f.trace(x).lower().as_text()
  assert plugin_calls(text) == ["smddp_all_gather"]
  assert "_xla_stream_annotation" not in text and "ordinals" not in text


@needs_cuda_ext
def test_backend_swap_lowers_lax_collectives_for_cuda():
  jax_smddp.use("all")
  try:
    text = lower_cuda(lambda x: jax.lax.psum_scatter(jax.lax.all_gather(x, "x", tiled=True), "x",
                                                      tiled=True))
  finally:
    jax_smddp.use("none")
  assert plugin_calls(text) == ["smddp_all_gather", "smddp_reduce_scatter"]
  assert annotated_calls(text) == 2


def test_without_the_cuda_extension_collectives_fall_back_and_warn(monkeypatch, caplog):
  monkeypatch.setattr(_native, "_smddp_cuda", None)
  _native.register_cuda_targets.cache_clear()
  requirements._warned.clear()
  try:
    with caplog.at_level(logging.WARNING, logger="jax_smddp"):
      text = lower_cuda(lambda x: jax_smddp.all_gather(x, "x", tiled=True))
  finally:
    _native.register_cuda_targets.cache_clear()
  assert plugin_calls(text) == [] and "all_gather" in text
  assert "built without CUDA" in caplog.text
  assert not gpu.available()


def test_slot_size_setting_is_checked(monkeypatch):
  monkeypatch.setenv("JAX_SMDDP_GPU_SLOT_BYTES", "1000")
  with pytest.raises(ValueError, match="a byte count from 4096"):
    gpu.slot_bytes()
  monkeypatch.setenv("JAX_SMDDP_GPU_SLOT_BYTES", "lots")
  with pytest.raises(ValueError, match="'lots' is not valid"):
    gpu.slot_bytes()
  monkeypatch.setenv("JAX_SMDDP_GPU_SLOT_BYTES", str(1 << 20))
  assert gpu.slot_bytes() == 1 << 20


def test_fabric_hmem_setting_is_checked(monkeypatch):
  monkeypatch.delenv("JAX_SMDDP_FABRIC_HMEM", raising=False)
  assert gpu.fabric_hmem() == "0"  # staging until a GPU + EFA run validates FI_HMEM
  for value in ("auto", "1", "0", " AUTO "):
    monkeypatch.setenv("JAX_SMDDP_FABRIC_HMEM", value)
    assert gpu.fabric_hmem() == value.strip().lower()
  monkeypatch.setenv("JAX_SMDDP_FABRIC_HMEM", "yes")
  with pytest.raises(ValueError, match="JAX_SMDDP_FABRIC_HMEM='yes' is not valid: it takes one of 0\\|auto\\|1"):
    gpu.fabric_hmem()


class _Store:
  """jax.distributed's key-value store, as _rail_addresses uses it."""

  def __init__(self, entries):
    self.entries = dict(entries)

  def key_value_set(self, key, value):
    assert key not in self.entries, f"{key} set twice"
    self.entries[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    return self.entries[key]


class _RailExt:
  def __init__(self, address, why=""):
    self.opened = 0
    self.result = (address, why)

  def open_device_rail(self, ordinal):
    self.opened += 1
    return self.result


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_rails_are_used_only_when_every_process_of_the_group_has_one(monkeypatch, caplog, mode):
  """Each process opens its FI_HMEM rail once and publishes its address (or why
  it has none); a group stages through host memory unless all of its processes
  published an address, so all decide alike. =1 makes the missing rail an error
  naming the process and its reason."""
  import base64
  from jax_smddp import distributed
  monkeypatch.setenv("JAX_SMDDP_FABRIC_HMEM", mode)
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  devices = [_Device(p) for p in (0, 1, 2, 3)]
  store = _Store({"jax_smddp/gpu/rail/1": base64.b64encode(b"addr-1").decode(),
                  "jax_smddp/gpu/rail/2": "none:libfabric provider 'tcp;ofi_rxm' offers no "
                                          "endpoint here ... (FI_HMEM with tagged messages)"})
  monkeypatch.setattr(distributed, "_client", lambda: store)
  monkeypatch.setattr(gpu, "_rail_published", False)
  ext = _RailExt(b"addr-0")
  # Processes 0 and 1 both have rails: addresses by process index, b"" for others.
  assert gpu._rail_addresses(ext, (0, 1), devices, 0, 0) == [b"addr-0", b"addr-1", b"", b""]
  assert store.entries["jax_smddp/gpu/rail/0"] == base64.b64encode(b"addr-0").decode()
  # A group with process 2, which has none.
  if mode == "1":
    with pytest.raises(RuntimeError, match=r"process 2: libfabric provider 'tcp;ofi_rxm'.*FI_HMEM"):
      gpu._rail_addresses(ext, (0, 2), devices, 0, 0)
  else:
    with caplog.at_level(logging.INFO, logger="jax_smddp"):
      assert gpu._rail_addresses(ext, (0, 2), devices, 0, 0) == []
    assert "process 2" in caplog.text and "host memory" in caplog.text
    # groups_across_hosts() tells why (what the GPU tests print).
    assert gpu._why_staged[(0, 2)].startswith("process 2: libfabric provider 'tcp;ofi_rxm'")
  assert ext.opened == 1  # once per process


def test_groups_across_hosts_report_what_set_up_chose(monkeypatch):
  """gpu.groups_across_hosts() says, per group, how many hosts, whether GDRCopy
  signals and whether device-memory slots (a rail) were set up: what the GPU
  tests log to show which path ran. The intra-host group and the hosts'
  order are derived alike in every process."""
  from jax_smddp import distributed
  calls = []

  class Ext:
    def prepare_hierarchy(self, members, host_of, process_of, local, intra, slot, rails):
      calls.append((members, host_of, process_of, local, intra, rails))
      return True, bool(rails)

  class Dev:
    def __init__(self, process, hw):
      self.process_index, self.local_hardware_id = process, hw

  monkeypatch.setattr(distributed, "ensure_initialized", lambda: None)
  monkeypatch.setattr(gpu, "_prepare_group", lambda ext, members, devices, me: None)
  monkeypatch.setattr(gpu, "_rail_addresses", lambda ext, members, devices, me, ordinal: [b"a", b"b"])
  monkeypatch.setattr(gpu, "_across_hosts", {})
  devices = [Dev(0, 0), Dev(0, 1), Dev(1, 0), Dev(1, 1)]
  gpu._prepare_hierarchy(Ext(), (0, 1, 2, 3), ["hB", "hB", "hA", "hA"], devices, 1)
  assert calls == [([0, 1, 2, 3], [0, 0, 1, 1], [0, 0, 1, 1], [(2, 0), (3, 1)], [2, 3],
                    [b"a", b"b"])]
  assert gpu.groups_across_hosts() == {(0, 1, 2, 3): {"hosts": 2, "gdrcopy": True,
                                                      "device_slots": True,
                                                      "staged_because": ""}}


def test_no_rail_is_opened_by_default(monkeypatch):
  monkeypatch.delenv("JAX_SMDDP_FABRIC_HMEM", raising=False)
  ext = _RailExt(b"addr")
  assert gpu._rail_addresses(ext, (0, 1), [_Device(0), _Device(1)], 0, 0) == []
  assert ext.opened == 0
  assert gpu._why_staged[(0, 1)] == "JAX_SMDDP_FABRIC_HMEM=0 (the default)"


class _Device:
  platform = "gpu"

  def __init__(self, process):
    self.process_index = process


class _Mesh:
  def __init__(self, processes):
    self.devices = np.array([_Device(p) for p in processes], dtype=object)


@needs_cuda_ext
def test_which_groups_cross_hosts_on_gpus(monkeypatch):
  """all_gather, reduce_scatter, all_reduce and all_to_all cross hosts on
  GPUs, only with equal ranks per host; other ops over such groups lower to
  XLA's."""
  monkeypatch.setattr(gpu, "_hosts", lambda: ["a", "a", "b", "b", "b"])
  even = _Mesh([0, 1, 2, 3])
  assert gpu.unsupported(even, [[0, 1]], "psum_scatter") is None  # inside host a
  assert gpu.unsupported(even, [[0, 1, 2, 3]], "all_gather") is None
  assert gpu.unsupported(even, [[0, 1, 2, 3]], "reduce_scatter") is None
  assert gpu.unsupported(even, [[0, 1, 2, 3]], "all_reduce") is None
  assert gpu.unsupported(even, [[0, 1, 2, 3]], "all_to_all") is None
  assert gpu.unsupported(even, [[0, 2], [1, 3]], "all_to_all") is None
  assert "spans hosts" in gpu.unsupported(even, [[0, 2], [1, 3]], "broadcast")
  assert gpu.spans_hosts(even, [[0, 2], [1, 3]]) and not gpu.spans_hosts(even, [[0, 1]])
  uneven = _Mesh([0, 1, 2, 3, 4])
  assert "different numbers of ranks" in gpu.unsupported(uneven, [[0, 1, 2, 3, 4]], "all_gather")


def test_gpu_benchmark_arithmetic():
  """The GPU benchmark's sizes and columns (its runs need a GPU): 4 ranks,
  16 MiB each in 1 ms -> algbw 67.1 GB/s, busbw 50.3, moved 201.3, written
  268.4 (4 outputs of 64 MiB)."""
  from jax_smddp.tools import gpu_bench
  assert gpu_bench.parse_size("16M") == 16 << 20 and gpu_bench.parse_size("512K") == 512 << 10
  row = {"bytes_per_rank": 16 << 20, "ranks": 4, "mode": "engine", "smddp_s": 1e-3,
         "copy_Bps": 400e9}
  line = gpu_bench.report([row]).splitlines()[1].split()
  assert line[:5] == ["all_gather", "16384K", "4", "engine", "1000.0"]
  assert [float(v) for v in line[5:11]] == [67.1, 50.3, 201.3, 400.0, 0.5, 0.67]
  # reduce_scatter writes one shard per rank: written = algbw
  line = gpu_bench.report([{**row, "op": "reduce_scatter"}]).splitlines()[1].split()
  assert float(line[10]) == round(67.1 / 400, 2)
  # all_reduce moves twice the bytes per rank: busbw = algbw x 2 (n - 1) / n
  line = gpu_bench.report([{**row, "op": "all_reduce"}]).splitlines()[1].split()
  assert [float(v) for v in line[5:8]] == [67.1, 100.7, 402.7]
  # Reductions: 4 ranks each read 4 sources of 16 MiB (4 x 4 x 16 MiB = 268.4 MB) per 1 ms
  # against 400 GB/s copies: read/copy 0.67; a bare kernel of those sources and the same
  # 8 blocks took 0.5 ms: vs kernel 0.50. Other ops have neither.
  red = {**row, "op": "reduce_scatter", "reduce_ref_s": 0.5e-3, "max_blocks": 8}
  assert [round(v, 2) for v in gpu_bench.reduction_ratios(red)] == [0.67, 0.5]
  assert gpu_bench.reduction_ratios({**red, "op": "all_reduce", "smddp_s": 2e-3}) \
      == pytest.approx((268435456 / 2e-3 / 400e9, 0.25))
  assert gpu_bench.reduction_ratios(row) == (None, None)
  line = gpu_bench.report([red]).splitlines()[1].split()
  assert line[11:14] == ["0.67", "0.50", "8"]
  assert gpu_bench.report([row]).splitlines()[1].split()[11:14] == ["-", "-", "-"]
  # The direct column: the setting, and whether the timed calls read in place.
  assert gpu_bench.report([row]).splitlines()[1].split()[-3] == "0:staged"
  assert gpu_bench.report([{**row, "direct_reads": "1", "direct_calls": 21}]).splitlines()[1] \
      .split()[-4:-2] == ["1:in", "place"]
  assert gpu_bench.report([{**row, "direct_reads": "1", "direct_calls": 0}]).splitlines()[1] \
      .split()[-3] == "1:staged"
  # The host's handler time per call, last.
  assert gpu_bench.report([{**row, "host_s": 41.5e-6}]).splitlines()[1].split()[-1] == "41.5"
  # The latency of one call waited for, beside the back-to-back time.
  assert gpu_bench.report([{**row, "synced_s": 1.5e-3}]).splitlines()[1].split()[-2] == "1500.0"
  # What the JSON keeps beside each row.
  assert gpu_bench.metrics(red) == pytest.approx(
      {"moved_per_copy": 3 * 67.108864e9 / 400e9, "written_per_copy": 67.108864e9 / 400e9,
       "read_per_copy": 268435456 / 1e-3 / 400e9, "vs_kernel": 0.5})
  assert gpu_bench.metrics(row)["read_per_copy"] is None


@pytest.mark.timeout(240)
def test_gpu_benchmark_programs_run_and_check_on_cpu_processes(tmp_path, capsys):
  """The benchmark's processes, programs and result checks, on CPU devices
  (--platform cpu): 2 processes, every op, two sizes, both direct-read
  settings (on CPU nothing reads in place: the column says so); each op's
  output (all_to_all's too, which runs on request) was compared with the
  reference before it was timed."""
  from jax_smddp.tools import gpu_bench
  out = tmp_path / "bench.json"
  rc = gpu_bench.main(["--platform", "cpu", "--processes", "2", "--sizes", "4K,36K", "--iters", "2",
                       "--modes", "engine", "--direct-reads", "0,1", "--json", str(out),
                       "--timeout", "200", "--ops", ",".join(gpu_bench.OPS)])
  text = capsys.readouterr()
  assert rc == 0, text
  rows = json.loads(out.read_text())["rows"]
  assert [(r["direct_reads"], r["op"], r["bytes_per_rank"]) for r in rows] == \
      [(d, op, s) for d in "01" for op in gpu_bench.OPS for s in (4 << 10, 36 << 10)]
  assert all(r["ranks"] == 2 and r["smddp_s"] > 0 and r["direct_calls"] == 0 for r in rows)
  assert all(r["synced_s"] > 0 and r["written_per_copy"] is None for r in rows)  # no copy rate on CPU
  # The bare-kernel reference is the GPU's: on CPU processes it is absent, never made up.
  assert all(r["reduce_ref_s"] is None for r in rows if r["op"] in ("reduce_scatter", "all_reduce"))
  assert "1:staged" in text.out and "JAX_SMDDP_GPU_DIRECT_READS=1" in text.out
  with pytest.raises(SystemExit):
    gpu_bench.main(["--ops", "all_gather,broadcast"])
  with pytest.raises(SystemExit):
    gpu_bench.main(["--direct-reads", "0,yes"])


@pytest.mark.timeout(240)
def test_gpu_benchmark_across_simulated_hosts_on_cpu_processes(tmp_path, capsys):
  """--hosts 2 names the processes as two hosts (the groups cross hosts, over
  the world's libfabric links) and --fabric-hmem times each setting in one
  run; on CPU devices every op is still checked before it is timed."""
  from jax_smddp.tools import gpu_bench
  out = tmp_path / "bench.json"
  rc = gpu_bench.main(["--platform", "cpu", "--processes", "2", "--hosts", "2", "--fabric-hmem",
                       "0,auto", "--sizes", "4K", "--iters", "2", "--modes", "engine", "--json",
                       str(out), "--timeout", "200", "--ops", ",".join(gpu_bench.OPS)])
  text = capsys.readouterr()
  assert rc == 0, text
  rows = json.loads(out.read_text())["rows"]
  assert [(r["op"], r["fabric_hmem"]) for r in rows] == \
      [(op, h) for h in ("0", "auto") for op in gpu_bench.OPS]
  assert all(r["hosts"] == 2 for r in rows)
  assert "auto:-" in text.out  # on CPU no GPU group was set up
  with pytest.raises(SystemExit):
    gpu_bench.main(["--processes", "3", "--hosts", "2"])


@needs_cuda_ext
@pytest.mark.parametrize("count", [64, 61])
def test_all_reduce_across_hosts_lowers_to_the_engines_one_body(monkeypatch, count):
  """Over hosts, psum on GPUs is one all_reduce custom call (the engine runs it as its
  hierarchical reduce-scatter and all-gather, RunStreamHierarchicalAllReduce), on n equal
  shards: a count that does not divide by the ranks is padded and the padding sliced off."""
  monkeypatch.setattr(gpu, "spans_hosts", lambda mesh, groups: True)
  monkeypatch.setattr(gpu, "prepare", lambda mesh, groups: None)
  text = lower_cuda(lambda x: jax_smddp.psum(x, "x"), shape=(8 * count,))  # count per rank
  assert plugin_calls(text) == ["smddp_all_reduce"], text[:2000]
  assert annotated_calls(text) == 1
  padded = -(-count // 8) * 8
  assert f"tensor<{padded}xf32>" in text, text[:2000]
  assert ("stablehlo.pad" in text) == (count % 8 != 0)
  assert ("stablehlo.slice" in text) == (count % 8 != 0)
