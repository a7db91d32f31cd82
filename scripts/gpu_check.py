"""Everything a lent GPU must run, in one call: stages in order of value, each
under its own limit inside a total budget, each result written to OUT as it
lands (a run cut short still leaves what it measured and a one-page summary).

    bash scripts/gpu_check.sh                      # STAGES=all: the stages below, in this order
    STAGES=build,kernels bash scripts/gpu_check.sh
    GPU_CHECK_BUDGET_S=300 bash scripts/gpu_check.sh
    bash scripts/gpu_check.sh --dry-run            # the plan: interpreter, libfabric, stages, limits

Run it through scripts/gpu_check.sh, which resolves PYTHON (default python3) to
an absolute interpreter: the build installs into that interpreter's
environment, and scripts/build_testing.sh needs its prefix.

Stages (all = build kernels phases sweep swap bench jax overlap blocks):
  build    the package (editable, with the test probes) and the native test programs
  kernels  tests/gpu/test_kernels.py: the stream algorithms on the GPU without JAX
  phases   its phase timings (staged, and reading in place) under MPS
  sweep    the bare reduction's read rate from 1 block to every SM (scripts/gpu_block_sweep.py)
  swap     tests/gpu/test_xla_swap_gpu.py: XLA's own GPU collectives on jax_smddp's NCCL API
           front end (JAX_SMDDP_COLLECTIVES=xla), 2 processes sharing the GPU (skipped when the
           build has no libsmddp_nccl.so), with and without collectives in XLA's CUDA graphs
  bench    gpu_bench under MPS, direct reads, 2 and 4 processes, 16M-256M: the targets;
           the reductions again with the budget lifted (1024 blocks)
  jax      the quick selection of tests/gpu/test_gpu.py (JAX processes sharing the GPU)
  overlap  the Flax example on the GPU: annotation cost, 2 processes under MPS, losses
  blocks   the reductions under MPS with 32 blocks
Also on request: memory cpu slots64 hosts nccl jaxfull (the whole of test_gpu.py), staged
(the whole of it with staging, not direct reads, as every mode's default) and flagmem (the bench's
2 processes with step flags in device memory, JAX_SMDDP_GPU_FLAG_MEMORY=device: what the
default host flags cost against them).

Writes to OUT (default /tmp/jax_smddp_gpu_check): <stage>.log, the benchmarks'
JSON, example_*.json(l), stages.json and summary.md (rewritten after every stage).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = ("build", "kernels", "phases", "sweep", "swap", "bench", "jax", "overlap", "blocks")
EXTRA = ("memory", "cpu", "slots64", "hosts", "nccl", "jaxfull", "staged", "flagmem")
# Each stage's own limit (seconds); the budget may give it less.
LIMITS = {"build": 150, "kernels": 150, "swap": 170, "bench": 170, "jax": 120, "overlap": 200,
          "blocks": 60, "memory": 120, "cpu": 300, "slots64": 200, "hosts": 200, "nccl": 200,
          "jaxfull": 500, "staged": 400, "phases": 120, "sweep": 90, "flagmem": 90}
MIN_STAGE_S = 20   # a stage that would get less is skipped, not started
RESERVE_S = 5      # kept back for the summary
DEFAULT_BUDGET_S = 540

QUICK_JAX = ("single_process or (sharing and engines and 2) or (sharing and staged and 2) or "
             "(hosts and engines) or (hosts and HMEM and 2-1) or hmem_required or "
             "(dead_peer and 2) or disagree or (sharing and device and 2) or (sharing and graphs and 2)")


# --- plan -------------------------------------------------------------------

def parse_stages(text: str) -> list[str]:
  """STAGES: 'all' (or empty) or a comma list; unknown names are an error."""
  names = [s.strip() for s in (text or "all").split(",") if s.strip()]
  out: list[str] = []
  for name in names:
    for s in (ALL if name == "all" else (name,)):
      if s not in ALL + EXTRA:
        raise SystemExit(f"gpu_check: unknown stage {s!r}; stages: {', '.join(ALL + EXTRA)}, all")
      if s not in out:
        out.append(s)
  return out


def fab_environment(root: str, env: dict) -> dict:
  """The variables that make a carried libfabric (ROOT/.fab, as
  scripts/carry_libfabric.sh or scripts/build_libfabric_cuda.sh lay it out:
  include/rdma/fabric.h, lib/libfabric.so.1) reach the build through CMake's
  documented discovery (JAX_SMDDP_LIBFABRIC_ROOT) and the processes through
  the loader path. Empty when there is no .fab/ or it lacks the header."""
  fab = os.path.join(root, ".fab")
  if not os.path.isfile(os.path.join(fab, "include", "rdma", "fabric.h")):
    return {}
  libs = [d for d in (os.path.join(fab, "lib"), os.path.join(fab, "lib64")) if os.path.isdir(d)]
  out = {"JAX_SMDDP_LIBFABRIC_ROOT": fab}
  path = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
  out["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in path if p not in libs])
  return out


class Budget:
  """The run's total seconds, shared by the stages in order."""

  def __init__(self, total_s: float, clock=time.monotonic):
    self.total_s, self.clock, self.start = float(total_s), clock, clock()

  def elapsed(self) -> float:
    return self.clock() - self.start

  def remaining(self) -> float:
    return self.total_s - self.elapsed()

  def stage_limit(self, nominal_s: float) -> float:
    """Seconds a stage may take: its own limit, or what the budget has left."""
    return max(0.0, min(float(nominal_s), self.remaining() - RESERVE_S))


