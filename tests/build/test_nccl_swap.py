"""The XLA-level swap on GPUs (jax_smddp/swap/nccl.py) without a GPU: the NCCL API front
end (libsmddp_nccl.so) as a library (its soname, what it exports, that it loads and answers
without a GPU, that it forwards to the real NCCL by path), XLA_FLAGS (left alone at start-up,
the command buffer flag added as the CUDA client is made), the start-up hook's loading of the
front end before JAX's CUDA plugin loads NCCL (a stand-in plugin that loads a stand-in NCCL, as
the real one does in its initialize()), the real NCCL's finder, and traffic_by_op's names.
The same swap on a GPU: tests/gpu/test_xla_swap_gpu.py."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from jax_smddp import distributed

from jax_smddp.swap import nccl as nccl_swap

pytestmark = pytest.mark.timeout(180)

IN_CI = os.environ.get("CI") == "true"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
FRONT_END = nccl_swap.library_path()


def _front_end_built() -> str | None:
  """Why the front end cannot be tested here (None when it can): a CPU-only build
  (no nvcc) has none; a build with nvcc must have it."""
  if NVCC is None:
    return "no nvcc: the install is CPU only, without libsmddp_nccl.so"
  if not os.path.exists(FRONT_END):
    return None if IN_CI else f"{FRONT_END} is not built (pip install --no-build-isolation -e .)"
  return None


needs_front_end = pytest.mark.skipif(_front_end_built() is not None, reason=str(_front_end_built()))


def _env(**extra) -> dict:
  """This environment without the suite's own settings (as a user starts Python)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH") and not k.startswith("JAX_SMDDP_")}
  env.update(extra)
  return env


def _python(code: str, cwd, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=_env(**env),
                        capture_output=True, text=True, timeout=150)


# --- the library ------------------------------------------------------------------------

