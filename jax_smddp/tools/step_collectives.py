"""Which collectives a compiled program holds, what each moves per run, and which library
moved it: what a training run's summary says about its collectives (examples/fsdp_train.py).

    ops = step_collectives.in_hlo(compiled.as_text())   # per op: instructions, calls, bytes
    before = jax_smddp.distributed.traffic_by_op()
    ... run the program `runs` times ...
    report = step_collectives.report(ops, before, jax_smddp.distributed.traffic_by_op(), runs)
    print(step_collectives.format_report(report))

Each op is named as the compiled program names it: jax_smddp's custom calls by their target
(``smddp_all_gather``, ...), XLA's collectives by their opcode (``all-gather``,
``reduce-scatter``, ``all-reduce``, ``all-to-all``, ``collective-permute``, ...). Per op and
device, for one run of the program:

* ``instructions``: how many the compiled text holds (an instruction inside a loop counts once);
* ``calls``, ``bytes``: how many times they execute and the bytes of their outputs, loops
  counted by their trip counts (XLA's ``known_trip_count``; a loop without one counts once,
  and ``loops_known`` says so);
* ``library``: ``jax_smddp`` for its custom calls; for XLA's, ``xla (via jax_smddp)`` when
  jax_smddp's engine counted calls of that op during the runs (the XLA-level swap,
  JAX_SMDDP_COLLECTIVES=xla), else ``xla (NAME)``, NAME the library that runs XLA's
  collectives in this process (:func:`jax_smddp.distributed.xla_collectives`: gloo, mpi,
  in-process, nccl);
* ``jax_smddp_calls``, ``jax_smddp_bytes``: what jax_smddp's engine counted for that op
  (:func:`jax_smddp.distributed.traffic_by_op`, per device: the process's count over its
  devices; a one-process job counts too), None where told it counts nothing. For jax_smddp's
  custom calls and XLA's all-gather, reduce-scatter and all-reduce the bytes equal ``bytes`` when every
  call went through jax_smddp (XLA's calls may be more: it makes one MPI call per operand
  of an instruction that reduces several arrays at once); XLA's all-to-all and
  collective-permute reach it as point-to-point messages (a call per block from another
  device, the bytes received from other devices), so their counts differ from the
  program's and their bytes are at most the outputs'.
"""

from __future__ import annotations

import collections
import re

from jax_smddp.tools.sizes import format_bytes

# XLA's collective opcodes (async forms: OP-start, OP-done).
XLA_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
           "collective-permute", "collective-broadcast", "send", "recv")
_XLA_OP_RE = re.compile(r"^(%s)(-start|-done)?$" % "|".join(re.escape(o) for o in XLA_OPS))
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_CALLED_RE = re.compile(r"\b(to_apply|calls|body|condition|true_computation|false_computation)"
                        r"=%?([\w.\-]+)")
_CALLED_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')