# --- running ----------------------------------------------------------------

class Stage:
  """One stage's commands, each cut at the stage's deadline."""

  def __init__(self, name: str, limit_s: float, out: str, env: dict):
    self.name, self.limit_s, self.out, self.env = name, limit_s, out, env
    self.deadline = time.monotonic() + limit_s
    self.log = open(os.path.join(out, f"{name}.log"), "a")
    self.failed = False
    self.timed_out = False
    self.notes: list[str] = []

  def run(self, argv: list[str], env: dict | None = None, echo=True,
          stdout_path: str | None = None) -> int:
    """Runs argv (its output into the stage's log), at most until the stage's
    deadline, then kills its whole process group (a launcher's children too);
    a failure or a timeout fails the stage. `echo`: print the output's last
    lines (True), nothing (False), or what `echo(output)` returns. With
    `stdout_path` the command's stdout goes to that file, its stderr is the
    output."""
    left = self.deadline - time.monotonic()
    if left < 1:
      self.timed_out = self.failed = True
      self.note(f"not started (stage limit): {' '.join(argv[:6])}")
      return 124
    self.log.write(f"$ {' '.join(argv)}\n")
    self.log.flush()
    full = {**self.env, **(env or {})}
    with contextlib.ExitStack() as files:
      stdout = files.enter_context(open(stdout_path, "w")) if stdout_path else subprocess.PIPE
      proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=stdout,
                              stderr=subprocess.PIPE if stdout_path else subprocess.STDOUT,
                              text=True, start_new_session=True)
      try:
        out, err = proc.communicate(timeout=left)
        rc = proc.returncode
      except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        rc = 124
        self.timed_out = True
    out = (err if stdout_path else out) or ""
    if rc == 124 and self.timed_out:
      out += f"\n[gpu_check: stopped at the stage limit of {self.limit_s:.0f} s]\n"
    self.log.write(out)
    self.log.flush()
    if echo:
      sys.stdout.write(echo(out) if callable(echo) else _tail(out, 60))
      sys.stdout.flush()
    if rc != 0:
      self.failed = True
    return rc

  def note(self, text: str) -> None:
    self.notes.append(text)
    self.log.write(f"[gpu_check] {text}\n")
    print(f"  {text}", flush=True)


def _tail(text: str, lines: int) -> str:
  parts = text.splitlines(keepends=True)
  return "".join(parts[-lines:])


@contextlib.contextmanager
def mps(stage: Stage):
  """The processes run concurrently on the one GPU under MPS where it starts."""
  control = shutil.which("nvidia-cuda-mps-control")
  env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/jax_smddp_mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/jax_smddp_mps_log"}
  started = False
  if control:
    for d in env.values():
      os.makedirs(d, exist_ok=True)
    started = subprocess.run([control, "-d"], env={**os.environ, **env}).returncode == 0
  stage.note("under MPS" if started else "MPS did not start: the processes time-slice the GPU")
  saved = {k: stage.env.get(k) for k in env}
  if started:
    stage.env.update(env)
  try:
    yield started
  finally:
    if started:
      subprocess.run([control], input="quit\n", text=True, env={**os.environ, **env})
      time.sleep(1)
      for k, v in saved.items():
        if v is None:
          stage.env.pop(k, None)
        else:
          stage.env[k] = v


