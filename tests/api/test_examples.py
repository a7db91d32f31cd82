"""The FSDP training example (examples/fsdp_train.py), run as users run it: in a subprocess.

Each run keeps its own settings (8 CPU devices, float32), apart from this suite's x64.
Tiny model and 20 steps; the checks are the example's promises:
  * jax_smddp and jax.lax collectives train identically (the swap is one module name);
  * FSDP over 8 devices and hybrid 2x4 sharding equal plain, unsharded training with no
    collectives at all (the reference below, run by executing this file);
  * the loss goes down; remat/offload policies do not change it;
  * a run stopped at step 10 and resumed from its checkpoint continues exactly as the
    uninterrupted run;
  * prefetch (--prefetch, jax_smddp.fsdp.scan_layers) trains as --no-prefetch does, and its
    compiled step gathers the next layer inside the forward loop and reduce-scatters it
    inside the backward loop (--compare-prefetch runs both in one process);
  * in a 2-process run no program the example compiles, in either process, holds a
    collective of XLA's outside the training step (--dump-hlo): initialisation, placement,
    checkpoints and reading results back take none (shard_map style: none at all);
  * the summary says what ran where: every collective kind of the compiled step, with its
    bytes per device and step (checked against the dumped step, read here), the library
    that moved it (jax_smddp, xla (via jax_smddp), xla (gloo), xla (in-process)) and
    jax_smddp's own count of what it moved; the trace's reading names the same libraries.

Tolerance: 1e-4 relative at every step. Measured here: smddp and lax runs are
bit-identical; sharded and unsharded runs differ by about 3e-7 (float32 sums in a
different order).
"""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TRAIN = os.path.join(EXAMPLES, "fsdp_train.py")
RTOL = 1e-4
TINY = {"layers": 2, "d_model": 64, "heads": 4, "seq": 64, "batch": 8, "steps": 20,
        "data_mb": 0.5, "lr": 3e-3, "warmup": 2, "weight_decay": 0.1, "clip": 1.0, "seed": 0}


def _cli(settings: dict) -> list[str]:
  return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def _env() -> dict:
  # The example sets the device count; and no drop-in swap of jax.lax (README).
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_SMDDP_COLLECTIVES")}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def train(tmp_path, *extra: str, name: str = "run", cache: dict | None = None
          ) -> tuple[dict, list[float]]:
  """Runs the example; returns its final JSON summary and the loss of every step. `cache`:
  the session's compilation cache (conftest.example_compile_cache), for runs that dump no
  HLO."""
  assert not (cache and any(a.startswith("--dump-hlo") for a in extra)), "a cached run dumps nothing"
  metrics = tmp_path / f"{name}.jsonl"
  cmd = [sys.executable, TRAIN, *_cli(TINY), "--eval-batches=1", "--no-progress",
         f"--metrics={metrics}", *extra]
  proc = subprocess.run(cmd, cwd=tmp_path, env={**_env(), **(cache or {})}, capture_output=True,
                        text=True, timeout=170)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
  return summary, losses


# Runs that several tests compare against, made once per session.

@pytest.fixture(scope="session")
def fsdp8(tmp_path_factory, example_compile_cache):
  """The default configuration: --mesh 8 --collectives smddp."""
  return train(tmp_path_factory.mktemp("fsdp8"), "--mesh=8", "--collectives=smddp",
               cache=example_compile_cache)


@pytest.fixture(scope="session")
def unsharded(tmp_path_factory):
  """Losses of the same training without shard_map or collectives (see reference_main)."""
  out = tmp_path_factory.mktemp("reference") / "reference.json"
  cmd = [sys.executable, os.path.abspath(__file__), "--reference", str(out)]
  proc = subprocess.run(cmd, cwd=out.parent, env=_env(), capture_output=True, text=True,
                        timeout=170)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


