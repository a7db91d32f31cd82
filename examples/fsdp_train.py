"""Train a small transformer with FSDP, its collectives run by jax_smddp (or by jax.lax).

    python examples/fsdp_train.py                      # 8 CPU devices, FSDP 8-way, jax_smddp
    python examples/fsdp_train.py --collectives xla    # the same training, jax.lax collectives
    python examples/fsdp_train.py --mesh 2x4           # hybrid: 2 replica groups x 4-way FSDP
    python examples/fsdp_train.py --checkpoint-dir /tmp/ck --stop-at 100   # "preempted" at 100
    python examples/fsdp_train.py --checkpoint-dir /tmp/ck --resume        # continues at 101
    python examples/fsdp_train.py --prefetch           # gather layer i+1 while layer i computes
    python examples/fsdp_train.py --compare-prefetch 300   # time steps with/without prefetch
    python examples/fsdp_train.py --style jit --processes 2   # global-view jit, 2 processes,
                                                   # XLA's collectives on jax_smddp
    python examples/fsdp_train.py --style jit --processes 2 --collectives xla   # ... on gloo
    mpirun -n 2 python examples/fsdp_train.py --mesh 2   # one job of the launcher's processes
    srun -n 16 python examples/fsdp_train.py --mesh 16 --platform cuda   # one process per GPU

Started by a launcher (Slurm's srun, Open MPI's mpirun, or JAX_COORDINATOR_ADDRESS with
JAX_NUM_PROCESSES and JAX_PROCESS_ID), every process joins that one job (jax_smddp.job); on
CPU each makes its share of the mesh's devices. --processes N is a launcher of its own: N
processes on this host.

A decoder-only transformer (Flax; RMSNorm, rotary embeddings, causal attention, SwiGLU)
learns to predict the bytes of Python's standard library. Parameters and AdamW state
live sharded over the `fsdp` mesh axis; each layer's parameters are all-gathered just
before the layer runs and its gradients come back reduce-scattered (fsdp_step.py).
With --style jit the same model is written as global-view jit, as MaxText writes FSDP:
sharded arrays, no shard_map, and XLA's partitioner inserts the collectives
(fsdp_jit_step.py); with --collectives smddp those run on jax_smddp's engine across
processes (JAX_SMDDP_COLLECTIVES=xla), with --collectives xla on gloo.

Output: a progress bar (loss, tokens/s, collective share), the held-out loss, what ran
where (each collective of the step with its calls and bytes per device and step, the
library that moved it, and what jax_smddp's engine counted of it:
jax_smddp.tools.step_collectives), the jax_smddp settings that differ from their defaults,
and a final line of JSON. The collective share is the time of a jitted function that runs
only the step's collectives (same library, groups, shapes and count, no model math;
fsdp_step.py, `collectives_only_step`) divided by the measured time of a training step:
the cost of the communication on its own. Inside the real step it can be partly hidden
(XLA's CPU runtime runs a collective concurrently with independent compute) or
lengthened (a collective waits for the slowest rank), so read it as an estimate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time


class _HelpFormatter(argparse.HelpFormatter):
  """Each option's default, once: appended unless its help states it (or what a default
  of 0 means) or there is none worth saying (a flag, an empty value)."""

  def _get_help_string(self, action):
    text = action.help or ""
    d = action.default
    if ("default" in text or (d == 0 and "0:" in text) or not action.option_strings
        or d is None or d is False or d == "" or d == argparse.SUPPRESS):
      return text
    return f"{text} (default: %(default)s)".strip()


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[2].strip(),
                              formatter_class=_HelpFormatter)
  a = p.add_argument_group("parallelism")
  a.add_argument("--mesh", default="8", help="N (FSDP over N devices) or RxS (replica x fsdp)")
  a.add_argument("--collectives", default="smddp", choices=["smddp", "xla"],
                 help="library running all_gather / psum_scatter / psum (--style jit: "
                      "running XLA's cross-process collectives, jax_smddp or gloo)")
  a.add_argument("--style", default="shard_map", choices=["shard_map", "jit"],
                 help="shard_map: explicit per-layer collectives (fsdp_step.py); jit: "
                      "global-view jit, XLA inserts them (fsdp_jit_step.py)")
  a.add_argument("--processes", type=int, default=0,
                 help="run as a jax.distributed job of this many local processes, the "
                      "mesh's devices split evenly between them")
  a.add_argument("--devices", type=int, default=0,
                 help="XLA CPU devices to create (default: as many as the mesh needs, at "
                      "least 8; with --processes, each process creates its share of the "
                      "mesh's, whatever this says)")
  a.add_argument("--platform", default="cpu", help="JAX_PLATFORMS, unless already set")
  a.add_argument("--remat", nargs="?", const="dots", default="none",
                 choices=["none", "dots", "dots_no_batch", "full"],
                 help="jax.checkpoint policy per layer (bare --remat: dots). Any policy but "
                      "none re-gathers each layer's parameters in the backward pass (unless "
                      "--prefetch, which keeps them)")
  a.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False,
                 help="gather layer i+1's parameters while layer i computes (the layer scan "
                      "carries them; jax_smddp.fsdp.scan_layers); --no-prefetch gathers each "
                      "layer just before use. Off by default: on the CPU backend it gains "
                      "little, and loses with big layers (examples/README.md)")
  a.add_argument("--unroll", type=int, default=1,
                 help="layers per iteration of the layer scan (lax.scan's unroll; 0: all)")
  a.add_argument("--offload", action="store_true",
                 help="offload matmul outputs to pinned host memory between forward and "
                      "backward (jax.checkpoint_policies.offload_dot_with_no_batch_dims)")
  m = p.add_argument_group("model")
  m.add_argument("--layers", type=int, default=4, help="transformer blocks")
  m.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
  m.add_argument("--heads", type=int, default=4,
                 help="attention heads (each of width d_model / heads)")
  m.add_argument("--d-ff", type=int, default=0,
                 help="SwiGLU hidden width (default: 8/3 d_model, rounded up to a multiple "
                      "of 32)")
  m.add_argument("--seq", type=int, default=128,
                 help="sequence length, in bytes (the model's tokens)")
  t = p.add_argument_group("training")
  t.add_argument("--steps", type=int, default=600, help="total steps (the schedule's length)")
  t.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
  t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  t.add_argument("--warmup", type=int, default=-1, help="warmup steps (default: 10%% of steps)")
  t.add_argument("--weight-decay", type=float, default=0.1,
                 help="AdamW weight decay, of matrices (not of norm scales)")
  t.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip")
  t.add_argument("--seed", type=int, default=0,
                 help="seed of the initial parameters and of the batches' order")
  t.add_argument("--data-mb", type=float, default=2.0, help="MB of stdlib source to read")
  t.add_argument("--eval-batches", type=int, default=8,
                 help="held-out batches of --batch sequences for the eval loss")
  c = p.add_argument_group("checkpoints and output")
  c.add_argument("--checkpoint-dir", default="", help="save checkpoints here (Orbax)")
  c.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
  c.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  c.add_argument("--stop-at", type=int, default=0,
                 help="stop (and save) after this step, as if preempted; the schedule still "
                      "spans --steps (0: run every step)")
  c.add_argument("--compare-prefetch", type=int, default=0, metavar="N",
                 help="benchmark instead of training: N steps with prefetch and N without, "
                      "in alternating blocks of --compare-block steps in this process; "
                      "prints both step times and their ratio (0: train)")
  c.add_argument("--compare-block", type=int, default=20, help="steps per timed block")
  c.add_argument("--metrics", default="", help="write one JSON line per step to this file")
  c.add_argument("--profile", default="", metavar="DIR",
                 help="record a jax.profiler trace of --profile-steps steps (after 2 warm-up "
                      "steps) into DIR/process_N and print where the collectives ran "
                      "(python -m jax_smddp.tools.trace_summary DIR reads it again)")
  c.add_argument("--profile-steps", type=int, default=3, help="steps traced by --profile")
  c.add_argument("--dump-hlo", default="", metavar="DIR",
                 help="write every program this run compiles, as XLA optimized it, into "
                      "DIR/process_N (XLA's --xla_dump_to, as text: "
                      "*after_optimizations.txt); jax_smddp's collectives show there as "
                      "custom calls smddp_*, XLA's own as all-gather, all-reduce, ...")
  c.add_argument("--no-progress", action="store_true", help="print lines instead of a bar")
  c.add_argument("--log-every", type=int, default=25, help="steps between lines (no bar; 0: none)")
  return p.parse_args(argv)


def set_up_platform(args) -> None:
  """JAX reads JAX_PLATFORMS when it is imported, so this runs before any jax import."""
  os.environ.setdefault("JAX_PLATFORMS", args.platform)
  if args.collectives == "xla" and os.environ.pop("JAX_SMDDP_COLLECTIVES", ""):
    # That variable makes jax_smddp lower jax.lax's collectives too (README, drop-in use).
    print("--collectives xla: ignoring JAX_SMDDP_COLLECTIVES, so that XLA's own collectives run",
          file=sys.stderr)


def set_up_devices(args, job) -> None:
  """XLA reads its flags as JAX creates its first client: this runs before that."""
  from jax_smddp import job as smddp_job
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    mesh_devices = math.prod(int(s) for s in args.mesh.lower().split("x") if s.isdigit())
    count = max(args.devices or 8, mesh_devices) if job is None else mesh_devices
    flags = f"{flags} {smddp_job.cpu_device_flag(count, job)}"
  if args.dump_hlo:
    where = os.path.join(os.path.abspath(args.dump_hlo), f"process_{job.process if job else 0}")
    flags = f"{flags} --xla_dump_to={where} --xla_dump_hlo_as_text"
    # A program found in JAX's persistent compilation cache is not compiled, so not dumped.
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  os.environ["XLA_FLAGS"] = flags.strip()


def launch_processes(args, argv) -> int:
  """Runs this script as `args.processes` local processes of one jax.distributed job, told
  the job in their environment as any launcher would (jax_smddp.job.local_env); process 0
  prints the progress and the result."""
  import socket
  import subprocess
  from jax_smddp import job as smddp_job
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ)
  env.pop("JAX_SMDDP_COLLECTIVES", None)
  if args.style == "jit" and args.collectives == "smddp":
    env["JAX_SMDDP_COLLECTIVES"] = "xla"  # read at start-up: XLA's collectives on jax_smddp
  argv = list(sys.argv[1:] if argv is None else argv)
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                            env={**env, **smddp_job.local_env(args.processes, i,
                                                              f"127.0.0.1:{port}")},
                            stdout=None if i == 0 else subprocess.DEVNULL)
           for i in range(args.processes)]
  codes = [p.wait() for p in procs]
  return next((c for c in codes if c), 0)


class Progress:
  """tqdm when installed and wanted, else a printed line every few steps."""

  def __init__(self, start: int, total: int, plain: bool, every: int):
    self.bar = None
    self.every = every
    if not plain:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, step: int, fields: dict) -> None:
    if self.bar is not None:
      self.bar.set_postfix_str("  ".join(f"{k} {v}" for k, v in fields.items()), refresh=False)
      self.bar.update(1)
    elif self.every and (step % self.every == 0 or step == 1):
      print(f"step {step:5d}  " + "  ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


class Profile:
  """--profile: a jax.profiler trace of a few steps once the first two have warmed the caches,
  and what jax_smddp.tools.trace_summary reads in it (printed by the reporting process)."""

  def __init__(self, args, start: int, stop: int, step_hlo: str, lead: bool, libraries):
    import jax
    self.first = min(start + 2, stop - 1) if args.profile and stop > start else None
    self.last = None if self.first is None else min(self.first + max(args.profile_steps, 1),
                                                     stop) - 1
    self.dir = os.path.join(args.profile, f"process_{jax.process_index()}") if args.profile \
        else ""
    self.lead = lead
    self.tracing = False
    self.summary = None
    self.step_hlo = step_hlo  # tells the step's collectives by instruction, not by name
    self.libraries = libraries  # () -> what ran XLA's collectives, by op (all_gather: ...)

  def before(self, step: int) -> None:
    if step == self.first:
      import jax
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.tracing = True

  def after(self, step: int) -> None:
    """Runs once the step's outputs are ready."""
    if step != self.last:
      return
    import jax
    from jax_smddp.tools import trace_summary
    jax.profiler.stop_trace()
    self.tracing = False
    path = trace_summary.find_trace(self.dir)
    found = trace_summary.summarize(trace_summary.load_events(path), self.step_hlo,
                                    self.libraries())
    self.summary = {"trace": path, "steps": [self.first + 1, self.last + 1], **found}
    if self.lead:
      print(f"trace of steps {self.first + 1}-{self.last + 1}: {path}\n"
            f"{trace_summary.format_summary(found)}", file=sys.stderr)