# --- the stages ---------------------------------------------------------------

def stage_build(st: Stage, py: str) -> None:
  env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}
  st.run([py, "-m", "pip", "install", "-v", "--disable-pip-version-check", "--no-build-isolation",
          "--no-deps", "--config-settings=cmake.define.JAX_SMDDP_TESTING=ON", "-e", "."], env, echo=False)
  if st.failed:
    st.note("build failed: the later stages cannot run")
    return
  # The probes and native programs beside the package, in the same environment.
  if st.run(["bash", "scripts/build_testing.sh", sys.prefix], env, echo=False) != 0:
    st.note("scripts/build_testing.sh failed: the kernel and protocol tests skip")
    st.failed = False  # the package itself is built
  st.run([py, "-c", "import jax_smddp.gpu as g, jax_smddp._native as n, jax_smddp.capabilities as c; "
          "e = n.cuda_engine(); print('CUDA backend:', g.available(), 'GPUs:', "
          "e.device_count() if e else 0, 'stream memops:', e.have_stream_memops() if e else None, "
          "'libfabric built:', c.fabric()['built'], 'testing module:', hasattr(e, 'stream_run'))"])


def _pytest(st: Stage, py: str, args: list[str], env: dict | None = None, report: str = "-rs") -> None:
  st.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", report, *args], env)


def stage_kernels(st: Stage, py: str) -> None:
  # The phase timings (where_a) run in the stage phases, under MPS.
  _pytest(st, py, ["tests/gpu/test_kernels.py", "-k", "not where_a"])


SWAP_TESTS = "tests/gpu/test_xla_swap_gpu.py"