def element_bytes(dtype: str) -> int:
  """Bytes of one element of an HLO element type (f32: 4, bf16: 2, pred: 1, ...)."""
  if dtype in ("pred", "f8") or dtype.startswith("f8"):
    return 1
  if dtype == "bf16":
    return 2
  if dtype in ("c64", "c128"):
    return int(dtype[1:]) // 8
  return max(int(dtype[1:]) // 8, 1)


def shape_bytes(shape: str) -> int:
  """Bytes of the arrays an HLO shape names (a tuple's summed)."""
  total = 0
  for dtype, dims in _ARRAY_RE.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * element_bytes(dtype)
  return total


def _parse(hlo_text: str):
  """Per computation: its instructions (name, shape, opcode, rest); the entry's name."""
  comps, entry, name = {}, None, None
  for line in hlo_text.splitlines():
    if name is None:
      head = _HEADER_RE.match(line)
      if head and not line.startswith(" "):
        name = head.group(2)
        comps[name] = []
        if head.group(1):
          entry = name
      continue
    if line.startswith("}"):
      name = None
      continue
    m = _INSTRUCTION_RE.match(line)
    if m:
      comps[name].append(m.groups())
  return comps, entry


def _runs_per_execution(comps: dict, entry: str) -> tuple[dict, bool]:
  """How many times each computation runs per execution of the entry (while bodies by
  their known trip counts); and whether every loop's trip count was known."""
  edges = collections.defaultdict(list)  # caller -> [(callee, times per caller run)]
  known = True
  for caller, instructions in comps.items():
    for _, _, opcode, rest in instructions:
      trips = 1
      if opcode == "while":
        m = _TRIP_RE.search(rest)
        known &= m is not None
        trips = int(m.group(1)) if m else 1
      for role, callee in _CALLED_RE.findall(rest):
        edges[caller].append((callee, trips if role == "body" else
                              trips + 1 if role == "condition" else 1))
      for group in _CALLED_LIST_RE.findall(rest):
        edges[caller] += [(c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip()]
  order, seen = [], set()

  def visit(c):  # post-order: callees before callers
    if c in seen:
      return
    seen.add(c)
    for callee, _ in edges.get(c, ()):
      visit(callee)
    order.append(c)

  visit(entry)
  runs = collections.Counter({entry: 1})
  for caller in reversed(order):  # callers before callees
    for callee, times in edges.get(caller, ()):
      runs[callee] += runs[caller] * times
  return runs, known


def op_of(opcode: str, rest: str) -> tuple[str, str] | None:
  """(op, phase) of a collective instruction, else None: op as the program names it
  (XLA's opcode, or jax_smddp's custom-call target), phase "" (synchronous), "-start" or
  "-done"."""
  if opcode == "custom-call":
    target = _TARGET_RE.search(rest)
    return (target.group(1), "") if target and target.group(1).startswith("smddp_") else None
  m = _XLA_OP_RE.match(opcode)
  return (m.group(1), m.group(2) or "") if m else None


def in_hlo(hlo_text: str) -> dict[str, dict]:
  """Per collective op of a compiled module's text (``compiled.as_text()``), for one
  execution on one device: {"instructions", "calls", "bytes", "loops_known"} (see the
  module's doc). Async pairs count once: calls at -start, bytes at -done."""
  comps, entry = _parse(hlo_text)
  if entry is None:
    return {}
  runs, known = _runs_per_execution(comps, entry)
  out: dict[str, dict] = {}
  for comp, instructions in comps.items():
    times = runs.get(comp, 0)
    for _, shape, opcode, rest in instructions:
      found = op_of(opcode, rest)
      if not found:
        continue
      op, phase = found
      o = out.setdefault(op, {"instructions": 0, "calls": 0, "bytes": 0, "loops_known": known})
      if phase != "-done":
        o["instructions"] += 1
        o["calls"] += times
      if phase != "-start":
        o["bytes"] += times * shape_bytes(shape)
  return dict(sorted(out.items()))


def library(op: str, counted: bool, xla_collectives: str) -> str:
  """The library that ran `op` (as the program names it): `counted`, whether jax_smddp's
  engine counted calls of it; `xla_collectives`, what runs XLA's collectives here
  (jax_smddp.distributed.xla_collectives())."""
  if op.startswith("smddp_"):
    return "jax_smddp"
  if counted:
    return "xla (via jax_smddp)"
  if xla_collectives == "jax_smddp":  # the swap is on, yet this op never reached it
    return "xla (not counted by jax_smddp)"
  return f"xla ({xla_collectives})"


def report(ops: dict, before: dict, after: dict, runs: int, devices: int,
           xla_collectives: str, counting: bool) -> dict[str, dict]:
  """Per op of `ops` (in_hlo of the program), for one run and one device: the program's
  figures, the library that ran it and what jax_smddp counted of it between the
  traffic_by_op() readings `before` and `after`, over `runs` runs on this process's
  `devices` devices. `counting`: whether jax_smddp counts here (on CPU it does, in one
  process or several); otherwise its figures are None."""
  out = {}
  for op, o in ops.items():
    b, a = before.get(op, {}), after.get(op, {})
    calls = a.get("calls", 0) - b.get("calls", 0)
    moved = a.get("bytes", 0) - b.get("bytes", 0)
    per = max(runs, 1) * max(devices, 1)
    out[op] = {"library": library(op, calls > 0, xla_collectives), **o,
               "jax_smddp_calls": calls / per if counting else None,
               "jax_smddp_bytes": moved / per if counting else None}
  return out


def format_report(rep: dict, what: str = "step") -> str:
  """The report as a table, one line per op."""
  if not rep:
    return f"no collectives in the {what}"
  lines = [f"collectives per device and {what}: calls and output bytes from the compiled "
           f"{what}; jax_smddp: what its engine counted",
           f"  {'op':22s} {'instr':>5s} {'calls':>6s} {'bytes':>11s}  {'library':31s} "
           f"{'jax_smddp calls':>15s} {'bytes':>11s}"]
  for op, o in rep.items():
    n = o["jax_smddp_calls"]
    calls = "-" if n is None else f"{n:.0f}" if abs(n - round(n)) < 1e-9 else f"{n:.2f}"
    lines.append(f"  {op:22s} {o['instructions']:5d} {o['calls']:6d} "
                 f"{format_bytes(o['bytes']):>11s}  {o['library']:31s} {calls:>15s} "
                 f"{format_bytes(o['jax_smddp_bytes']):>11s}")
  if not all(o["loops_known"] for o in rep.values()):
    lines.append("  (a loop without a known trip count is counted once)")
  return "\n".join(lines)

