"""Symmetric memory through the NCCL API front end (cuda/ncclapi/nccl_windows.h) on the mock
node (tests/native/mock_node: devices that fault on memory they were not granted, streams that
run concurrently), in the layouts users run: 1 process x 8 GPUs, 8 x 1 and 2 x 4
(tests/native/nccl_windows_test.cc). Memory from ncclMemAlloc registered with
ncclCommWindowRegister and ncclCommRegister, as XLA's collective memory space is: every served
collective on buffers inside the windows, exact against a reference computed from every rank's
inputs; the calls read their peers at window base + the same offset, with no buffer exchange, no
host wait and nothing exported or mapped per call; a rank whose offset differs fails the group,
every rank naming it; a window deregistered, freed and allocated again is a new registration."""

import os
import re
import subprocess

import pytest

from helpers import native_program
from test_gpu_communicator_mock import _pidfd_getfd_refused

LAYOUTS = ["1x8", "8x1", "2x4"]
COUNTERS = ["ipc_exports", "ipc_opens", "cumem_exports", "imports", "maps", "grants"]


@pytest.fixture(scope="module")
def program():
  return native_program("nccl_windows_test")


def _run(program, layout, scenario, memory="legacy", settings=None):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("JAX_SMDDP_") and not k.startswith("MOCK_NCCL")}
  env["JAX_SMDDP_NCCL_LIBRARY"] = os.path.join(os.path.dirname(program), "mock_nccl", "libnccl.so.2")
  env["JAX_SMDDP_MOCK_WAIT_S"] = "20"
  env["JAX_SMDDP_MOCK_CUMEM"] = "1" if memory == "cumem" else "0"
  env.update(settings or {})
  run = subprocess.run([program, layout, scenario], capture_output=True, text=True, timeout=100,
                       env=env)
  out = run.stdout + run.stderr
  assert run.returncode == 0 and "all checks passed" in run.stdout, out
  return out