def assert_close(losses, expected, what):
  assert len(losses) == len(expected) == TINY["steps"], what
  for step, (a, b) in enumerate(zip(losses, expected), 1):
    assert abs(a - b) <= RTOL * abs(b), f"{what}: step {step}: {a} vs {b}"


def assert_learns(losses):
  assert all(math.isfinite(x) for x in losses)
  assert losses[0] == pytest.approx(math.log(256), rel=0.02)  # uniform over bytes at init
  assert losses[-1] < losses[0] - 1.0, losses


# XLA's collective instructions in a compiled module's text (the async forms too: *-start);
# jax_smddp's are custom calls whose targets start with smddp_.
XLA_COLLECTIVE = re.compile(r"\s((?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|"
                            r"collective-permute|collective-broadcast|send|recv)(?:-start)?\(")
SMDDP_COLLECTIVE = re.compile(r'custom_call_target="(smddp_\w+)"')


def compiled_programs(dump: pathlib.Path, processes: int) -> list[list[tuple]]:
  """Per process, (program name, XLA's collectives, jax_smddp's) of every program it
  compiled: the example's --dump-hlo DIR holds XLA's text of each module after
  optimization, DIR/process_N/module_NNNN.<name>.cpu_after_optimizations.txt."""
  out = []
  for p in range(processes):
    programs = []
    for path in sorted((dump / f"process_{p}").glob("module_*after_optimizations.txt")):
      text = path.read_text()
      name = path.name.split(".")[1]
      programs.append((name, collections.Counter(XLA_COLLECTIVE.findall(text)),
                       collections.Counter(SMDDP_COLLECTIVE.findall(text))))
    assert len(programs) >= 5, (dump, p, programs)  # the dump is there, for each process
    out.append(programs)
  return out


def check_summary(summary, collectives, mesh):
  assert summary["collectives"] == collectives and summary["mesh"] == mesh
  assert summary["steps"] == TINY["steps"]
  assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] < math.log(256)
  assert summary["tokens_per_s"] > 0 and 0 < summary["collective_share"]
  ops = summary["step_collective_ops"]
  if collectives == "smddp":  # every collective of the step runs on the plugin
    assert set(ops) == {"smddp_all_gather", "smddp_reduce_scatter", "smddp_all_reduce"}, ops
  else:
    assert set(ops) == {"all-gather", "reduce-scatter", "all-reduce"}, ops
  # Which library ran each: the custom calls' own, or XLA's in-process collectives; one
  # process counts jax_smddp's calls too: all of the program's, or none.
  found = summary["step_collectives"]
  assert set(found) == set(ops), found
  for op, o in found.items():
    assert o["library"] == ("jax_smddp" if collectives == "smddp" else "xla (in-process)"), o
    assert o["instructions"] == ops[op] and o["bytes"] > 0, o
    want = (o["calls"], o["bytes"]) if collectives == "smddp" else (0, 0)
    assert (o["jax_smddp_calls"], o["jax_smddp_bytes"]) == want, o


