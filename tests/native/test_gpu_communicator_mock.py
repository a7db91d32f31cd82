"""The GPU communicators' set-up and per-call checks
(cuda/gpu_communicator.cc, cuda/gpu_hierarchy.cc) without a GPU: a standalone C++ program
(tests/native/gpu_communicator_test.cc; groups across hosts and the network proxy:
tests/native/gpu_hosts_test.cc, on tests/native/gpu_communicator_harness.h) built against the mock
node's CUDA runtime (tests/native/mock_node: "device memory" in POSIX shared memory) forks three
rank processes, each on a GPU of its own, that prepare, trade handles, connect, and run the stream
protocol over the communicator's own views, in both flag memories: every
collective against expected values, a rank SIGKILLed while its peers wait on
it, a rank that closes the group, one that never makes the call its peers
wait in (the progress deadline), ranks that disagree on a call, and two
processes of two ranks each (local and remote peers mixed) where one dies;
direct reads (JAX_SMDDP_GPU_DIRECT_READS=1: buffers in mock device memory,
exchanged per call, mapped once per allocation, read in place; a call where
one rank's input cannot be shared stages everywhere), also with a rank that
dies while the others wait for its buffers, with 2 processes x 2 ranks (local
peers' buffers used as they are), and with every rank in one process; a
process whose allocator rules direct reads out fails every rank's set-up
naming the disagreement; a rank that cannot map its peers' buffers after they
saw its own releases them instead of leaving their streams waiting; the host
time direct reads add per call (direct_timing: 400 exchanges between the
three processes, mapped once per peer allocation, medians printed); and
a group across two simulated hosts, with its network slots staged or on an
FI_HMEM rail, with and without a death, also with GDRCopy signals through a
mock libgdrapi (tests/native/mock_gdrapi.cc); and the network proxy's
exit wait and its progress (each endpoint once a round). The real CUDA calls run in tests/gpu on
a GPU machine."""

import glob
import os
import re
import subprocess
import sys

import pytest

from helpers import native_program

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def program():
  """tests/native/gpu_communicator_test.cc with cuda/'s host code against the
  mock node's CUDA runtime, built by CMake (target gpu_communicator_test)."""
  return native_program("gpu_communicator_test")


@pytest.fixture(scope="module")
def hosts_program():
  """tests/native/gpu_hosts_test.cc (groups across hosts, the network proxy) on the same
  mock, built by CMake (target gpu_hosts_test)."""
  return native_program("gpu_hosts_test")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flag_memory", ["device", "host"])
@pytest.mark.parametrize("scenario", ["collectives", "dead_peer", "closed", "stalled", "mismatch",
                                      "two_per_process", "direct", "direct_dead_peer",
                                      "direct_two_per_process", "direct_in_process",
                                      "direct_in_process_late",
                                      "direct_map_fails", "direct_disagree", "direct_timing"])
def test_gpu_communicator(program, scenario, flag_memory):
  _run_scenario(program, scenario, flag_memory)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", ["direct", "direct_dead_peer", "direct_two_per_process",
                                      "direct_map_fails"])
def test_direct_reads_of_cumem_buffers(program, scenario):
  """XLA's memory is cuMemCreate'd (seen on an H100 with jax 0.11.2: no
  legacy CUDA IPC, POSIX file descriptor handles allowed). The same direct
  reads with the mock's allocations exported as descriptors: each peer
  process copies them (pidfd_getfd) and maps them (cuda/buffer_ipc.cc)."""
  why = _pidfd_getfd_refused()
  if why:
    pytest.skip(f"this machine refuses pidfd_getfd between processes ({why})")
  _run_scenario(program, scenario, "host", {"JAX_SMDDP_MOCK_CUMEM": "1"})