def _rows(out, what):
  """{process: {counter: n}} of the program's "windows <what> process <p>: ..." lines."""
  rows = {}
  for p, rest in re.findall(rf"^windows {what} process (\d+): (.*)$", out, re.M):
    words = rest.split()
    rows[int(p)] = {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
  return rows


def _skip_refused(layout, memory):
  if memory == "cumem" and layout != "1x8" and _pidfd_getfd_refused():
    pytest.skip("this machine refuses pidfd_getfd: cuMem windows cannot be mapped between processes")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["legacy", "cumem"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_collectives_exact(program, layout, memory):
  """Every collective in float32 and int32, then 20 calls of each, on buffers inside windows: exact
  (checked in the program); the registration mapped each peer's windows once (between
  processes), and the 80 calls after it read them in place with no buffer exchange, no host meeting
  or wait, and nothing exported, opened, imported, mapped or granted. Calls on buffers outside
  any window go the usual way (exchanging and mapping them), exact too."""
  _skip_refused(layout, memory)
  out = _run(program, layout, "exact", memory)
  P, G = (int(v) for v in layout.split("x"))
  registration, steady, outside = (_rows(out, w) for w in ("registration", "steady", "outside"))
  assert sorted(registration) == sorted(steady) == sorted(outside) == list(range(P)), out
  for p in range(P):
    assert registration[p]["registered"] == 2 * G, registration[p]
    if P > 1:  # the peers' windows mapped at registration, once per process and device
      assert registration[p]["ipc_opens" if memory == "legacy" else "grants"] == 2 * G * (P - 1) * G
      assert registration[p]["maps"] == (0 if memory == "legacy" else 2 * (P - 1) * G)
    costs = {k: n for k, n in steady[p].items() if k in COUNTERS + ["meetings", "waits"] and n}
    assert not costs, (p, steady[p])
    assert steady[p]["windowed"] == 4 * 20 * G and steady[p]["usual"] == 0, steady[p]
    assert outside[p]["windowed"] == 0 and outside[p]["usual"] == 4 * G, outside[p]
  if P > 1:  # the usual path did export and map the buffers outside the windows
    assert all(sum(outside[p][c] for c in COUNTERS) > 0 for p in range(P)), outside


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["mismatch", "mismatch_registered"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_offset_mismatch_names_rank(program, layout, scenario):
  """Rank 5 calls all_gather on its window 256 bytes further in than the others (or registered
  its window 256 bytes further into its allocation, the buffer the same): the group fails, every
  rank's call fails within 10 s naming rank 5 and its offset (never a silent wrong read),
  ncclCommGetAsyncError reports it, and every stream ends with nothing faulted."""
  out = _run(program, layout, scenario)
  odd, others = ("256", "0") if scenario == "mismatch" else ("0", "256")
  failed = dict(re.findall(r"^rank (\d+): failed after [\d.]+ s: (.*)$", out, re.M))
  assert sorted(int(r) for r in failed) == list(range(8)), out
  for r, message in failed.items():
    assert re.search(rf"rank 5 \(process \d+\) [^.]*at offset {odd} of window #0", message), (r, message)
    assert re.search(rf"rank [0-46-7] \(process \d+\) [^.]*at offset {others} of window #0",
                     message), (r, message)
  assert len(re.findall(r"^rank \d+: async error 6$", out, re.M)) == 8, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["1x8", "2x4"])
def test_window_size_mismatch_names_rank(program, layout):
  """Rank 5 registers a window of half the others' size: every rank's registration fails, naming
  rank 5 and both sizes."""
  out = _run(program, layout, "size_mismatch")
  failed = dict(re.findall(r"^rank (\d+): registration failed: (.*)$", out, re.M))
  assert sorted(int(r) for r in failed) == list(range(8)), out
  assert all("rank 5 (process" in m and "131072 bytes" in m for m in failed.values()), failed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["legacy", "cumem"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_realloc_new_registration(program, layout, memory):
  """A window deregistered, its memory freed with ncclMemFree, allocated again and registered:
  a new registration index (never one used before), its memory exported and mapped anew in each
  process (one window per rank), and the calls on it exact (no peer reads the freed memory)."""
  _skip_refused(layout, memory)
  out = _run(program, layout, "realloc", memory)
  P, G = (int(v) for v in layout.split("x"))
  indices = re.findall(r"^realloc rank (\d+): window #(\d+) then #(\d+)$", out, re.M)
  assert sorted(int(r) for r, _, _ in indices) == list(range(8)), out
  assert all((a, b) == ("0", "2") for _, a, b in indices), indices
  rows = _rows(out, "realloc")
  assert sorted(rows) == list(range(P)), out
  for p, c in rows.items():
    assert c["registered"] == G and c["windowed"] == 3 * G, c
    if P > 1:
      exported = "ipc_exports" if memory == "legacy" else "cumem_exports"
      opened = "ipc_opens" if memory == "legacy" else "grants"
      assert c[exported] == G and c[opened] == G * (P - 1) * G, c
      assert c["maps"] == (0 if memory == "legacy" else (P - 1) * G), c


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["legacy", "cumem"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_shared_by_two_communicators(program, layout, memory):
  """The same allocations registered with a communicator and with its split, as XLA registers
  an allocation with each communicator that uses it: calls exact on both, before and after the
  split's windows are deregistered; the second registration exports each window again but opens,
  imports, maps and grants nothing (a legacy CUDA IPC handle opens once per device and process)."""
  _skip_refused(layout, memory)
  out = _run(program, layout, "two_comms", memory)
  P, G = (int(v) for v in layout.split("x"))
  assert len(re.findall(r"^rank \d+: two communicators$", out, re.M)) == 8, out
  second, both = _rows(out, "second"), _rows(out, "two_comms")
  assert sorted(second) == sorted(both) == list(range(P)), out
  for p in range(P):
    c = second[p]
    assert c["registered"] == 2 * G, c
    assert all(c[k] == 0 for k in ("ipc_opens", "imports", "maps", "grants")), c
    if P > 1:
      assert c["ipc_exports" if memory == "legacy" else "cumem_exports"] == 2 * G, c
    assert both[p]["windowed"] == 5 * G, both[p]


@pytest.mark.timeout(60)
def test_window_memory_passes_through_unknown_version(program):
  """With a real NCCL of a version the front end does not know, its communicators are forwarded
  and so are ncclMemAlloc and ncclMemFree (the mock NCCL records them); ncclCommRegister makes no
  window. (Where the front end serves, the other scenarios check the mock saw no ncclMem call.)"""
  out = _run(program, "1x2", "passthrough", settings={"MOCK_NCCL_VERSION": "99999"})
  assert len(re.findall(r"^rank \d: passed through$", out, re.M)) == 2, out