def xla_collectives_per_step(hlo: str) -> dict:
  """Per XLA collective opcode: (instructions, output bytes of one device per run) of a
  compiled module's text, read here independently of the example: the entry computation's
  instructions run once, those of a while body once per iteration (its known_trip_count);
  a collective anywhere else fails the test."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if name is None and head:
      name = "ENTRY" if head.group(1) else head.group(2)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  runs = {"ENTRY": 1}
  for line in comps["ENTRY"]:
    if " while(" in line:
      body = re.search(r"body=%?([\w.\-]+)", line).group(1)
      runs[body] = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
  size = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "bf16": 2, "f64": 8, "s64": 8}
  out = collections.defaultdict(lambda: [0, 0])
  for comp, lines in comps.items():
    for line in lines:
      m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ((?:ragged-)?all-to-all|all-gather|all-reduce|"
                   r"reduce-scatter|collective-permute|collective-broadcast)\(", line)
      if not m:
        continue
      assert comp in runs, (comp, line)  # only the entry and loop bodies hold collectives
      nbytes = sum(size[t] * math.prod(int(d) for d in dims.split(",") if d)
                   for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
      out[m.group(2)][0] += 1
      out[m.group(2)][1] += runs[comp] * nbytes
  return {op: tuple(v) for op, v in out.items()}


@pytest.mark.timeout(300)
def test_fsdp_8_smddp_equals_xla_and_unsharded(tmp_path, fsdp8, unsharded, example_compile_cache):
  smddp, smddp_losses = fsdp8
  xla, xla_losses = train(tmp_path, "--mesh=8", "--collectives=xla", cache=example_compile_cache)
  check_summary(smddp, "smddp", "8")
  check_summary(xla, "xla", "8")
  assert_close(smddp_losses, xla_losses, "smddp vs xla")
  assert_close(smddp_losses, unsharded, "FSDP 8 vs unsharded")
  assert_learns(smddp_losses)
  assert smddp["eval_loss"] == pytest.approx(xla["eval_loss"], rel=RTOL)


@pytest.mark.timeout(300)
def test_hybrid_2x4_smddp_equals_xla_and_unsharded(tmp_path, unsharded, example_compile_cache):
  cache = example_compile_cache
  smddp, smddp_losses = train(tmp_path, "--mesh=2x4", "--collectives=smddp", name="smddp", cache=cache)
  xla, xla_losses = train(tmp_path, "--mesh=2x4", "--collectives=xla", name="xla", cache=cache)
  check_summary(smddp, "smddp", "2x4")
  check_summary(xla, "xla", "2x4")
  assert_close(smddp_losses, xla_losses, "smddp vs xla")
  assert_close(smddp_losses, unsharded, "hybrid 2x4 vs unsharded")
  assert_learns(smddp_losses)


@pytest.mark.timeout(400)
def test_jit_style_two_processes_smddp_equals_gloo_and_unsharded(tmp_path, unsharded):
  """--style jit (global-view jit, XLA's partitioner inserts the collectives) as a
  2-process job: with --collectives smddp those collectives cross processes on
  jax_smddp (JAX_SMDDP_COLLECTIVES=xla, set by the example for its processes),
  with xla on gloo; both train as the unsharded reference does, and each run's summary
  and trace name the library that moved each collective (check_jit_libraries)."""
  smddp, smddp_losses = train(tmp_path, "--style=jit", "--processes=2", "--mesh=8",
                              "--collectives=smddp", f"--dump-hlo={tmp_path / 'hlo'}",
                              f"--profile={tmp_path / 'trace_smddp'}", name="jit_smddp")
  gloo, gloo_losses = train(tmp_path, "--style=jit", "--processes=2", "--mesh=8",
                            "--collectives=xla", f"--profile={tmp_path / 'trace_gloo'}",
                            name="jit_gloo")
  for summary in (smddp, gloo):
    assert summary["style"] == "jit" and summary["processes"] == 2, summary
  assert_close(smddp_losses, gloo_losses, "jit style: smddp vs gloo")
  for step, (a, b) in enumerate(zip(smddp_losses, gloo_losses), 1):
    assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
  assert_close(smddp_losses, unsharded, "jit style vs unsharded")
  assert_learns(smddp_losses)
  # Of every program the smddp run compiled, in either process, only the three that are
  # meant to communicate hold collectives: the step, eval (the loss is replicated) and the
  # collectives-only gather. XLA's by design in this style; the XLA-level swap runs them on
  # jax_smddp. Initialisation, batch placement and reading the loss back take none.
  for p, programs in enumerate(compiled_programs(tmp_path / "hlo", 2)):
    assert not any(smddp for _, _, smddp in programs), (p, programs)  # no shard_map here
    communicating = sorted({name for name, xla, _ in programs if xla})
    assert communicating == ["jit__loss", "jit__train_step", "jit_gather_params"], \
        (p, [(name, dict(xla)) for name, xla, _ in programs if xla])
  check_jit_libraries(tmp_path / "hlo", smddp, gloo)


def check_jit_libraries(dump, smddp, gloo):
  """What the two jit-style runs say ran where: every collective kind of the step (read
  from the dumped step independently), each named with the library that moved it, its
  bytes per device and step, and jax_smddp's own count of them where it moved them."""
  step = next((dump / "process_0").glob("module_*.jit__train_step.cpu_after_optimizations.txt"))
  want = xla_collectives_per_step(step.read_text())
  assert "collective-permute" in want and "all-gather" in want, want
  libraries = {"smddp": "xla (via jax_smddp)", "gloo": "xla (gloo)"}
  for run, summary in (("smddp", smddp), ("gloo", gloo)):
    found = summary["step_collectives"]
    assert set(found) == set(want) == set(summary["step_collective_ops"]), (run, found, want)
    for op, (instructions, nbytes) in want.items():
      o = found[op]
      assert o["library"] == libraries[run], (run, op, o)
      assert (o["instructions"], o["bytes"]) == (instructions, nbytes), (run, op, o, want[op])
      if run == "gloo":  # jax_smddp never joined this job: nothing of its to count
        assert o["jax_smddp_calls"] is None and o["jax_smddp_bytes"] is None, (op, o)
      elif op in ("all-gather", "all-reduce", "reduce-scatter"):
        # Every byte of these outputs was delivered by jax_smddp's engine.
        assert o["jax_smddp_bytes"] == nbytes and o["jax_smddp_calls"] >= o["calls"], (op, o)
      else:  # point-to-point: the blocks other devices sent, at most the outputs
        assert 0 < o["jax_smddp_bytes"] <= nbytes and o["jax_smddp_calls"] > 0, (op, o)
    # The trace's reading names the same library for every collective it holds.
    for device, d in summary["profile"]["devices"].items():
      assert {name.split(":")[0] for name in d["collectives"]} == {libraries[run]}, (run, d)
      assert {name.split(":")[1] for name in d["collectives"]} == \
          {op.replace("-", "_") for op in want}, (run, device, d)
  assert smddp["xla_collectives"] == "jax_smddp" and gloo["xla_collectives"] == "gloo"
  # The settings that differ from their defaults: the swap, which the example sets.
  assert smddp["jax_smddp_settings"] == {"JAX_SMDDP_COLLECTIVES": "xla"}, smddp
  assert gloo["jax_smddp_settings"] == {}, gloo


@pytest.mark.timeout(400)
def test_two_processes_traced_run_only_jax_smddp_collectives(tmp_path, fsdp8):
  """--processes 2 --mesh 8 in shard_map style, stopped at step 10 with a checkpoint and
  resumed from it (a 2-process job each time):
    * no program either run compiles, in either process, holds a collective of XLA's
      (--dump-hlo: every compiled module's optimized HLO): not the step, and not parameter
      initialisation, batch placement, the collectives-only step, eval, checkpoint save and
      restore or reading the losses back (placing a global array with jax.device_put, or
      Orbax's default barriers, would add an XLA all-gather or all-reduce across processes:
      gloo here, NCCL on a GPU, which refuses 2 processes on one GPU). jax_smddp leaves
      none of the example's collectives to XLA (float32, whole mesh axes), so the only
      collectives are its custom calls, in the step, the collectives-only step and eval;
    * 3 steps traced (--profile): on each device of the reporting process every collective
      of the traced steps is jax_smddp's, once per layer and step;
    * it trains as the 1-process run does, through the restart."""
  ckpt, dump = f"--checkpoint-dir={tmp_path / 'ckpt'}", tmp_path / "hlo"
  first, first_losses = train(tmp_path, "--processes=2", "--mesh=8", ckpt, "--stop-at=10",
                              f"--profile={tmp_path / 'trace'}", f"--dump-hlo={dump / 'first'}",
                              name="traced")
  second, second_losses = train(tmp_path, "--processes=2", "--mesh=8", ckpt, "--resume",
                                f"--dump-hlo={dump / 'resumed'}", name="resumed")
  assert first["steps"] == 10 and second["start_step"] == 10 and second["steps"] == 20
  for run in ("first", "resumed"):
    for p, programs in enumerate(compiled_programs(dump / run, 2)):
      xla = [(name, dict(ops)) for name, ops, _ in programs if ops]
      assert not xla, (run, p, xla)
      smddp = sorted(name for name, _, ops in programs if ops)
      assert smddp == ["jit__eval_step", "jit__train_step", "jit_comm"], (run, p, smddp)
  profile = first["profile"]
  assert profile["steps"] == [3, 5] and profile["kind"] == "cpu", profile
  assert profile["trace"].startswith(str(tmp_path / "trace" / "process_0"))
  assert len(profile["devices"]) == 4, profile["devices"]  # this process's half of the mesh
  layers = TINY["layers"]
  for device, found in profile["devices"].items():
    counts = {name: c["count"] for name, c in found["collectives"].items()}
    assert set(counts) == {"jax_smddp:all_gather", "jax_smddp:reduce_scatter",
                           "jax_smddp:all_reduce"}, (device, counts)
    # The embedding, the head and each layer, gathered once per step.
    assert counts["jax_smddp:all_gather"] == 3 * (2 + layers), (device, counts)
  # Each op's calls and bytes, as jax_smddp's engine counted them over the steps, are the
  # compiled step's (its handlers count every device's calls).
  for op, o in first["step_collectives"].items():
    assert o["library"] == "jax_smddp" and o["bytes"] > 0, (op, o)
    assert (o["jax_smddp_calls"], o["jax_smddp_bytes"]) == (o["calls"], o["bytes"]), (op, o)
  assert first["step_collectives"]["smddp_all_gather"]["calls"] == 2 + layers
  assert_close(first_losses + second_losses, fsdp8[1], "2 processes, restarted, vs 1 process")


@pytest.mark.timeout(300)
def test_remat_and_offload_do_not_change_training(tmp_path, fsdp8, example_compile_cache):
  _, plain = fsdp8
  cache = example_compile_cache
  remat, remat_losses = train(tmp_path, "--mesh=8", "--remat=full", name="remat", cache=cache)
  offload, offload_losses = train(tmp_path, "--mesh=8", "--offload", name="offload", cache=cache)
  assert remat["remat"] == "full" and offload["remat"] == "offload_dots_no_batch"
  # Recomputed layers gather their parameters again in the backward pass.
  assert remat["gathers_per_layer"] == offload["gathers_per_layer"] == 2
  assert fsdp8[0]["step_collective_ops"]["smddp_all_gather"] == 3  # embed, head, layer
  assert remat["step_collective_ops"]["smddp_all_gather"] == 4     # + layer again in bwd
  assert_close(remat_losses, plain, "--remat full vs none")
  assert_close(offload_losses, plain, "--offload vs none")


@pytest.mark.timeout(300)
def test_checkpoint_resume_continues_the_same_run(tmp_path, fsdp8, example_compile_cache):
  _, whole = fsdp8
  ckpt, cache = f"--checkpoint-dir={tmp_path / 'ckpt'}", example_compile_cache
  first, first_losses = train(tmp_path, ckpt, "--stop-at=10", name="first", cache=cache)
  assert first["steps"] == 10 and first_losses == whole[:10]
  second, second_losses = train(tmp_path, ckpt, "--resume", name="second", cache=cache)
  assert second["start_step"] == 10 and second["steps"] == 20
  # Same parameters, optimizer state, schedule position and batches: the same numbers.
  assert second_losses == whole[10:]
  # A checkpoint from another configuration is refused, not loaded into the wrong layout.
  cmd = [sys.executable, TRAIN, *_cli(TINY), "--mesh=2x4", ckpt, "--resume", "--no-progress"]
  proc = subprocess.run(cmd, cwd=tmp_path, env={**_env(), **cache}, capture_output=True,
                        text=True, timeout=170)
  assert proc.returncode != 0 and "other settings" in proc.stderr, proc.stderr[-2000:]


# ---- prefetch (jax_smddp.fsdp.scan_layers) ----

def compare_prefetch(tmp_path, *extra: str, name: str = "compare") -> dict:
  """The example's --compare-prefetch mode: both variants, same process, same batches."""
  cmd = [sys.executable, TRAIN, *_cli({**TINY, "layers": 3}), "--no-progress",
         "--compare-prefetch=10", "--compare-block=5", *extra]
  proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                        timeout=170)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_other_prefetch_setting_trains_alike(tmp_path, fsdp8, unsharded, example_compile_cache):
  """The non-default --prefetch/--no-prefetch equals the default run and unsharded training."""
  default, default_losses = fsdp8
  flag = "--no-prefetch" if default["prefetch"] else "--prefetch"
  other, other_losses = train(tmp_path, "--mesh=8", flag, name="other", cache=example_compile_cache)
  assert other["prefetch"] is not default["prefetch"]
  check_summary(other, "smddp", "8")
  assert_close(other_losses, default_losses, f"{flag} vs default")
  assert_close(other_losses, unsharded, f"{flag} vs unsharded")
  runs = {r["prefetch"]: r for r in (default, other)}
  # 2 layers: embed, head and one gather per layer (with prefetch, layer 0's is issued
  # before the loop, layer 1's in it: XLA inlines a loop of one iteration), one
  # reduce-scatter each: the same count either way.
  for r in runs.values():
    assert r["step_collective_ops"]["smddp_all_gather"] == 3 + r["prefetch"], r
    assert r["step_collective_ops"]["smddp_reduce_scatter"] == 3 + r["prefetch"], r
    assert r["gathers_per_layer"] == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,collectives,remat", [("8", "smddp", "none"),
                                                    ("2x4", "xla", "dots")])
