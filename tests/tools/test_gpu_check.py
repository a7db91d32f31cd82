"""scripts/gpu_check.sh and scripts/gpu_check.py without a GPU: the interpreter it
resolves, the carried libfabric it finds, the budget its stages share, and the
summary it leaves in OUT after every stage (a run cut short keeps what it
measured). The stages' own commands run on a GPU machine only."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ran_in_first_suite

ran_in_first_suite("scripts/gpu_check.sh's plan, budget and summary (shell and Python, no jax)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gc(monkeypatch):
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def dry_run(env_extra, cwd=ROOT):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "STAGES")}
  env.update(env_extra)
  return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"],
                        capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def test_python_is_resolved_to_an_absolute_interpreter(tmp_path):
  """PYTHON=python3 (the default) was passed on as "python3", whose dirname of dirname is
  ".": scripts/build_testing.sh then failed and the kernel test skipped. Now the plan names
  an absolute interpreter that exists, whatever the caller typed."""
  bindir = tmp_path / "bin"
  bindir.mkdir()
  (bindir / "mypython").symlink_to(sys.executable)
  for typed, extra in (("python3", {}), ("mypython", {"PATH": f"{bindir}:{os.environ['PATH']}"}),
                       ("bin/mypython", {})):
    run = dry_run({"PYTHON": typed, **extra}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert os.path.isabs(plan["python"]) and os.path.exists(plan["python"]), (typed, plan)
    assert os.path.isabs(plan["prefix"]), plan
  run = dry_run({"PYTHON": "no-such-python-here"})
  assert run.returncode == 2 and "PYTHON=no-such-python-here is not a command" in run.stderr


def test_stages_default_to_all_in_order_of_value_and_unknown_names_fail(gc):
  assert gc.parse_stages("") == gc.parse_stages("all") == \
      ["build", "kernels", "phases", "sweep", "swap", "bench", "jax", "overlap", "blocks"]
  assert gc.parse_stages("build,all,nccl") == list(gc.ALL) + ["nccl"]
  with pytest.raises(SystemExit, match="unknown stage 'benchmark'"):
    gc.parse_stages("build,benchmark")
  assert set(gc.LIMITS) == set(gc.ALL + gc.EXTRA) == set(gc.STAGES)


def test_the_swap_stage_plan_names_its_tests_and_the_front_end(tmp_path):
  """STAGES=swap --dry-run: the stage's limit, the GPU test file it runs (under 3 minutes)
  and the NCCL API front end this interpreter's build has (or that it has none)."""
  from jax_smddp.swap import nccl as nccl_swap
  run = dry_run({"PYTHON": sys.executable, "STAGES": "swap"})
  assert run.returncode == 0, run.stderr
  plan = json.loads(run.stdout)
  assert plan["stages"] == {"swap": 170}, plan
  assert plan["swap"]["tests"] == "tests/gpu/test_xla_swap_gpu.py", plan
  assert os.path.isfile(os.path.join(ROOT, plan["swap"]["tests"]))
  library = nccl_swap.library_path()
  want = library if os.path.exists(library) else \
      "not built now: the stage skips unless the build stage builds it"
  assert plan["swap"]["front_end"] == want, plan
  assert "swap" not in json.loads(dry_run({"PYTHON": sys.executable, "STAGES": "build"}).stdout)


def test_the_swap_stage_runs_its_gpu_tests_only_with_a_front_end(gc, tmp_path, monkeypatch):
  """With libsmddp_nccl.so built, the stage runs tests/gpu/test_xla_swap_gpu.py under pytest
  (-rsP: the tests print what the front end served into the log; the file runs its steps with
  and without collectives in XLA's CUDA graphs); without, it is skipped, saying why, and runs
  nothing."""
  ran, envs = [], []
  st = gc.Stage("swap", 30, str(tmp_path), dict(os.environ))
  monkeypatch.setattr(st, "run", lambda argv, env=None, **kw: ran.append(argv) or envs.append(env) or 0)
  monkeypatch.setattr(gc, "nccl_front_end", lambda py: None)
  gc.stage_swap(st, sys.executable)
  assert ran == [] and st.notes[0].startswith("skipped: this build has no libsmddp_nccl.so"), st.notes
  monkeypatch.setattr(gc, "nccl_front_end", lambda py: "/x/libsmddp_nccl.so")
  st.notes.clear()
  gc.stage_swap(st, sys.executable)
  assert len(ran) == 1 and ran[0][-1] == "tests/gpu/test_xla_swap_gpu.py" and "-rsP" in ran[0], ran
  assert not st.notes[0].startswith("skipped"), st.notes
  assert gc.LIMITS["swap"] <= 180  # the stage's tests take under 3 minutes
  st.log.close()