def nccl_front_end(py: str) -> str | None:
  """The NCCL API front end the build installed for `py` (libsmddp_nccl.so, built where nvcc
  is found), or None."""
  probe = subprocess.run([py, "-c", "from jax_smddp.swap import nccl as nccl_swap; import os; "
                          "p = nccl_swap.library_path(); print(p if os.path.exists(p) else '')"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
  return (probe.stdout.strip() or None) if probe.returncode == 0 else None


def stage_swap(st: Stage, py: str) -> None:
  """XLA's own GPU collectives on jax_smddp (the NCCL API front end, issue #34): a global-view
  jit FSDP step, the Flax example in jit style and a killed peer, 2 processes on the GPU."""
  library = nccl_front_end(py)
  if library is None:
    st.note("skipped: this build has no libsmddp_nccl.so (the NCCL API front end is built "
            "where nvcc is found)")
    return
  st.note(f"front end {library}")
  _pytest(st, py, [SWAP_TESTS], report="-rsP")


def _bench(st: Stage, py: str, name: str, args: list[str], env: dict | None = None) -> None:
  st.run([py, "-m", "jax_smddp.tools.gpu_bench", *args, "--json",
          os.path.join(st.out, f"{name}.json")], env)


def _reductions(st: Stage, py: str, blocks: int) -> None:
  _bench(st, py, f"blocks_{blocks}", ["--processes", "2", "--sizes", "64M,256M", "--modes",
                                      "engine", "--direct-reads", "1", "--iters", "10",
                                      "--ops", "reduce_scatter,all_reduce", "--timeout", "90"],
         {"JAX_SMDDP_GPU_MAX_BLOCKS": str(blocks)})


def stage_bench(st: Stage, py: str) -> None:
  """The targets: every op at the default budget (16 blocks), 2 and 4 processes; then the
  reductions with the budget lifted (1024 blocks: as many as the work has)."""
  with mps(st):
    for n in (2, 4):
      _bench(st, py, f"bench_{n}proc", ["--processes", str(n), "--sizes", "16M,64M,256M",
                                        "--modes", "engine", "--direct-reads", "1", "--iters", "10",
                                        "--timeout", "140"])
    _reductions(st, py, 1024)


def stage_flagmem(st: Stage, py: str) -> None:
  """The bench stage's 2 processes with step flags in device memory (each call then meets its
  peers on the host): against bench_2proc, what polling host flags costs."""
  with mps(st):
    _bench(st, py, "bench_2proc_device_flags", ["--processes", "2", "--sizes", "16M,64M",
                                                "--modes", "engine", "--direct-reads", "1",
                                                "--iters", "10", "--timeout", "80"],
           {"JAX_SMDDP_GPU_FLAG_MEMORY": "device"})


def stage_blocks(st: Stage, py: str) -> None:
  """What the budget costs between the default and lifted: 32 blocks."""
  with mps(st):
    _reductions(st, py, 32)


def stage_jax(st: Stage, py: str, quick: bool = True) -> None:
  env = {"JAX_SMDDP_GPU_TEST_TIMEOUT": os.environ.get("JAX_SMDDP_GPU_TEST_TIMEOUT", "100")}
  _pytest(st, py, ["tests/gpu/test_gpu.py", *(["-k", QUICK_JAX] if quick else [])], env)


def stage_jaxfull(st: Stage, py: str) -> None:
  stage_jax(st, py, quick=False)


def stage_staged(st: Stage, py: str) -> None:
  """Every JAX GPU test with staging as every mode's default (direct reads are the library's
  default since the whole file passed with them on the H200, 2026-11-26): the other path."""
  env = {"JAX_SMDDP_GPU_TEST_TIMEOUT": os.environ.get("JAX_SMDDP_GPU_TEST_TIMEOUT", "100"),
         "JAX_SMDDP_GPU_DIRECT_READS": "0"}
  _pytest(st, py, ["tests/gpu/test_gpu.py"], env)


def stage_phases(st: Stage, py: str) -> None:
  """The kernel tests' phase timings (staged: a 64 MiB reduce_scatter, a 16 MiB all_gather;
  reading in place: all_gather, reduce_scatter, all_reduce), under MPS."""
  with mps(st):
    _pytest(st, py, ["tests/gpu/test_kernels.py", "-k", "where_a"], report="-rsP")


def stage_sweep(st: Stage, py: str) -> None:
  st.run([py, "scripts/gpu_block_sweep.py", os.path.join(st.out, "sweep.json")])


def stage_memory(st: Stage, py: str) -> None:
  st.run([py, "scripts/gpu_memory_kinds.py"])


def stage_cpu(st: Stage, py: str) -> None:
  _pytest(st, py, ["tests/engine/test_stream_protocol.py", "tests/engine/test_stream_watchdog.py",
                   "tests/gpu/test_cuda_backend.py"], {"JAX_PLATFORMS": "cpu"})


def stage_slots64(st: Stage, py: str) -> None:
  _bench(st, py, "bench_2proc_64M_slots", ["--processes", "2", "--sizes", "1M,16M,64M,256M"],
         {"JAX_SMDDP_GPU_SLOT_BYTES": str(64 << 20)})


def stage_hosts(st: Stage, py: str) -> None:
  _bench(st, py, "bench_2hosts", ["--processes", "2", "--hosts", "2", "--fabric-hmem", "0,auto",
                                  "--modes", "engine", "--sizes", "1M,16M,64M", "--ops",
                                  "all_gather,reduce_scatter,all_reduce,all_to_all"],
         {"JAX_SMDDP_FABRIC_PROVIDER": "shm"})


def stage_nccl(st: Stage, py: str) -> None:
  _bench(st, py, "bench_1proc", ["--processes", "1", "--sizes", "1M,16M,256M", "--ops",
                                 "all_gather,reduce_scatter,all_reduce,all_to_all"])


# The example's runs: (name, environment, arguments). gpu1_*: one process, --mesh 1 (groups of
# one, which stay off the collective stream); gpu2_*: 2 processes sharing the GPU under MPS.
EXAMPLE_RUNS = (
    ("gpu1_smddp", {}, ["--platform", "cuda", "--mesh", "1"]),
    ("gpu1_xla", {}, ["--platform", "cuda", "--mesh", "1", "--collectives", "xla"]),
    ("gpu2_smddp", {}, ["--platform", "cuda", "--mesh", "2", "--processes", "2"]),
    ("gpu2_smddp_compute_stream", {"JAX_SMDDP_GPU_STREAM": "compute"},
     ["--platform", "cuda", "--mesh", "2", "--processes", "2"]),
    ("cpu2_smddp", {"JAX_PLATFORMS": "cpu"}, ["--platform", "cpu", "--mesh", "2", "--processes", "2"]),
)
# Runs that must train alike (losses within 1e-4, relative).
EXAMPLE_PAIRS = (("gpu1_smddp", "gpu1_xla"), ("gpu2_smddp", "cpu2_smddp"),
                 ("gpu2_smddp_compute_stream", "gpu2_smddp"))


def stage_overlap(st: Stage, py: str) -> None:
  """The Flax example on the GPU, float32 matmuls at full precision (not TF32) so that losses
  compare; 3 steps of each run traced and summarised by jax_smddp.tools.trace_summary."""
  flags = ("--xla_gpu_enable_latency_hiding_scheduler=true "
           "--xla_gpu_experimental_stream_annotation=true")
  base = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
          "XLA_FLAGS": flags}
  for name, env, args in EXAMPLE_RUNS:
    ctx = mps(st) if "--processes" in args and "cuda" in args else contextlib.nullcontext()
    with ctx:
      argv = [py, "examples/fsdp_train.py", "--steps", "30", "--no-progress", "--log-every", "10",
              "--eval-batches", "1", "--metrics", os.path.join(st.out, f"example_{name}.jsonl"),
              "--profile", os.path.join("/tmp/jax_smddp_traces", name), *args]
      st.log.write(f"--- {name}\n")

      def shown(err: str, name=name) -> str:
        lines = "\n".join(l for l in err.splitlines() if not l.startswith("step "))
        return f"--- {name}\n{_tail(lines, 25)}\n"

      st.run(argv, {**base, **env}, echo=shown,
             stdout_path=os.path.join(st.out, f"example_{name}.json"))
  for line in compare_examples(st.out):
    st.note(line)
    if "OVER" in line or "not comparable" in line:
      st.failed = True


def example_result(out: str, name: str) -> tuple[list | None, dict | None]:
  try:
    with open(os.path.join(out, f"example_{name}.jsonl")) as f:
      losses = [json.loads(l)["loss"] for l in f if l.strip()]
    with open(os.path.join(out, f"example_{name}.json")) as f:
      summary = json.loads(f.read().strip().splitlines()[-1])
    return losses, summary
  except (OSError, ValueError, IndexError, KeyError):
    return None, None


def compare_examples(out: str) -> list[str]:
  lines = []
  runs = {name: example_result(out, name) for name, _, _ in EXAMPLE_RUNS}
  for name, (_, s) in runs.items():
    if s:
      lines.append(f"{name}: final loss {s['final_loss']:.6f}, step {s['step_time_s'] * 1e3:.2f} ms, "
                   f"collectives alone {s['collectives_time_s'] * 1e3:.2f} ms")
  for a, b in EXAMPLE_PAIRS:
    la, lb = runs[a][0], runs[b][0]
    if not la or not lb or len(la) != len(lb):
      lines.append(f"{a} vs {b}: not comparable")
      continue
    rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb))
    lines.append(f"{a} vs {b}: losses differ by at most {rel:.2e} relative over {len(la)} steps "
                 f"({'within' if rel <= 1e-4 else 'OVER'} 1e-4)")
  return lines


