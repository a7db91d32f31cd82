"""The libfabric link (xla_ffi/transports/fabric_link.h), tested by a standalone
C++ program (tests/native/fabric_link_test.cc, built by CMake) that forks a child and moves
messages between the two processes over a real libfabric provider."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import native_program, ran_in_first_suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_CI = os.environ.get("CI") == "true"


def _compiler():
  return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _libfabric_missing():
  """Why the libfabric tests cannot run here, or None."""
  from jax_smddp import capabilities
  f = capabilities.fabric()
  if not f["built"]:
    return "jax_smddp was built without libfabric's headers (install libfabric-dev)"
  if not f["loaded"]:
    return f"libfabric cannot be loaded: {f['error']}"
  return None


@pytest.fixture(scope="module")
def binary():
  """tests/native/fabric_link_test.cc, built by CMake (target fabric_link_test)."""
  why = _libfabric_missing()
  if why:
    assert not IN_CI, why
    pytest.skip(why)
  return native_program("fabric_link_test")


@pytest.mark.timeout(300)
def test_libfabric_not_linked(binary):
  # libfabric is dlopen'ed: the binary must neither need it nor import its symbols.
  if shutil.which("readelf"):
    dyn = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, timeout=60)
    assert "libfabric" not in dyn.stdout, dyn.stdout
  if shutil.which("nm"):
    nm = subprocess.run(["nm", "-D", "--undefined-only", binary], capture_output=True, text=True,
                        timeout=60)
    assert nm.returncode == 0, nm.stderr
    imported = [l.split()[-1] for l in nm.stdout.splitlines() if l.strip()]
    assert not [s for s in imported if s.startswith("fi_")], imported


@pytest.mark.timeout(300)
@pytest.mark.parametrize("provider,node,settings", [
    ("tcp;ofi_rxm", "127.0.0.1", {}),
    ("shm", "", {}),
    # Chunks (direct transfers' headers and answers too) posted out of order.
    ("tcp;ofi_rxm", "127.0.0.1", {"JAX_SMDDP_FABRIC_TEST_REORDER": "1"}),
    # Every message through bounce buffers.
    ("tcp;ofi_rxm", "127.0.0.1", {"JAX_SMDDP_FABRIC_DIRECT_BYTES": "0"}),
    # Every non-empty message direct, out of order, over both providers.
    ("tcp;ofi_rxm", "127.0.0.1", {"JAX_SMDDP_FABRIC_DIRECT_BYTES": "1",
                                  "JAX_SMDDP_FABRIC_TEST_REORDER": "1"}),
    ("shm", "", {"JAX_SMDDP_FABRIC_DIRECT_BYTES": "1"}),
    # Direct buffers registered per transfer, as providers with FI_MR_LOCAL (efa) need.
    ("tcp;ofi_rxm", "127.0.0.1", {"JAX_SMDDP_FABRIC_TEST_REGISTER": "1"}),
    # Waiters sleep their bound instead of on the completion queue's descriptor.
    ("tcp;ofi_rxm", "127.0.0.1", {"JAX_SMDDP_FABRIC_WAIT": "sleep"}),
    # libfabric 1.17's TCP provider with its own reliable datagrams (the default without efa).
    ("net", "127.0.0.1", {}),
    ("net", "127.0.0.1", {"JAX_SMDDP_FABRIC_DIRECT_BYTES": "1",
                          "JAX_SMDDP_FABRIC_TEST_REORDER": "1"}),
    # net reading headers through libfabric's own prefetch buffer (jax_smddp's default is none).
    ("net", "127.0.0.1", {"FI_NET_PREFETCH_RBUF_SIZE": "9000"}),
], ids=["tcp", "shm", "tcp-reordered", "tcp-bounce-only", "tcp-all-direct-reordered",
        "shm-all-direct", "tcp-registered", "tcp-sleep", "net", "net-all-direct-reordered",
        "net-prefetch"])
def test_fabric_link(binary, provider, node, settings):
  env = dict(os.environ)
  for name in ("JAX_SMDDP_FABRIC_PROVIDER", "JAX_SMDDP_FABRIC_DIRECT_BYTES",
               "JAX_SMDDP_FABRIC_TEST_REORDER", "JAX_SMDDP_FABRIC_TEST_REGISTER",
               "JAX_SMDDP_FABRIC_WAIT", "FI_NET_PREFETCH_RBUF_SIZE"):
    env.pop(name, None)
  env.update(settings)
  args = [binary, provider] + ([node] if node else [])
  try:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"fabric_link_test {provider} hung:\n{e.stdout}\n{e.stderr}")
  print(proc.stdout)
  assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
  assert "all fabric link tests passed" in proc.stdout


_READ_FABRIC_DEFAULTS = """
import json
from jax_smddp import capabilities
print(json.dumps(capabilities.fabric()["env_defaults"]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("user_value", [None, "9000"], ids=["unset", "set-by-user"])
def test_net_prefetch_buffer_default_reaches_the_provider(user_value):
  # jax_smddp sets FI_NET_PREFETCH_RBUF_SIZE=0 before libfabric loads unless the user set it;
  # the provider's own log of the value it read shows that the setting arrived in time.
  why = _libfabric_missing()
  if why:
    assert not IN_CI, why
    pytest.skip(why)
  env = dict(os.environ, FI_LOG_LEVEL="info")
  env.pop("FI_NET_PREFETCH_RBUF_SIZE", None)
  if user_value is not None:
    env["FI_NET_PREFETCH_RBUF_SIZE"] = user_value
  proc = subprocess.run([sys.executable, "-c", _READ_FABRIC_DEFAULTS], env=env,
                        capture_output=True, text=True, timeout=100)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  defaults = {e["name"]: e for e in json.loads(proc.stdout.strip().splitlines()[-1])}
  entry = defaults["FI_NET_PREFETCH_RBUF_SIZE"]
  expected = user_value or "0"
  assert entry["value"] == expected, entry
  assert entry["set_by"] == ("environment" if user_value else "jax_smddp"), entry
  from jax_smddp import capabilities
  if "net" in capabilities.fabric()["providers"]:
    read = re.findall(r":net:core:.*read int var prefetch_rbuf_size=(\d+)", proc.stderr)
    assert read == [expected], (read, proc.stderr[-2000:])


@pytest.mark.timeout(300)
def test_builds_without_libfabric_headers(tmp_path):
  # The package must build, and fail clearly at run time, where the headers are absent.
  ran_in_first_suite("a build without libfabric's headers")
  cxx = _compiler()
  if cxx is None:
    pytest.skip("no C++ compiler (c++) on PATH")
  main = tmp_path / "main.cc"
  main.write_text(r'''
#include <cstdio>
#include "xla_ffi/transports/fabric_link.h"
#include "xla_ffi/transports/fabric_rail.h"
int main() {
  std::string why;
  if (smddp::FabricAvailable(&why)) return 1;
  if (why.find("built without libfabric headers") == std::string::npos) return 2;
  std::unique_ptr<smddp::FabricEndpoint> ep;
  smddp::Status st = smddp::FabricEndpoint::Open("tcp;ofi_rxm", "", &ep);
  if (st.ok() || st.message().find("libfabric") == std::string::npos) return 3;
  if (smddp::ChooseFabricProvider("shm") != "shm") return 4;
  std::unique_ptr<smddp::FabricRail> rail;
  smddp::Status rs = smddp::FabricRail::Open("shm", "", smddp::MemoryIface::kCuda, &rail);
  if (rs.ok() || rs.message().find("libfabric") == std::string::npos) return 5;
  std::printf("%s\n", st.message().c_str());
  return 0;
}
''')
  out = str(tmp_path / "t")
  cmd = [cxx, "-std=c++17", "-O1", "-DSMDDP_NO_LIBFABRIC", f"-I{ROOT}",
         "xla_ffi/transports/fabric_api.cc", "xla_ffi/transports/fabric_endpoint.cc",
         "xla_ffi/transports/fabric_eager.cc", "xla_ffi/transports/fabric_direct.cc",
         "xla_ffi/transports/fabric_link.cc", "xla_ffi/transports/fabric_link_stub.cc",
         "xla_ffi/transports/fabric_rail.cc", "xla_ffi/transports/fabric_info.cc",
         "xla_ffi/common/hashing.cc",
         "xla_ffi/common/settings.cc", "xla_ffi/common/test_settings.cc", str(main), "-o", out]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr
  run = subprocess.run([out], capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