def test_carried_libfabric_is_laid_out_as_a_prefix_and_found_through_the_documented_root(gc, tmp_path):
  """scripts/carry_libfabric.sh in a scratch checkout: .fab/ is a libfabric prefix
  (include/rdma, lib/), which gpu_check hands to CMake as JAX_SMDDP_LIBFABRIC_ROOT
  (tests/build/test_build.py checks that CMake finds such a prefix) and to the processes
  on the loader path. Before, CPATH carried the headers, which CMake's discovery ignores."""
  if not os.path.exists("/usr/include/rdma/fabric.h"):
    assert os.environ.get("CI") != "true", "CI installs libfabric-dev (scripts/system_packages.sh)"
    pytest.skip("libfabric's headers are not installed here")
  scratch = tmp_path / "checkout"
  (scratch / "scripts").mkdir(parents=True)
  shutil.copy(os.path.join(ROOT, "scripts", "carry_libfabric.sh"), scratch / "scripts")
  subprocess.run(["git", "init", "-q", str(scratch)], check=True, timeout=30)
  # A loader cache as long as CI's: the script must read ldconfig's listing to its end
  # (stopping at the first match killed ldconfig with SIGPIPE, exit 141 under pipefail).
  shim = tmp_path / "bin"
  shim.mkdir()
  (shim / "ldconfig").write_text(f"#!/bin/sh\n{shutil.which('ldconfig')} \"$@\"\n"
                                 "seq 1 200000 | sed 's|.*|\\tlibfiller&.so (libc6,x86-64) => /x|'\n")
  (shim / "ldconfig").chmod(0o755)
  run = subprocess.run(["bash", str(scratch / "scripts" / "carry_libfabric.sh")], capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"})
  assert run.returncode == 0, run.stderr
  fab = scratch / ".fab"
  assert (fab / "include" / "rdma" / "fabric.h").is_file()
  assert (fab / "lib" / "libfabric.so.1").is_file()
  env = gc.fab_environment(str(scratch), {"LD_LIBRARY_PATH": "/somewhere:/else"})
  assert env == {"JAX_SMDDP_LIBFABRIC_ROOT": str(fab),
                 "LD_LIBRARY_PATH": f"{fab / 'lib'}:/somewhere:/else"}
  # The carried library loads from there alone.
  probe = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])",
                          str(fab / "lib" / "libfabric.so.1")], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
  assert probe.returncode == 0, probe.stderr
  # Without the header there is nothing to carry (a half-copied .fab/ is not used).
  os.remove(fab / "include" / "rdma" / "fabric.h")
  assert gc.fab_environment(str(scratch), {}) == {}
  assert gc.fab_environment(str(tmp_path / "nothing"), {}) == {}


def test_budget_gives_each_stage_its_limit_or_what_is_left(gc):
  now = [100.0]
  budget = gc.Budget(540, clock=lambda: now[0])
  assert budget.stage_limit(150) == 150
  now[0] += 450
  assert budget.remaining() == 90 and budget.stage_limit(150) == 90 - gc.RESERVE_S
  now[0] += 100
  assert budget.stage_limit(150) == 0


def bench_rows():
  """2 processes sharing a GPU whose copy rate is 1 TB/s, with the ratios gpu_bench stores."""
  from jax_smddp.tools import gpu_bench
  rows = [
      {"op": "all_gather", "bytes_per_rank": 16 << 20, "ranks": 2, "smddp_s": 80e-6, "copy_Bps": 1e12,
       "host_s": 12e-6},
      {"op": "all_gather", "bytes_per_rank": 64 << 20, "ranks": 2, "smddp_s": 200e-6, "copy_Bps": 1e12},
      {"op": "reduce_scatter", "bytes_per_rank": 64 << 20, "ranks": 2, "smddp_s": 1e-3,
       "copy_Bps": 1e12, "reduce_ref_s": 0.95e-3, "max_blocks": 16, "host_s": 40e-6},
  ]
  return [{**r, **gpu_bench.metrics(r)} for r in rows]