STAGES = {name: globals()[f"stage_{name}"] for name in ALL + EXTRA}


# --- the summary ----------------------------------------------------------------

def _rows(out: str, name: str) -> list[dict]:
  try:
    with open(os.path.join(out, f"{name}.json")) as f:
      return json.load(f)["rows"]
  except (OSError, ValueError, KeyError):
    return []


def _pytest_counts(out: str, stage: str) -> str | None:
  try:
    with open(os.path.join(out, f"{stage}.log")) as f:
      text = f.read()
  except OSError:
    return None
  found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
  return found[-1] if found else None


def targets(out: str) -> list[tuple[str, str, str, str]]:
  """(target, measured, wanted, verdict) for the issue's GPU targets, from what OUT holds
  (the benchmark's JSON carries each row's ratios: jax_smddp.tools.gpu_bench.metrics)."""
  rows = []

  def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")

  counts = _pytest_counts(out, "kernels")
  passed = int(re.search(r"(\d+) passed", counts).group(1)) if counts and "passed" in counts else 0
  ok = None if counts is None else (passed >= 12 and not re.search(r"failed|error|skipped", counts))
  rows.append(("kernel test (tests/gpu/test_kernels.py)", counts or "not run",
               "12 passed, none skipped", verdict(ok)))
  counts = _pytest_counts(out, "jax")
  ok = None if counts is None else ("failed" not in counts and "error" not in counts)
  rows.append(("quick JAX tests (test_gpu.py)", counts or "not run", "all pass", verdict(ok)))
  for n in (2, 4):
    ag = [r for r in _rows(out, f"bench_{n}proc") if r["op"] == "all_gather" and
          r["bytes_per_rank"] >= 16 << 20]
    vals = [r.get("written_per_copy") for r in ag]
    shown = ", ".join(f"{r['bytes_per_rank'] >> 20}M {v:.2f}" for r, v in zip(ag, vals) if v is not None)
    ok = None if not vals or None in vals else min(vals) >= 0.8
    rows.append((f"all_gather written/copy, {n} processes, MPS, direct", shown or "not run",
                 ">= 0.8 from 16M", verdict(ok)))
  # Issue 65: a call enqueues and returns. gpu_bench's "host us": process 0's handler time per
  # call (the buffer exchange with its peers and the enqueues), mean over the timed calls.
  for n in (2, 4):
    hosts = [(r, r.get("host_s")) for r in _rows(out, f"bench_{n}proc")]
    hosts = [(r, h) for r, h in hosts if h is not None]
    worst = max(hosts, key=lambda p: p[1], default=None)
    shown = (f"{worst[0]['op']} {worst[0]['bytes_per_rank'] >> 20}M {worst[1] * 1e6:.1f} us "
             f"(worst of {len(hosts)})" if worst else "")
    rows.append((f"host time per call, {n} processes, MPS, direct", shown or "not run",
                 "<= 15 us", verdict(None if worst is None else worst[1] <= 15e-6)))
  big = [r for n in (2, 4) for r in _rows(out, f"bench_{n}proc") if r["op"] == "reduce_scatter" and
         r["bytes_per_rank"] >= 64 << 20]
  pairs = [(r, r.get("vs_kernel")) for r in big]
  shown = ", ".join(f"{r['ranks']}p {r['bytes_per_rank'] >> 20}M {v:.2f}" for r, v in pairs
                    if v is not None)
  ok = None if not pairs or any(v is None for _, v in pairs) else min(v for _, v in pairs) >= 0.9
  rows.append(("reduce_scatter vs bare kernel, same blocks (default)", shown or "not run",
               ">= 0.9 from 64M", verdict(ok)))
  # all_reduce's time over reduce_scatter's and all_gather's of the same size together.
  fractions = []
  for n in (2, 4):
    by = {(r["op"], r["bytes_per_rank"]): r["smddp_s"] for r in _rows(out, f"bench_{n}proc")}
    for (op, size), t in sorted(by.items()):
      if op == "all_reduce" and ("reduce_scatter", size) in by and ("all_gather", size) in by:
        fractions.append((n, size, t / (by[("reduce_scatter", size)] + by[("all_gather", size)])))
  shown = ", ".join(f"{n}p {size >> 20}M {f:.2f}" for n, size, f in fractions)
  ok = None if not fractions else max(f for _, _, f in fractions) <= 1 / 0.8
  rows.append(("all_reduce time / (reduce_scatter + all_gather)", shown or "not run",
               "<= 1.25", verdict(ok)))
  for op in ("reduce_scatter", "all_reduce"):
    lifted = [r for r in _rows(out, "blocks_1024") if r["op"] == op]
    pairs = [(r, r.get("read_per_copy")) for r in lifted]
    shown = ", ".join(f"{r['bytes_per_rank'] >> 20}M {v:.2f}" for r, v in pairs if v is not None)
    ok = None if not pairs or any(v is None for _, v in pairs) else min(v for _, v in pairs) >= 0.5
    rows.append((f"{op} read/copy, budget lifted (1024 blocks), 2 processes", shown or "not run",
                 ">= 0.5", verdict(ok)))
  try:
    with open(os.path.join(out, "sweep.json")) as f:
      sweep = json.load(f)["rows"]
  except (OSError, ValueError, KeyError):
    sweep = []
  best = max((r["read_per_copy"] for r in sweep if r["blocks"] <= 16 and r["unroll"] == 2),
             default=None)
  rows.append(("bare reduction read/copy within 16 blocks (sweep)",
               "not run" if best is None else f"{best:.2f}", ">= 0.5",
               verdict(None if best is None else best >= 0.5)))
  _, ours = example_result(out, "gpu1_smddp")
  _, xla = example_result(out, "gpu1_xla")
  if ours and xla:
    ratio = ours["step_time_s"] / xla["step_time_s"]
    rows.append(("1-process example step, jax_smddp / XLA",
                 f"{ours['step_time_s'] * 1e3:.2f} / {xla['step_time_s'] * 1e3:.2f} ms = {ratio:.3f}",
                 "<= 1.05", verdict(ratio <= 1.05)))
  else:
    rows.append(("1-process example step, jax_smddp / XLA", "not run", "<= 1.05", "-"))
  _, two = example_result(out, "gpu2_smddp")
  rows.append(("2-process example under MPS, traced", "completed" if two else "not run",
               "completes", verdict(None if two is None else bool(two.get("profile")))))
  return rows