def time_calls(fn, repeats: int) -> list[float]:
  import jax
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times


def compare_prefetch(args, make_run, data, cfg, plan) -> dict:
  """Steps with and without prefetch, timed in alternating blocks in one process.

  Both variants start from the same parameters and see the same batches (each trains
  its own copy), so their losses must agree; the first block of each is untimed
  (warm-up). Reported per variant: the median over blocks of the mean step time, and
  the median over rounds of the ratio prefetch / no-prefetch of the two blocks of
  that round (robust to the machine's load drifting during the run).
  """
  import jax
  from fsdp_step import collective_ops, loop_collective_ops

  block = max(1, args.compare_block)
  rounds = max(1, math.ceil(args.compare_prefetch / block))
  runs = {"prefetch": make_run(True), "no_prefetch": make_run(False)}
  batches = [jax.block_until_ready(runs["no_prefetch"].shard_batch(
      data.train_batch(s, args.batch, args.seed))) for s in range(block * (rounds + 1))]
  variants = {}
  for name, run in runs.items():
    params, opt_state = run.init_state(args.seed)
    t0 = time.perf_counter()
    compiled = run.train_step.lower(params, opt_state, batches[0]).compile()
    text = compiled.as_text()
    variants[name] = {"fn": compiled, "state": (params, opt_state), "step": 0, "losses": [],
                      "times": [], "compile_s": time.perf_counter() - t0,
                      "ops": collective_ops(text), "loop_ops": loop_collective_ops(text)}

  def run_block(v):
    params, opt_state = v["state"]
    t0 = time.perf_counter()
    for _ in range(block):
      params, opt_state, m = v["fn"](params, opt_state, batches[v["step"]])
      v["losses"].append(m["loss"])
      v["step"] += 1
    jax.block_until_ready((params, opt_state))
    v["state"] = (params, opt_state)
    return (time.perf_counter() - t0) / block

  for v in variants.values():
    run_block(v)                                   # warm-up, untimed
  order = list(variants)
  for r in range(rounds):
    for name in (order if r % 2 == 0 else order[::-1]):
      variants[name]["times"].append(run_block(variants[name]))

  comm = runs["no_prefetch"].collectives_only_step   # the step's collectives alone
  jax.block_until_ready(comm())
  comm_s = statistics.median(time_calls(comm, 10))
  on, off = variants["prefetch"], variants["no_prefetch"]
  losses_on = [float(x) for x in on["losses"]]
  losses_off = [float(x) for x in off["losses"]]
  rel = [abs(a - b) / abs(b) for a, b in zip(losses_on, losses_off)]
  loss_diff, loss_diff_first = max(rel), max(rel[:block])
  ratios = [a / b for a, b in zip(on["times"], off["times"])]
  tokens_per_step = args.batch * cfg.seq_len
  out = {
      "compare_prefetch": {
          name: {"step_time_s": statistics.median(v["times"]),
                 "step_time_min_s": min(v["times"]),
                 "tokens_per_s": tokens_per_step / statistics.median(v["times"]),
                 "block_times_s": v["times"], "compile_s": v["compile_s"],
                 "step_collective_ops": v["ops"], "loop_collective_ops": v["loop_ops"]}
          for name, v in variants.items()},
      "ratio": statistics.median(ratios),          # prefetch / no_prefetch; < 1: faster
      "ratio_min": min(ratios), "ratio_max": max(ratios),
      "steps_each": rounds * block, "block": block,
      "max_loss_rel_diff": loss_diff,               # all steps: rounding differences grow
      "max_loss_rel_diff_first_block": loss_diff_first,
      "collectives_time_s": comm_s,
      "collective_share": comm_s / statistics.median(off["times"]),
      "collectives": args.collectives, "mesh": str(plan), "remat": args.remat,
      "unroll": args.unroll,
      "model": {"layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
                "d_ff": cfg.d_ff, "seq": cfg.seq_len},
      "batch": args.batch, "jax": jax.__version__, "backend": jax.default_backend(),
  }
  print(f"--collectives {args.collectives} --mesh {plan}: {rounds * block} steps each, "
        f"blocks of {block}, alternating", file=sys.stderr)
  for name, v in variants.items():
    print(f"  {name:12s} {statistics.median(v['times']) * 1e3:8.2f} ms/step (median of "
          f"{len(v['times'])} blocks; best {min(v['times']) * 1e3:.2f})", file=sys.stderr)
  print(f"  prefetch / no_prefetch = {out['ratio']:.3f} (median of per-round ratios; "
        f"range {out['ratio_min']:.3f}..{out['ratio_max']:.3f}); losses agree within "
        f"{loss_diff_first:.1e} relative over the first {block} steps ({loss_diff:.1e} over "
        f"all {len(rel)}: float32 rounding, amplified by training); the step's collectives "
        f"alone take "
        f"{comm_s * 1e3:.2f} ms ({out['collective_share']:.1%} of a step without "
        f"prefetch)", file=sys.stderr)
  print(json.dumps(out), flush=True)
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  set_up_platform(args)
  from jax_smddp import job as smddp_job
  job = smddp_job.detect()  # the job a launcher (or --processes) started this process in
  if job is None and args.processes > 1:
    raise SystemExit(launch_processes(args, argv))
  if job is not None and args.processes and args.processes != job.processes:
    raise SystemExit(f"--processes {args.processes}: this process was started by {job.launcher} "
                     f"as one of {job.processes}; drop --processes under a launcher")
  set_up_devices(args, job)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  smddp_job.initialize(job)
  processes = job.processes if job else 1
  lead = job is None or job.lead  # the process that reports
  if not lead:  # no bar and no step lines (0: none, not even step 1's)
    args.no_progress, args.log_every = True, 0
  if args.style == "jit":
    unsupported = [flag for flag, on in (("--prefetch", args.prefetch), ("--offload", args.offload),
                                         ("--remat", args.remat != "none"),
                                         ("--compare-prefetch", args.compare_prefetch),
                                         ("--checkpoint-dir", args.checkpoint_dir)) if on]
    if unsupported:
      raise SystemExit(f"--style jit does not take {', '.join(unsupported)} (shard_map style only)")
    from jax_smddp.swap import xla as xla_swap
    if args.collectives == "smddp" and processes > 1 and not xla_swap.requested() and lead:
      print("--style jit --collectives smddp: JAX_SMDDP_COLLECTIVES=xla is not set, so XLA's "
            "cross-process collectives run on gloo (fsdp_train.py --processes N sets it; under "
            "a launcher, set it for every process, e.g. mpirun -x JAX_SMDDP_COLLECTIVES=xla)",
            file=sys.stderr)
  import fsdp_model as fm
  from fsdp_data import VOCAB, ByteDataset
  from fsdp_mesh import MeshPlan, collectives_module
  from fsdp_step import (FSDP, OFFLOAD_POLICY, collective_ops, make_optimizer,
                         make_schedule)
  from jax_smddp import capabilities as smddp_capabilities, config as smddp_config
  from jax_smddp import distributed as smddp_distributed
  from jax_smddp.tools import step_collectives

  plan = MeshPlan.parse(args.mesh)

  t_start = time.perf_counter()
  d_ff = args.d_ff or 32 * math.ceil(8 * args.d_model / 3 / 32)
  cfg = fm.Config(vocab=VOCAB, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                  d_ff=d_ff, seq_len=args.seq)
  warmup = args.warmup if args.warmup >= 0 else max(1, args.steps // 10)
  if args.batch % plan.num_devices:
    raise SystemExit(f"--batch {args.batch} must be a multiple of the {plan.num_devices} "
                     f"devices of --mesh {plan}")
  data = ByteDataset.from_stdlib(cfg.seq_len, max_bytes=int(args.data_mb * 2**20))
  collectives = collectives_module(args.collectives)

  schedule = make_schedule(args.lr, warmup, args.steps)
  optimizer_for = lambda decay_mask: make_optimizer(schedule, args.weight_decay, decay_mask)
  if args.style == "jit":
    from fsdp_jit_step import JitFSDP
    make_run = lambda prefetch: JitFSDP(cfg, plan, optimizer_for, args.batch, clip_norm=args.clip)
  else:
    make_run = lambda prefetch: FSDP(
        cfg, plan, collectives, optimizer_for,
        args.batch, remat=args.remat, offload=args.offload, clip_norm=args.clip,
        prefetch=prefetch, unroll=args.unroll)
  if args.compare_prefetch:
    return compare_prefetch(args, make_run, data, cfg, plan)
  run = make_run(args.prefetch)
  params, opt_state = run.init_state(args.seed)

  settings = {"model": [cfg.vocab, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff,
                        cfg.seq_len],
              "mesh": str(plan), "batch": args.batch, "steps": args.steps, "lr": args.lr,
              "warmup": warmup, "weight_decay": args.weight_decay, "clip": args.clip,
              "seed": args.seed, "data_bytes": int(args.data_mb * 2**20)}
  ckpt = None
  if args.checkpoint_dir:
    from fsdp_checkpoint import Checkpoints  # Orbax, only when checkpointing
    ckpt = Checkpoints(args.checkpoint_dir)
  start = 0
  if args.resume:
    if ckpt is None:
      raise SystemExit("--resume needs --checkpoint-dir")
    latest = ckpt.latest_step()
    if latest is None:
      print(f"no checkpoint in {ckpt.directory}: starting at step 0", file=sys.stderr)
    else:
      try:
        params, opt_state = ckpt.restore(latest, params, opt_state, settings)
      except ValueError as e:
        raise SystemExit(f"--resume: {e}") from None
      start = latest
      print(f"resumed from {ckpt.directory} at step {start}", file=sys.stderr)

  if args.offload:
    if args.remat != "none":
      print(f"--offload: its policy ({OFFLOAD_POLICY}) replaces --remat {args.remat}",
            file=sys.stderr)
    if jax.default_backend() == "cpu":
      print("--offload: on the CPU backend, JAX lowers moves to host memory as no-ops (CPU "
            "device memory is host memory), so the policy runs but nothing moves: this is "
            "--remat dots_no_batch. On GPU/TPU the saved matmul outputs live in pinned host "
            "memory between the forward and backward passes.", file=sys.stderr)

  # Compile ahead of time, so that every timed step is a real step.
  batch0 = run.shard_batch(data.train_batch(start, args.batch, args.seed))
  t0 = time.perf_counter()
  step_fn = run.train_step.lower(params, opt_state, batch0).compile()
  compile_s = time.perf_counter() - t0
  step_text = step_fn.as_text()
  ops = collective_ops(step_text)
  step_ops = step_collectives.in_hlo(step_text)  # per op: instructions, calls, bytes a step
  xla_collectives = smddp_distributed.xla_collectives()  # what runs XLA's collectives here

  # The step's collectives alone (see collectives_only_step), timed before and after
  # training; the median of all runs is reported.
  comm = run.collectives_only_step
  jax.block_until_ready(comm())
  comm_times = time_calls(comm, 5)
  comm_s = statistics.median(comm_times)

  # One writer: in a multi-process run every process has the same losses.
  metrics_file = open(args.metrics, "a" if args.resume else "w") if args.metrics and lead \
      else None
  stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
  tokens_per_step = args.batch * cfg.seq_len
  progress = Progress(start, stop, args.no_progress, args.log_every)
  step_times, losses = [], []
  # Which library moved each collective's bytes: jax_smddp's count of the calls it ran, by
  # op, over the training steps (nothing else runs collectives meanwhile).
  counted_before = smddp_distributed.traffic_by_op()

  def collectives_report(steps: int) -> dict:
    return step_collectives.report(step_ops, counted_before, smddp_distributed.traffic_by_op(),
                                   steps, jax.local_device_count(), xla_collectives,
                                   # one process counts without a world (CountingWorld)
                                   counting=processes == 1 or smddp_distributed.is_initialized())

  def xla_libraries() -> dict:  # for the trace's reading: XLA's ops by what ran them
    return {op.replace("-", "_"): o["library"] for op, o in collectives_report(1).items()
            if not op.startswith("smddp_")}

  profile = Profile(args, start, stop, step_text, lead, xla_libraries)
  batch = batch0
  for step in range(start, stop):
    profile.before(step)
    t0 = time.perf_counter()
    params, opt_state, m = step_fn(params, opt_state, batch)
    if step + 1 < stop:  # next batch's host work and transfer overlap this step
      batch = run.shard_batch(data.train_batch(step + 1, args.batch, args.seed))
    loss, grad_norm = float(m["loss"]), float(m["grad_norm"])  # waits for the step
    if not profile.tracing:  # traced steps run slower: not timed
      step_times.append(time.perf_counter() - t0)
    profile.after(step)
    losses.append(loss)
    if not math.isfinite(loss):
      raise SystemExit(f"loss is {loss} at step {step + 1}")
    if metrics_file:
      metrics_file.write(json.dumps({"step": step + 1, "loss": loss, "grad_norm": grad_norm,
                                     "lr": float(schedule(step))}) + "\n")
    recent = statistics.mean(step_times[-20:])
    progress.update(step + 1, {"loss": f"{loss:.4f}",
                               "tok/s": f"{tokens_per_step / recent:,.0f}",
                               "coll": f"{min(1.0, comm_s / recent):.0%}"})
    if ckpt and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
      ckpt.save(step + 1, params, opt_state, settings)
  progress.close()
  if metrics_file:
    metrics_file.close()
  if ckpt and stop > start:
    ckpt.save(stop, params, opt_state, settings)
  if ckpt:
    ckpt.close()
  jax.block_until_ready((params, opt_state))  # the last step's collectives are over
  step_collectives_report = collectives_report(stop - start)

  comm_times += time_calls(comm, 5)
  comm_s = statistics.median(comm_times)

  eval_loss = statistics.mean(
      float(run.eval_step(params, run.shard_batch(b)))
      for b in data.eval_batches(args.batch, args.eval_batches))

  step_s = statistics.mean(step_times) if step_times else float("nan")
  summary = {
      "final_loss": losses[-1] if losses else None,
      "eval_loss": eval_loss,
      "eval_bits_per_byte": eval_loss / math.log(2),
      "tokens_per_s": tokens_per_step / step_s if step_times else None,
      "steps": stop,
      "start_step": start,
      "collectives": args.collectives,
      "style": args.style,
      "processes": processes,
      "launcher": job.launcher if job else None,
      "mesh": str(plan),
      "devices": plan.num_devices,
      "step_time_s": step_s,
      "collectives_time_s": comm_s,
      "collective_share": comm_s / step_s if step_times else None,
      "gathers_per_layer": run.gathers_per_layer,
      "step_collective_ops": ops,
      "step_collectives": step_collectives_report,  # per op, device and step: library, bytes
      "xla_collectives": xla_collectives,
      "jax_smddp_settings": smddp_config.non_default(),
      "prefetch": args.prefetch,
      "unroll": args.unroll,
      "remat": run.policy_name,
      "offload": args.offload,
      "params": run.num_params,
      "param_bytes_per_device": run.layout.bytes_per_rank(),
      "model": {"layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
                "d_ff": cfg.d_ff, "seq": cfg.seq_len, "vocab": cfg.vocab},
      "batch": args.batch,
      "tokens_per_step": tokens_per_step,
      "compile_s": compile_s,
      "wall_s": time.perf_counter() - t_start,
      "jax": jax.__version__,
      "jax_smddp": smddp_capabilities.version(),
      "backend": jax.default_backend(),
  }
  if profile.summary is not None:
    summary["profile"] = profile.summary
  if not lead:
    return summary
  print(f"eval loss {eval_loss:.4f} ({summary['eval_bits_per_byte']:.3f} bits/byte) on "
        f"{args.eval_batches * args.batch} held-out sequences", file=sys.stderr)
  if step_times:
    traced = stop - start - len(step_times)
    print(f"{stop - start} steps{f' ({traced} traced, not timed)' if traced else ''}, "
          f"{step_s * 1e3:.1f} ms per step, "
          f"{summary['tokens_per_s']:,.0f} tokens/s; the step's collectives take "
          f"{comm_s * 1e3:.1f} ms when run alone: {summary['collective_share']:.1%} of a step",
          file=sys.stderr)
  print(step_collectives.format_report(step_collectives_report), file=sys.stderr)
  print(smddp_config.format_non_default(), file=sys.stderr)
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  main()