def test_a_run_cut_by_its_budget_leaves_every_result_and_the_summary(gc, tmp_path, monkeypatch):
  """Fake stages on a fake GPU: the kernel test passes, the benchmark leaves its JSON, the
  next stage finds the summary already written, the JAX tests outrun their limit and are
  killed, and the budget left after them is too small for the next stage, which is skipped,
  not started. summary.md and stages.json say all of it, targets included."""
  fakebin = tmp_path / "bin"
  fakebin.mkdir()
  (fakebin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake H200'\n")
  (fakebin / "nvidia-smi").chmod(0o755)
  out = tmp_path / "out"
  monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
  monkeypatch.setenv("OUT", str(out))
  monkeypatch.setenv("STAGES", "kernels,bench,jax,overlap")
  monkeypatch.setenv("GPU_CHECK_BUDGET_S", "3.5")
  monkeypatch.setattr(gc, "MIN_STAGE_S", 1.6)
  monkeypatch.setattr(gc, "RESERVE_S", 0)
  monkeypatch.setitem(gc.LIMITS, "jax", 2)
  seen = {}

  def kernels(st, py):
    st.run(["bash", "-c", "echo '12 passed in 3.21s'"])

  def bench(st, py):
    seen["summary after kernels"] = (out / "summary.md").read_text()
    (out / "bench_2proc.json").write_text(json.dumps({"rows": bench_rows()}))

  def jax_tests(st, py):
    st.run(["bash", "-c", "echo started; sleep 30; echo never"])

  def overlap(st, py):
    raise AssertionError("a stage the budget cannot hold must not start")

  monkeypatch.setitem(gc.STAGES, "kernels", kernels)
  monkeypatch.setitem(gc.STAGES, "bench", bench)
  monkeypatch.setitem(gc.STAGES, "jax", jax_tests)
  monkeypatch.setitem(gc.STAGES, "overlap", overlap)
  assert gc.main([]) == 1  # the timed-out stage fails the run
  assert "| kernels | passed |" in seen["summary after kernels"]
  stages = json.loads((out / "stages.json").read_text())["stages"]
  assert [(s["stage"], s["result"]) for s in stages] == [
      ("kernels", "passed"), ("bench", "passed"), ("jax", "timed out"),
      ("overlap", "skipped: budget spent")]
  assert stages[2]["seconds"] < 5  # killed at its limit, not after its sleep
  log = (out / "jax.log").read_text()
  assert "\nstarted\n" in log and "\nnever" not in log and "stopped at the stage limit" in log
  summary = (out / "summary.md").read_text()
  assert "| kernel test (tests/gpu/test_kernels.py) | 12 passed | 12 passed, none skipped | met |" \
      in summary  # the counts, not the time
  # written/copy = 2 x 2 x size / time / copy: 16M 0.84, 64M 1.34; reduce_scatter vs kernel 0.95
  assert "| all_gather written/copy, 2 processes, MPS, direct | 16M 0.84, 64M 1.34 | >= 0.8 from 16M | met |" \
      in summary
  assert "| reduce_scatter vs bare kernel, same blocks (default) | 2p 64M 0.95 | >= 0.9 from 64M | met |" in summary
  assert "| all_reduce time / (reduce_scatter + all_gather) | not run |" in summary
  assert "| host time per call, 2 processes, MPS, direct | reduce_scatter 64M 40.0 us (worst of 2) " \
      "| <= 15 us | NOT met |" in summary  # rows without the host time are left out
  assert "| host time per call, 4 processes, MPS, direct | not run |" in summary
  assert "| all_gather written/copy, 4 processes, MPS, direct | not run |" in summary
  assert "| 1-process example step, jax_smddp / XLA | not run |" in summary


def test_example_comparison_flags_losses_that_differ(gc, tmp_path):
  def write(name, losses, step_s):
    with open(tmp_path / f"example_{name}.jsonl", "w") as f:
      for i, l in enumerate(losses):
        f.write(json.dumps({"step": i, "loss": l}) + "\n")
    (tmp_path / f"example_{name}.json").write_text(json.dumps(
        {"final_loss": losses[-1], "step_time_s": step_s, "collectives_time_s": 0.001}) + "\n")

  write("gpu1_smddp", [3.0, 2.5, 2.0], 0.0033)
  write("gpu1_xla", [3.0, 2.5, 2.0001], 0.0032)
  write("gpu2_smddp", [3.0, 2.6], 0.004)
  lines = gc.compare_examples(str(tmp_path))
  assert any("gpu1_smddp vs gpu1_xla: losses differ by at most 5.00e-05" in l and "within" in l
             for l in lines), lines
  assert "gpu2_smddp vs cpu2_smddp: not comparable" in lines
  write("gpu1_xla", [3.0, 2.5, 2.01], 0.0032)
  assert any("gpu1_smddp vs gpu1_xla" in l and "OVER" in l for l in gc.compare_examples(str(tmp_path)))
  rows = {t[0]: t for t in gc.targets(str(tmp_path))}
  assert rows["1-process example step, jax_smddp / XLA"][1:] == \
      ("3.30 / 3.20 ms = 1.031", "<= 1.05", "met")


@pytest.mark.parametrize("line,verdict", [
    ("12 passed in 40.1s", "met"), ("11 passed, 1 skipped in 30.0s", "NOT met"),
    ("11 passed, 1 failed in 30.0s", "NOT met"), ("===== 3 passed in 1.0s =====", "NOT met")])
def test_the_kernel_target_counts_skips_as_missing(gc, tmp_path, line, verdict):
  """The last GPU run's kernel test reported "1 skipped" (its module was not built) and passed
  for nothing: a skip is not a pass."""
  (tmp_path / "kernels.log").write_text(f"....\n{line}\n")
  rows = {t[0]: t for t in gc.targets(str(tmp_path))}
  assert rows["kernel test (tests/gpu/test_kernels.py)"][3] == verdict


def test_a_stage_command_keeps_stdout_apart_and_is_killed_with_its_children(gc, tmp_path, capsys):
  """The example's runs: stdout (the JSON summary) to a file of its own, stderr to the log and,
  filtered, to the screen; at the stage limit the whole process group goes, a launcher's
  children included (subprocess's own timeout kills only the child it started)."""
  st = gc.Stage("overlap", 30, str(tmp_path), dict(os.environ))
  rc = st.run(["bash", "-c", "echo '{\"x\": 1}'; echo 'step 1' >&2; echo 'kept' >&2"],
              echo=lambda err: "shown: " + " ".join(l for l in err.split() if l != "step"),
              stdout_path=str(tmp_path / "summary.json"))
  assert rc == 0 and not st.failed
  assert json.loads((tmp_path / "summary.json").read_text()) == {"x": 1}
  assert "kept" in (tmp_path / "overlap.log").read_text()
  assert "shown: 1 kept" in capsys.readouterr().out
  st = gc.Stage("overlap", 2, str(tmp_path), dict(os.environ))
  marker = tmp_path / "grandchild_alive"
  rc = st.run(["bash", "-c", f"(sleep 4; touch {marker}) & sleep 30"], echo=False,
              stdout_path=str(tmp_path / "killed.json"))
  assert rc == 124 and st.timed_out and st.failed
  import time
  time.sleep(3)
  assert not marker.exists(), "a child of the stage's command outlived the stage"
  st.log.close()


def test_without_a_gpu_it_says_so_and_exits_1(tmp_path):
  """No nvidia-smi on PATH (this machine, CI): a sentence, not a traceback."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "STAGES")}
  env.update(OUT=str(tmp_path), PATH=f"{os.path.dirname(sys.executable)}:/usr/bin:/bin")
  run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True,
                       text=True, timeout=60, env=env, cwd=ROOT)
  assert run.returncode == 1 and "no GPU here" in run.stdout and "Traceback" not in run.stderr, \
      run.stdout + run.stderr