def write_summary(out: str, results: list[dict], budget: Budget, plan: dict) -> str:
  lines = ["# scripts/gpu_check.sh summary", "",
           f"python {plan['python']}; libfabric {plan['libfabric']}; budget {budget.total_s:.0f} s, "
           f"used {budget.elapsed():.0f} s", "",
           "| stage | result | seconds | limit | notes |", "|---|---|---|---|---|"]
  for r in results:
    notes = "; ".join(r["notes"])[:300]
    lines.append(f"| {r['stage']} | {r['result']} | {r['seconds']:.0f} | {r['limit']:.0f} | {notes} |")
  lines += ["", "| target | measured | wanted | verdict |", "|---|---|---|---|"]
  try:
    for t in targets(out):
      lines.append("| " + " | ".join(t) + " |")
  except Exception as e:  # the summary never hides the stages' results
    lines.append(f"| (targets could not be read: {e!r}) | | | |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "stages.json"), "w") as f:
    json.dump({"plan": plan, "budget_s": budget.total_s, "elapsed_s": budget.elapsed(),
               "stages": results}, f, indent=1)
  return text


def main(argv: list[str]) -> int:
  dry = "--dry-run" in argv
  out = os.path.abspath(os.environ.get("OUT") or "/tmp/jax_smddp_gpu_check")
  os.makedirs(out, exist_ok=True)
  stages = parse_stages(os.environ.get("STAGES", "all"))
  budget = Budget(float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)))
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  fab = fab_environment(ROOT, env)
  env.update(fab)
  py = sys.executable
  plan = {"python": py, "prefix": sys.prefix,
          "libfabric": fab.get("JAX_SMDDP_LIBFABRIC_ROOT", "as the machine has it"),
          "stages": {s: LIMITS[s] for s in stages}, "out": out}
  if "swap" in stages:
    plan["swap"] = {"tests": SWAP_TESTS,
                    "front_end": nccl_front_end(py) or
                    "not built now: the stage skips unless the build stage builds it"}
  if dry:
    print(json.dumps(plan, indent=1))
    return 0
  print(f"=== machine; plan {json.dumps(plan)}", flush=True)
  if not shutil.which("nvidia-smi") or subprocess.run(["nvidia-smi", "-L"]).returncode != 0:
    print("no GPU here (nvidia-smi finds none): nothing to check; bash scripts/gpu_check.sh "
          "--dry-run shows the plan")
    return 1
  results: list[dict] = []
  status = 0
  for name in stages:
    limit = budget.stage_limit(LIMITS[name])
    if limit < MIN_STAGE_S:
      results.append({"stage": name, "result": "skipped: budget spent", "seconds": 0, "limit": limit,
                      "notes": [f"{budget.remaining():.0f} s of the budget left"]})
      write_summary(out, results, budget, plan)
      continue
    print(f"=== {name} (up to {limit:.0f} s)", flush=True)
    st = Stage(name, limit, out, env)
    t0 = time.monotonic()
    try:
      STAGES[name](st, py)
    except Exception as e:  # a stage's own error is its result, not the run's end
      st.failed = True
      st.note(f"error: {e!r}")
    result = ("timed out" if st.timed_out else "failed" if st.failed else
              "skipped" if st.notes and st.notes[0].startswith("skipped") else "passed")
    results.append({"stage": name, "result": result, "seconds": time.monotonic() - t0,
                    "limit": limit, "notes": st.notes})
    st.log.close()
    if result in ("failed", "timed out"):
      status = 1
    write_summary(out, results, budget, plan)
    if name == "build" and result != "passed":
      break
  print(write_summary(out, results, budget, plan))
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