def elf_dynamic(path: str) -> tuple[str | None, list[str], list[str]]:
  """(DT_SONAME, DT_NEEDED, the global symbols it defines) of an ELF64 little-endian shared
  library: what readelf -d and nm -D --defined-only show."""
  data = open(path, "rb").read()
  assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
  sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
  # (name, type, flags, addr, offset, size, link, info, addralign, entsize)

  def string(table, at):
    off = sections[table][4] + at
    return data[off:data.index(b"\0", off)].decode()

  soname, needed, defined = None, [], []
  for sec in sections:
    if sec[1] == 6:  # SHT_DYNAMIC
      for off in range(sec[4], sec[4] + sec[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 14:
          soname = string(sec[6], val)
        elif tag == 1:
          needed.append(string(sec[6], val))
    if sec[1] == 11:  # SHT_DYNSYM
      for off in range(sec[4], sec[4] + sec[5], 24):
        name, info, other, shndx = struct.unpack_from("<IBBH", data, off)
        bind, visibility = info >> 4, other & 3
        if name and shndx != 0 and bind in (1, 2) and visibility in (0, 3):  # defined, global|weak
          defined.append(string(sec[6], name))
  return soname, needed, sorted(set(defined))


# What XLA's GPU backend calls (docs/gpu_xla_swap.md), jax_smddp's entry points, and more of
# the NCCL API that is forwarded.
EXPORTS = {
    "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig",
    "ncclCommInitRankScalable", "ncclCommSplit", "ncclCommFinalize", "ncclCommDestroy",
    "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount", "ncclCommUserRank",
    "ncclCommCuDevice", "ncclGetErrorString", "ncclGetLastError", "ncclAllGather",
    "ncclReduceScatter", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAlltoAll",
    "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd", "ncclMemAlloc", "ncclMemFree",
    "ncclCommRegister", "ncclCommDeregister", "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy",
    "smddp_nccl_configure", "smddp_nccl_describe",
}


@needs_front_end
def test_the_front_end_is_named_libnccl_and_exports_the_nccl_api_alone():
  """Its soname is the one JAX's CUDA plugin opens; it exports the NCCL names XLA calls and
  jax_smddp's two entry points, nothing of the engine it links (no C++ name); it needs no
  NCCL, no CUDA runtime (linked statically) and no driver library to load."""
  soname, needed, defined = elf_dynamic(FRONT_END)
  assert soname == "libnccl.so.2", soname
  missing = sorted(EXPORTS - set(defined))
  assert not missing, missing
  foreign = [s for s in defined if not (s.startswith("nccl") or s.startswith("smddp_nccl_"))]
  assert not foreign, foreign[:20]
  assert not [s for s in defined if s.startswith("_Z")]
  assert not [n for n in needed if n.startswith(("libnccl", "libcudart", "libcuda."))], needed
  if shutil.which("nm"):  # the same, as nm -D tells it
    nm = subprocess.run(["nm", "-D", "--defined-only", FRONT_END], capture_output=True, text=True,
                        timeout=60)
    names = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert EXPORTS <= names and not [n for n in names if n.startswith("_Z")], sorted(names)[:20]


@needs_front_end
def test_the_front_end_loads_and_answers_without_a_gpu(tmp_path):
  """Loaded as jax_smddp loads it (RTLD_LOCAL) on a machine without a GPU or NCCL: describe()
  is JSON, ncclGetVersion answers (the oldest version it knows, no real library being set),
  errors come back as NCCL codes with a message (ncclGetLastError), never as a crash."""
  run = _python(f"""
      import ctypes, json, os
      lib = ctypes.CDLL({FRONT_END!r}, mode=os.RTLD_LOCAL)
      lib.smddp_nccl_describe.restype = ctypes.c_char_p
      lib.ncclGetErrorString.restype = ctypes.c_char_p
      lib.ncclGetLastError.restype = ctypes.c_char_p
      lib.ncclGetLastError.argtypes = [ctypes.c_void_p]
      out = {{"describe": json.loads(lib.smddp_nccl_describe().decode())}}
      v = ctypes.c_int()
      out["version_rc"] = lib.ncclGetVersion(ctypes.byref(v))
      out["version"] = v.value
      out["invalid_usage"] = lib.ncclGetErrorString(5).decode()
      class UniqueId(ctypes.Structure):  # ncclUniqueId, passed by value
        _fields_ = [("internal", ctypes.c_char * 128)]
      lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                       ctypes.c_int]
      uid = UniqueId()
      out["unique_id_rc"] = lib.ncclGetUniqueId(ctypes.byref(uid))
      comm = ctypes.c_void_p()
      out["init_rc"] = lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0)
      out["init_error"] = lib.ncclGetLastError(None).decode()
      out["no_comm_rc"] = lib.ncclAllGather(None, None, 0, 7, None, None)
      out["no_comm_error"] = lib.ncclGetLastError(None).decode()
      print(json.dumps(out))
      """, tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["describe"] == {"served": {}, "captured": 0, "forwarded": {}, "reasons": [], "library": "",
                             "version": 0}, out
  assert out["version_rc"] == 0 and 22700 <= out["version"] < 30000, out
  assert out["invalid_usage"] == "invalid usage", out
  assert out["unique_id_rc"] == 0, out
  # No GPU here: the communicator cannot be made, and the error says where it stopped.
  assert out["init_rc"] != 0, out
  assert out["init_error"].startswith("jax_smddp[internal] NCCL front end: cudaGetDevice"), out
  assert out["no_comm_rc"] == 4, out  # ncclInvalidArgument: a handle it did not make
  assert "ncclAllGather on a communicator it did not create" in out["no_comm_error"], out


def _compile_fake_nccl(site) -> str:
  """A stand-in for the nvidia-nccl wheel's library, at SITE/nvidia/nccl/lib/libnccl.so.2
  (soname libnccl.so.2): ncclGetVersion says 2.28.9, ncclGetErrorString says "fake NCCL"."""
  cc = shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    assert not IN_CI, "CI builds the package, so it has a C compiler"
    pytest.skip("no C compiler for the stand-in NCCL")
  lib = site / "nvidia" / "nccl" / "lib"
  lib.mkdir(parents=True, exist_ok=True)
  src = site / "fake_nccl.c"
  src.write_text("int ncclGetVersion(int* v) { *v = 22809; return 0; }\n"
                 "const char* ncclGetErrorString(int r) { (void)r; return \"fake NCCL\"; }\n")
  out = lib / "libnccl.so.2"
  subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(out), str(src)],
                 check=True, timeout=60)
  return str(out)


@needs_front_end
def test_the_front_end_forwards_to_the_real_nccl_by_path(tmp_path):
  """Configured with the real library's path (what jax_smddp does), calls it does not
  serve go there: ncclGetVersion and ncclGetErrorString are the stand-in's, and describe()
  names it; JAX_SMDDP_NCCL_LIBRARY overrides the path, and a bare soname is refused (it
  would name the front end itself)."""
  real = _compile_fake_nccl(tmp_path)
  probe = f"""
      import ctypes, json, os
      lib = ctypes.CDLL({FRONT_END!r}, mode=os.RTLD_LOCAL)
      lib.smddp_nccl_describe.restype = ctypes.c_char_p
      lib.smddp_nccl_configure.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p]
      lib.ncclGetErrorString.restype = ctypes.c_char_p
      lib.smddp_nccl_configure(0, 0, os.environ.get("PROBE_CONFIGURE", "").encode())
      v = ctypes.c_int()
      lib.ncclGetVersion(ctypes.byref(v))
      print(json.dumps({{"describe": json.loads(lib.smddp_nccl_describe().decode()),
                        "version": v.value, "error": lib.ncclGetErrorString(3).decode()}}))
      """
  run = _python(probe, tmp_path, PROBE_CONFIGURE=real)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["describe"]["library"] == real and out["describe"]["version"] == 22809, out
  assert out["version"] == 22809 and out["error"] == "fake NCCL", out
  run = _python(probe, tmp_path, PROBE_CONFIGURE="/nowhere/libnccl.so.2",
                JAX_SMDDP_NCCL_LIBRARY=real)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["describe"]["library"] == real and out["version"] == 22809, out
  run = _python(probe, tmp_path, JAX_SMDDP_NCCL_LIBRARY="libnccl.so.2")
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["describe"]["version"] == 0 and out["error"] == "internal error", out


# --- the real NCCL's finder ---------------------------------------------------------------

def test_the_real_nccl_is_found_where_the_nvidia_wheels_put_it(tmp_path):
  """nvidia/nccl/lib/libnccl.so.2 (nvidia-nccl-cu12 and -cu13) in a site folder: found in the
  first folder that has it, through sys.path and the nvidia namespace package; none where
  no folder has it; never jax_smddp's front end, even when linked there."""
  first, second, empty = tmp_path / "first", tmp_path / "second", tmp_path / "empty"
  for site in (first, second):
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
  empty.mkdir()
  want = str(first / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
  assert nccl_swap.find_real_nccl([str(empty), str(first), str(second)]) == want
  assert nccl_swap.find_real_nccl([str(empty)]) is None
  if os.path.exists(FRONT_END):
    linked = tmp_path / "linked"
    (linked / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    os.symlink(FRONT_END, linked / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    assert nccl_swap.find_real_nccl([str(linked), str(second)]) == \
        str(second / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
  # As a process finds it: on PYTHONPATH, through the nvidia namespace package.
  run = _python("from jax_smddp.swap import nccl as nccl_swap; print(nccl_swap.find_real_nccl())", tmp_path,
                PYTHONPATH=f"{empty}{os.pathsep}{first}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == want, run.stdout


# --- start-up -------------------------------------------------------------------------------

FLAGS_PROBE = """
    import os
    print(repr(os.environ.get("XLA_FLAGS")))
    import jax, jax.numpy as jnp  # XLA parses the flags
    print(float(jnp.arange(4.0).sum()), repr(os.environ.get("XLA_FLAGS")))
    """


@pytest.mark.parametrize("switch", ["xla", "all", None])
@pytest.mark.parametrize("flags", ["--xla_force_host_platform_device_count=2", None])
def test_start_up_leaves_xla_flags_alone(tmp_path, switch, flags):
  """Whatever the switch, start-up and a CPU-only run leave XLA_FLAGS as the shell set it
  (unset stays unset, so a program's os.environ.setdefault still works): the command buffer
  flag is the CUDA client's business (test_start_up_loads_the_front_end_before_...)."""
  env = {"JAX_PLATFORMS": "cpu"}
  if switch:
    env["JAX_SMDDP_COLLECTIVES"] = switch
  if flags is not None:
    env["XLA_FLAGS"] = flags
  run = _python(FLAGS_PROBE, tmp_path, **env)
  assert run.returncode == 0, run.stderr[-3000:]
  at_start, after = run.stdout.strip().splitlines()[-2:]
  assert at_start == repr(flags), at_start
  assert after == f"6.0 {flags!r}", after


def _stand_in_cuda_plugin(site) -> None:
  """A JAX CUDA plugin as far as start-up and JAX's plugin discovery see it: a module
  jax_plugins.xla_cuda13 whose initialize() loads the nvidia wheel's NCCL by path, as JAX's
  CUDA plugin does (jax_plugins/cuda/__init__.py: _load_nvidia_libraries), and registers a
  "cuda" backend factory (a stand-in client: there is no GPU)."""
  plugin = site / "jax_plugins" / "xla_cuda13"
  plugin.mkdir(parents=True)
  (plugin / "__init__.py").write_text(textwrap.dedent("""
      import ctypes, importlib, pathlib
      def initialize():
        m = importlib.import_module("nvidia.nccl")
        ctypes.cdll.LoadLibrary(pathlib.Path(list(m.__path__)[0]) / "lib" / "libnccl.so.2")
        from jax._src import xla_bridge
        xla_bridge.register_backend_factory("cuda", lambda: "a stand-in CUDA client",
                                            priority=-10, fail_quietly=True)
      """))


PLUGIN_PROBE = """
    import ctypes, json, os, sys
    if os.environ.get("PROBE_NCCL_FIRST"):  # another library loads NCCL first (as torch would)
      ctypes.CDLL(os.environ["PROBE_NCCL_FIRST"])
    if os.environ.get("PROBE_XLA_FLAGS"):  # the program's own flags, set after start-up
      os.environ["XLA_FLAGS"] = os.environ["PROBE_XLA_FLAGS"]
    import jax
    from jax._src import xla_bridge
    xla_bridge._discover_and_register_pjrt_plugins()  # JAX's plugins, as its first backend use does
    from jax_smddp import doctor
    from jax_smddp.swap import nccl as nccl_swap
    out = {"before": nccl_swap.front_end(), "flags_before": os.environ.get("XLA_FLAGS")}
    registration = xla_bridge._backend_factories["cuda"]
    out["wrapped"] = bool(getattr(registration.factory, "_jax_smddp", False))
    try:
      if not os.environ.get("PROBE_NO_CLIENT"):  # (JAX_PLATFORMS=cpu: JAX would not make one)
        out["client"] = registration.factory()  # what JAX does as it creates its CUDA client
    except Exception as e:
      out["client"] = f"raised {type(e).__name__}: {e}"
    out["flags_after"] = os.environ.get("XLA_FLAGS")
    soname = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD)  # what the CUDA plugin gets
    out["plugin_gets_front_end"] = hasattr(soname, "smddp_nccl_describe")
    out["after"] = nccl_swap.front_end()
    out["row"] = [r.__dict__ for r in doctor.report().rows if r.component == "XLA GPU collectives"][0]
    print("PROBE " + json.dumps(out))
    """


def _plugin_probe(tmp_path, **env) -> dict:
  run = _python(PLUGIN_PROBE, tmp_path, PYTHONPATH=str(tmp_path / "site"), **env)
  assert run.returncode == 0, run.stderr[-3000:]
  line = [l for l in run.stdout.splitlines() if l.startswith("PROBE ")][-1]
  return {**json.loads(line[len("PROBE "):]), "stderr": run.stderr}


@needs_front_end
def test_start_up_loads_the_front_end_before_jax_cuda_plugin_loads_nccl(tmp_path):
  """JAX_SMDDP_COLLECTIVES=xla with a CUDA plugin installed: the front end is loaded as jax
  is imported, so that libnccl.so.2 names it when the plugin, which loads the real NCCL in
  its initialize(), later opens that name. JAX's CUDA client factory is wrapped whatever the
  order JAX initializes the plugins in (it varies with the hash seed); creating the client
  configures the front end with the real NCCL and leaves the program's XLA_FLAGS as they
  were (XLA may capture collectives into CUDA graphs: the front end serves them as
  replayable calls). The doctor's row says so."""
  real = _compile_fake_nccl(tmp_path / "site")
  _stand_in_cuda_plugin(tmp_path / "site")
  for seed in ("0", "1", "2", "3"):
    own = "--xla_force_host_platform_device_count=2" if seed == "1" else None
    out = _plugin_probe(tmp_path, JAX_SMDDP_COLLECTIVES="xla", PYTHONHASHSEED=seed,
                        **({"PROBE_XLA_FLAGS": own} if own else {}))
    assert out["flags_before"] == own, out
    assert out["flags_after"] == own, out
    assert out["wrapped"] and out["plugin_gets_front_end"], out
    assert out["before"] and not out["before"]["active"], out
    assert out["client"] == "a stand-in CUDA client", out
    after = out["after"]
    assert after["active"] and after["why_not"] == "", after
    assert after["library"] == real and after["version"] == 22809 and after["real"] == real, after
    assert after["served"] == {} and after["forwarded"] == {}, after
    row = out["row"]
    assert row["status"] == "ok" and row["detail"].startswith("active: "), row
    assert f"real NCCL {real} (NCCL 2.28.9)" in row["detail"], row
    assert "forwarded nothing" in row["detail"], row


@needs_front_end
def test_the_front_end_is_not_loaded_where_it_has_nothing_to_do(tmp_path):
  """Switch off, or JAX_PLATFORMS without CUDA: the front end stays out of the process (the
  plugin gets the real NCCL), and the doctor says why."""
  _compile_fake_nccl(tmp_path / "site")
  _stand_in_cuda_plugin(tmp_path / "site")
  off = _plugin_probe(tmp_path)
  assert off["before"] is None and off["after"] is None and not off["plugin_gets_front_end"], off
  assert not off["wrapped"], off
  assert off["row"]["status"] == "info" and "run on NCCL" in off["row"]["detail"], off["row"]
  cpu = _plugin_probe(tmp_path, JAX_SMDDP_COLLECTIVES="xla", JAX_PLATFORMS="cpu", PROBE_NO_CLIENT="1")
  assert cpu["before"] is None and not cpu["plugin_gets_front_end"], cpu
  assert cpu["row"]["status"] == "info" and "JAX_PLATFORMS=cpu excludes CUDA" in cpu["row"]["detail"], \
      cpu["row"]


@needs_front_end
def test_a_front_end_loaded_after_nccl_is_named_and_not_used(tmp_path):
  """Another library loaded NCCL before jax was imported: the plugin would get that one, so
  the front end does not pretend to serve. Creating JAX's CUDA client warns once naming the
  library that came first (an error under JAX_SMDDP_REQUIRE=no-fallback); the doctor's row
  FAILs with the same reason."""
  real = _compile_fake_nccl(tmp_path / "site")
  _stand_in_cuda_plugin(tmp_path / "site")
  out = _plugin_probe(tmp_path, JAX_SMDDP_COLLECTIVES="xla", PROBE_NCCL_FIRST=real)
  assert not out["plugin_gets_front_end"], out
  assert out["client"] == "a stand-in CUDA client", out
  assert not out["after"]["active"] and real in out["after"]["why_not"], out["after"]
  assert out["stderr"].count("they stay on NCCL") == 1, out["stderr"][-3000:]
  assert out["row"]["status"] == "FAIL" and "was loaded before jax_smddp's front end" in \
      out["row"]["detail"], out["row"]
  strict = _plugin_probe(tmp_path, JAX_SMDDP_COLLECTIVES="xla", PROBE_NCCL_FIRST=real,
                         JAX_SMDDP_REQUIRE="no-fallback")
  assert strict["client"].startswith("raised RequirementError") and "no-fallback" in strict["client"], \
      strict["client"]


def test_the_start_up_hook_is_cheap_without_the_switch(tmp_path):
  """Without JAX_SMDDP_COLLECTIVES the hook adds no import hook and loads nothing."""
  run = _python("""
      import sys
      print(sorted(type(f).__name__ for f in sys.meta_path if 'LoadBeforeJax' in type(f).__name__),
            'ctypes' in sys.modules)
      """, tmp_path)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split() == ["[]", "False"], run.stdout


# --- what it counts -----------------------------------------------------------------------

def test_traffic_by_op_names_the_front_ends_calls_as_xla_ops(monkeypatch):
  """The world counts served NCCL calls as ncclAllGather, ...; traffic_by_op() names them as
  the compiled program does (all-gather, reduce-scatter, all-reduce), like the MPI calls of
  the CPU swap, and jax_smddp's custom calls as smddp_*."""
  class Engine:
    def world_calls(self):
      return [("all_gather", 2, 64), ("MPI_Allgather", 1, 16), ("ncclAllGather", 3, 48),
              ("ncclReduceScatter", 4, 40), ("ncclAllReduce", 5, 50)]

  monkeypatch.setattr(distributed._native, "engine", lambda: Engine())
  assert distributed.traffic_by_op() == {
      "smddp_all_gather": {"calls": 2, "bytes": 64}, "all-gather": {"calls": 4, "bytes": 64},
      "reduce-scatter": {"calls": 4, "bytes": 40}, "all-reduce": {"calls": 5, "bytes": 50}}