def _pidfd_getfd_refused() -> str:
  """Why copying a sibling process's descriptor fails here ("" if it works):
  an old kernel, or a seccomp profile or Yama setting that refuses it."""
  import ctypes
  import errno
  libc = ctypes.CDLL(None, use_errno=True)
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                           stdin=subprocess.PIPE)
  try:
    pidfd = libc.syscall(434, child.pid, 0)  # pidfd_open
    if pidfd < 0:
      return "pidfd_open: " + errno.errorcode.get(ctypes.get_errno(), "?")
    fd = libc.syscall(438, pidfd, 0, 0)  # pidfd_getfd of its stdin
    err = ctypes.get_errno()
    os.close(pidfd)
    if fd < 0:
      return "pidfd_getfd: " + errno.errorcode.get(err, "?")
    os.close(fd)
    return ""
  finally:
    child.kill()
    child.wait()


def _run_scenario(program, scenario, flag_memory, env=None):
  before = set(glob.glob("/dev/shm/jax_smddp*"))
  run = subprocess.run([program, scenario, flag_memory], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})})
  out = run.stdout + run.stderr
  assert run.returncode == 0 and "all checks passed" in run.stdout, out
  if scenario in ("dead_peer", "stalled"):  # said on stderr at once by each survivor (and
    # maybe by the stalled rank itself, if it learns of the failure before it is killed)
    assert run.stderr.count("rank 2 (process 2, pid") >= 2, out
    # The root cause is handed on as it was, not as a chain of reporters.
    assert all(line.count("(reported by") <= 1 for line in run.stderr.splitlines()), out
  elif scenario == "direct_dead_peer":  # the survivors' exchanges fail (asserted in the program)
    assert "rank 2 (process 2, pid" in run.stderr and "is gone" in run.stderr, out
  elif scenario == "direct_timing":
    # The program checks every call's peer addresses against the words each
    # peer wrote (a wrong one fails it); the medians are for the docs, one
    # line per rank, not asserted beyond being there.
    medians = re.findall(r"^rank (\d): per call, median of 400: call-log check ([\d.]+) us, "
                         r"buffer exchange ([\d.]+) us$", run.stdout, re.M)
    assert sorted(int(m[0]) for m in medians) == [0, 1, 2], out
    print(run.stdout)
  elif scenario.endswith("two_per_process"):  # once by the surviving process, for both its ranks
    assert run.stderr.count("ranks 2, 3 (process 1, pid") == 1, out
  else:  # an orderly close, or no death at all: nothing printed
    assert "is gone" not in run.stderr, out
  left = set(glob.glob("/dev/shm/jax_smddp*")) - before
  assert not left, f"left behind in /dev/shm: {sorted(left)}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("slots", ["staging", "rail"])
@pytest.mark.parametrize("scenario", ["hosts", "hosts_dead", "hosts_2x2"])
def test_gpu_group_across_hosts(hosts_program, scenario, slots):
  """Two hosts of one process each (hosts_2x2: two each, the host's ranks in
  one GPU communicator across its processes), over the world's real
  bootstrap (libfabric shm links and a TCP watch): PrepareHierarchy, then the
  hierarchical all_gather and reduce_scatter through 4 KiB slots, with the
  network slots staged through the world's links or ("rail") in the mock's
  device memory registered with an FI_HMEM rail (OpenDeviceRail, the slots'
  registration, rail links with the world's link behind them). hosts_dead
  kills process 1 mid-call: process 0's call is released with what never
  arrived poisoned (through the port's device-memory memset), and the next
  call fails naming the peer. Each surviving process then closes as at a
  job's exit (CloseCommunicatorsAtExit, the world's shutdown) and checks that
  its libfabric endpoints left no region in /dev/shm and that a later call
  fails."""
  if _rail_missing():
    pytest.skip(_rail_missing())
  before = set(os.listdir("/dev/shm"))
  run = subprocess.run([hosts_program, scenario, slots], capture_output=True, text=True, timeout=120)
  out = run.stdout + run.stderr
  assert run.returncode == 0 and "all checks passed" in run.stdout, out
  if scenario == "hosts_dead":
    assert "peer process 1" in run.stdout and "closed its connection" in run.stdout, out
  left = set(os.listdir("/dev/shm")) - before
  assert not left, f"left behind in /dev/shm: {sorted(left)}"