def test_prefetch_gathers_the_next_layer_in_the_loop(tmp_path, mesh, collectives, remat):
  out = compare_prefetch(tmp_path, f"--mesh={mesh}", f"--collectives={collectives}",
                         f"--remat={remat}")
  assert out["collectives"] == collectives and out["mesh"] == mesh
  assert out["steps_each"] == 10 and out["ratio"] > 0
  # Same batches and initial state: the losses agree (rounding only: 15 steps each).
  assert out["max_loss_rel_diff"] <= RTOL, out["max_loss_rel_diff"]
  ag, rs = (("smddp_all_gather", "smddp_reduce_scatter") if collectives == "smddp"
            else ("all-gather", "reduce-scatter"))
  on, off = out["compare_prefetch"]["prefetch"], out["compare_prefetch"]["no_prefetch"]
  # 3 layers. Prefetch: layer 0 gathered before the loop, the forward loop (2 iterations)
  # gathers the next layer, the backward loop reduce-scatters it (autodiff's transpose);
  # the prefetched parameters are kept for the backward pass, remat or not.
  assert on["loop_collective_ops"] == [{ag: 1}, {rs: 1}], on
  assert on["step_collective_ops"][ag] == 4 and on["step_collective_ops"][rs] == 4, on
  # No prefetch: each layer gathered in the loop just before use; a remat'ed layer is
  # gathered again in the backward loop (today's behaviour).
  regather = remat != "none"
  assert off["loop_collective_ops"] == [{ag: 1}, {ag: 1, rs: 1} if regather else {rs: 1}], off
  assert off["step_collective_ops"][ag] == 3 + regather and off["step_collective_ops"][rs] == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("library", ["smddp", "xla"])