@pytest.fixture(scope="module")
def mock_gdrapi():
  """The directory of a mock libgdrapi.so.2 (tests/native/mock_gdrapi.cc, CMake
  target mock_gdrapi)."""
  return os.path.dirname(native_program(os.path.join("mock_gdrapi", "libgdrapi.so.2")))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario,slots", [("hosts", "staging"), ("hosts_2x2", "rail"),
                                            ("hosts_dead", "staging")])
def test_gpu_group_across_hosts_with_gdrcopy(hosts_program, mock_gdrapi, scenario, slots):
  """The same, with a mock libgdrapi on the library path: the network signals
  are (mock) device memory on a 64 KiB page, pinned and mapped a second time
  through cuda/gdrcopy.cc, and the proxy raises every flag through that
  mapping. A wrong offset or alignment leaves the streams waiting (the
  program's deadline fails the test); a death is still released."""
  if slots == "rail" and _rail_missing():
    pytest.skip(_rail_missing())
  env = dict(os.environ, LD_LIBRARY_PATH=mock_gdrapi + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
             JAX_SMDDP_TEST_EXPECT_GDRCOPY="1")
  before = set(os.listdir("/dev/shm"))
  run = subprocess.run([hosts_program, scenario, slots], capture_output=True, text=True, timeout=120,
                       env=env)
  out = run.stdout + run.stderr
  assert run.returncode == 0 and "all checks passed" in run.stdout, out
  left = set(os.listdir("/dev/shm")) - before
  assert not left, f"left behind in /dev/shm: {sorted(left)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting,want", [("", "True ''"), ("0", "False 'turned off"),
                                          ("open_fails", "False 'gdr_open failed")])
def test_cuda_module_finds_gdrcopy(mock_gdrapi, setting, want):
  """The installed CUDA module (built with nvcc) loads libgdrapi.so.2 from the
  library path and opens it; JAX_SMDDP_GDRCOPY=0 turns it off; a failing
  gdr_open (no gdrdrv driver) is reported as such."""
  from jax_smddp import _native
  if _native.cuda_engine() is None:
    pytest.skip("the CUDA module is not built")
  env = dict(os.environ, LD_LIBRARY_PATH=mock_gdrapi + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
  env.pop("JAX_SMDDP_GDRCOPY", None)
  if setting == "0":
    env["JAX_SMDDP_GDRCOPY"] = "0"
  elif setting == "open_fails":
    env["JAX_SMDDP_MOCK_GDR_OPEN_FAILS"] = "1"
  run = subprocess.run([sys.executable, "-c", "from jax_smddp import _native; "
                        "ok, why = _native.cuda_engine().gdrcopy(); print(ok, repr(why))"],
                       capture_output=True, text=True, timeout=120, env=env, cwd="/")
  assert run.returncode == 0 and run.stdout.startswith(want), run.stdout + run.stderr


@pytest.mark.timeout(900)
def test_network_proxy_shut(hosts_program):
  """The exit hook's wait (NetworkProxy::Shut): refused while a step runs,
  granted once it ended, immediate when idle; a step after it releases its
  flags without touching the links."""
  run = subprocess.run([hosts_program, "proxy_shut", "-"], capture_output=True, text=True, timeout=60)
  assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout + run.stderr


@pytest.mark.timeout(900)
def test_network_proxy_progresses_each_endpoint_once(hosts_program):
  """A network step progresses each libfabric endpoint once a round (Link::ProgressKey), not
  once per host it serves, while it waits for the stream and while it exchanges."""
  run = subprocess.run([hosts_program, "proxy_progress", "-"], capture_output=True, text=True,
                       timeout=60)
  assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout + run.stderr


def _rail_missing():
  """Why libfabric's shm provider cannot carry these tests here, or None."""
  from helpers import engine_probes
  try:
    return engine_probes().rail_probe("shm") or None
  except Exception as e:  # noqa: BLE001 - any failure to load is a reason to skip
    return str(e)