def test_scan_layers_helper(library):
  """jax_smddp.fsdp.scan_layers: values and gradients equal a plain loop, with and without
  prefetch and remat; the prefetching program has one gather inside the layer loop."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  import jax_smddp
  from jax_smddp.fsdp import scan_layers

  lib = jax_smddp if library == "smddp" else jax.lax
  mesh = jax.make_mesh((8,), ("fsdp",))
  layers, d = 4, 16
  w = jax.random.normal(jax.random.key(1), (layers, d * d), jnp.float32) / d
  x = jax.random.normal(jax.random.key(2), (8, d), jnp.float32)
  gather = lambda s: lib.all_gather(s, "fsdp", axis=0, tiled=True).reshape(d, d)
  layer = lambda h, p: jnp.tanh(h @ p)

  def loss(w, x, **kw):
    def local(w, x):
      if kw:
        h = scan_layers(layer, x, w, gather, **kw)
      else:  # the reference: a plain loop
        h = x
        for i in range(layers):
          h = layer(h, gather(w[i]))
      return lib.psum(jnp.sum(h ** 2), "fsdp")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "fsdp"), P("fsdp")),
                         out_specs=P())(w, x)

  args = (jax.device_put(w, NamedSharding(mesh, P(None, "fsdp"))),
          jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
  want = jax.jit(jax.value_and_grad(loss))(*args)
  for kw in ({"prefetch": True}, {"prefetch": False},
             {"prefetch": True, "policy": jax.checkpoint_policies.nothing_saveable},
             {"prefetch": False, "policy": jax.checkpoint_policies.dots_saveable}):
    got = jax.jit(jax.value_and_grad(lambda w, x: loss(w, x, **kw)))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6), kw
  # The forward program: layer 0's gather before the loop, one in the loop (layer i+1).
  sys.path.insert(0, EXAMPLES)
  from fsdp_step import collective_ops, loop_collective_ops
  text = jax.jit(lambda w, x: loss(w, x, prefetch=True)).lower(*args).compile().as_text()
  ag = "smddp_all_gather" if library == "smddp" else "all-gather"
  assert collective_ops(text)[ag] == 2 and loop_collective_ops(text) == [{ag: 1}]


# ---- the reference: plain training, no mesh, no shard_map, no collectives ----

def reference_main(out_path: str) -> None:
  """Trains TINY on one device with the example's model, data and optimizer settings."""
  sys.path.insert(0, EXAMPLES)
  import jax
  import jax.numpy as jnp
  import optax
  import fsdp_model as fm
  from fsdp_data import ByteDataset
  from fsdp_step import make_optimizer, make_schedule

  s = TINY
  d_ff = 32 * math.ceil(8 * s["d_model"] / 3 / 32)
  cfg = fm.Config(d_model=s["d_model"], n_heads=s["heads"], n_layers=s["layers"], d_ff=d_ff,
                  seq_len=s["seq"])
  data = ByteDataset.from_stdlib(cfg.seq_len, max_bytes=int(s["data_mb"] * 2**20))
  params = jax.jit(lambda k: fm.init_params(cfg, k))(jax.random.key(s["seed"]))
  # Decay matrices, not norm scales (layer leaves carry the layer dimension first).
  mask = {g: jax.tree.map(lambda x, g=g: x.ndim - (g == "layers") >= 2, params[g])
          for g in params}
  opt = make_optimizer(make_schedule(s["lr"], s["warmup"], s["steps"]), s["weight_decay"], mask)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = fm.forward(cfg, p, tokens[:, :-1])
      return fm.next_token_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].size
    loss, grads = jax.value_and_grad(loss_fn)(params)
    norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, s["clip"] / (norm + 1e-6)), grads)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(s["steps"]):
    params, opt_state, loss = step(params, opt_state, data.train_batch(i, s["batch"], s["seed"]))
    losses.append(float(loss))
  with open(out_path, "w") as f:
    json.dump(losses, f)


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--reference":
    reference_main(sys.argv[2])
  else:
    sys.exit("usage: test_examples.py --reference OUT.json  (pytest runs the tests)")
