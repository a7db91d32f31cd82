"""What a jax.profiler trace says about the collectives: which ran, on which library, and, on a
GPU, on which streams and how much of their time compute ran beside them.

    python -m jax_smddp.tools.trace_summary DIR_OR_FILE [--hlo FILE] [--json]

DIR_OR_FILE: a file ``perfetto_trace.json.gz``, or a directory under which
``jax.profiler.trace(DIR, create_perfetto_trace=True)`` wrote one (the newest is read);
``examples/fsdp_train.py --profile DIR`` writes such traces and passes its step's HLO.

What is counted:
  * A collective is an event of a collective instruction of the traced programs' HLO (--hlo:
    jax_smddp's custom calls, XLA's all-gather, ...), jax_smddp's when it is its custom call.
    Without the HLO, an event whose name or op names one (``smddp_all_gather``,
    ``all-gather``, ``ncclDevKernel_AllGather...``), jax_smddp's when "smddp" appears in them;
    names can mislead (see ``classify``). XLA's collectives are labelled ``xla``, or by the
    library that ran them where the caller says (``summarize(..., xla_libraries=...)``:
    ``xla (via jax_smddp)``, ``xla (gloo)``; the example finds it with
    :mod:`jax_smddp.tools.step_collectives`).
  * On a GPU (a trace process named ``/device:GPU:N``) every ``Stream #N`` line is a stream;
    a collective's time is that of its kernels and copies. ``overlap_s`` is the time during
    which a collective and other work of the same GPU ran at once (the union of the
    collectives' intervals intersected with that of everything else), so a collective on its
    own stream beside compute shows overlap, and collectives on the compute stream show none.
    This reading of a GPU trace follows how XLA's profiler names its lines; it has not yet
    been checked against a trace recorded on a GPU.
  * On the CPU (no device process) the events are XLA's thunks, grouped by their
    ``device_ordinal``. A jax_smddp handler returns before its collective completes, so the
    time of a CPU collective here is its handler's, not the collective's; no overlap is
    computed.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys

from jax_smddp import _collectives, capabilities

TRACE_NAME = "perfetto_trace.json.gz"

# Canonical op for each spelling: HLO (all-gather), jax_smddp's targets (smddp_all_gather)
# and NCCL's kernels (ncclDevKernel_AllGather_RING_LL); a permutation is also XLA's send/recv.
_OTHER_SPELLINGS = {"collective_permute": r"|send[-_]?recv"}
_OP_RE = [(op, re.compile(op.replace("_", "[-_]?") + _OTHER_SPELLINGS.get(op, ""), re.IGNORECASE))
          for op in _collectives.NAMES]
_OP_KEYS = ("hlo_op", "tf_op", "kernel_annotation", "annotation")
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$", re.MULTILINE)
_DEVICE_RE = re.compile(r"/device:(GPU|TPU):(\d+)")


def find_trace(path: str) -> str:
  """The trace file itself, or the newest perfetto trace under a directory."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "**", TRACE_NAME), recursive=True)
  if not found:
    raise FileNotFoundError(
        f"no {TRACE_NAME} under {path}: record with jax.profiler.trace(DIR, "
        f"create_perfetto_trace=True), or examples/fsdp_train.py --profile DIR")
  return max(found, key=os.path.getmtime)


def load_events(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _canonical(text: str) -> str | None:
  return next((op for op, pattern in _OP_RE if pattern.search(text)), None)


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str] | None]:
  """Instruction name -> (library, op) for each collective of compiled HLO modules' text
  (``compiled.as_text()``), None for every other instruction: jax_smddp's custom calls by
  their target, XLA's collectives by their opcode (async -start/-done halves included)."""
  found = {}
  for m in _INSTRUCTION_RE.finditer(hlo_text):
    name, opcode, rest = m.group(1), m.group(2), m.group(3)
    kind = None
    if opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', rest)
      if target and "smddp" in target.group(1):
        kind = ("jax_smddp", _canonical(target.group(1)) or "kernel")
    elif op := _canonical(opcode):
      kind = ("xla", op)
    found[name] = kind
  return found


def classify(event: dict, hlo: dict | None = None) -> tuple[str, str] | None:
  """(library, op) when the event is a collective's, else None.

  With `hlo` (hlo_instructions of the modules that ran), an event naming one of their
  instructions is what that instruction is. Otherwise the event's name and the arguments
  naming its op are read (not others: an instruction's text names its operands too). A name
  alone can mislead, since XLA names an instruction after the JAX op that made it: the
  partition-id that jax_smddp's all_gather reads is called "smddp_all_gather.6", and psum's
  all-reduce "psum_invariant.7"."""
  args = event.get("args") or {}
  instruction = args.get("hlo_op", event.get("name"))
  if hlo is not None and instruction in hlo:
    return hlo[instruction]
  text = " ".join([event.get("name", "")] + [str(args[k]) for k in _OP_KEYS if k in args])
  ours = "smddp" in text.lower()
  op = _canonical(text)
  if op:
    return ("jax_smddp" if ours else "xla"), op
  # jax_smddp's own kernels (smddp::cuda::...) where no annotation names the op.
  return ("jax_smddp", "kernel") if ours else None


def merge(intervals) -> list[tuple[float, float]]:
  """The union of [start, end) intervals, as sorted disjoint intervals."""
  out: list[list[float]] = []
  for start, end in sorted(intervals):
    if end <= start:
      continue
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(s, e) for s, e in out]


def length(merged) -> float:
  return sum(e - s for s, e in merged)


def intersection(a, b) -> float:
  """Length of the intersection of two merged interval lists."""
  total, i, j = 0.0, 0, 0
  while i < len(a) and j < len(b):
    lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if hi > lo:
      total += hi - lo
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def _metadata(events, kind: str) -> list[tuple[dict, str]]:
  """(event, name) of each metadata event of this kind (process_name, thread_name)."""
  return [(e, (e.get("args") or {}).get("name", "")) for e in events
          if e.get("ph") == "M" and e.get("name") == kind]


def summarize(events: list[dict], hlo_text: str | None = None,
              xla_libraries: dict[str, str] | None = None) -> dict:
  """Per device: each collective's count and time (µs in the trace, seconds here); on
  devices with streams, each stream's time and the collectives' overlap with other work.
  `hlo_text`: the compiled text of the programs traced, to tell collectives by their
  instructions rather than by their names (see classify). `xla_libraries`: what ran XLA's
  collectives, by op (all_gather: "xla (via jax_smddp)", ...; what
  jax_smddp.tools.step_collectives found), in place of the plain "xla"."""
  hlo = hlo_instructions(hlo_text) if hlo_text else None
  xla_libraries = xla_libraries or {}
  threads = {(e.get("pid"), e.get("tid")): name for e, name in _metadata(events, "thread_name")}
  device_pids = {e.get("pid"): f"{m.group(1).lower()}:{m.group(2)}"
                 for e, name in _metadata(events, "process_name")
                 if (m := _DEVICE_RE.search(name))}
  devices: dict[str, dict] = {}
  spans: dict[str, dict[str, list]] = {}
  for e in events:
    if e.get("ph") != "X" or "dur" not in e or e.get("name", "").startswith("end: "):
      continue
    args = e.get("args") or {}
    if device_pids:  # a GPU trace: device lines only, and of those only the streams
      device = device_pids.get(e.get("pid"))
      stream = threads.get((e.get("pid"), e.get("tid")), "")
      if device is None or not stream.startswith("Stream"):
        continue
    else:  # a CPU trace: XLA's thunks name their device
      if "device_ordinal" not in args or "hlo_op" not in args:
        continue
      device, stream = f"cpu:{args['device_ordinal']}", None
    d = devices.setdefault(device, {"collectives": {}, "streams": {}})
    seconds = float(e["dur"]) * 1e-6
    kind = classify(e, hlo)
    if kind and kind[0] == "xla":
      kind = (xla_libraries.get(kind[1], "xla"), kind[1])
    if kind:
      c = d["collectives"].setdefault(f"{kind[0]}:{kind[1]}", {"count": 0, "time_s": 0.0})
      c["count"] += 1
      c["time_s"] += seconds
    if stream is not None:
      s = d["streams"].setdefault(stream, {"collective_s": 0.0, "other_s": 0.0,
                                           "collectives": 0})
      s["collective_s" if kind else "other_s"] += seconds
      s["collectives"] += bool(kind)
      spans.setdefault(device, {"collective": [], "other": []})[
          "collective" if kind else "other"].append(
              (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  for device, sp in spans.items():
    coll, other = merge(sp["collective"]), merge(sp["other"])
    d = devices[device]
    d["collective_s"] = length(coll) * 1e-6
    d["other_s"] = length(other) * 1e-6
    d["overlap_s"] = intersection(coll, other) * 1e-6
    d["overlap_fraction"] = d["overlap_s"] / d["collective_s"] if d["collective_s"] else None
  for d in devices.values():
    if not d["streams"]:
      del d["streams"]
  return {"kind": "device" if device_pids else "cpu",
          "devices": dict(sorted(devices.items()))}


def format_summary(summary: dict) -> str:
  lines = []
  if not summary["devices"]:
    return "no device events in this trace (was anything run while it recorded?)"
  for device, d in summary["devices"].items():
    lines.append(f"{device}:")
    for name, c in sorted(d["collectives"].items()):
      lines.append(f"  {name:40s} x{c['count']:<5d} {c['time_s'] * 1e3:10.3f} ms")
    if not d["collectives"]:
      lines.append("  no collectives")
    for stream, s in sorted(d.get("streams", {}).items()):
      lines.append(f"  {stream:40s} collectives {s['collective_s'] * 1e3:9.3f} ms "
                   f"(x{s['collectives']}), other {s['other_s'] * 1e3:9.3f} ms")
    if d.get("collective_s"):
      lines.append(f"  collectives ran {d['collective_s'] * 1e3:.3f} ms, of which "
                   f"{d['overlap_s'] * 1e3:.3f} ms ({d['overlap_fraction']:.0%}) beside other "
                   f"work of the device")
  if summary["kind"] == "cpu":
    lines.append("(CPU: times are XLA's thunks; a jax_smddp handler returns before its "
                 "collective completes)")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("trace", help=f"a {TRACE_NAME} or a directory holding one")
  p.add_argument("--hlo", default="", metavar="FILE",
                 help="the compiled text of the traced programs (compiled.as_text()): "
                      "collectives are then told by their instructions, not their names")
  p.add_argument("--json", action="store_true", help="print the summary as JSON")
  args = p.parse_args(argv)
  try:
    path = find_trace(args.trace)
  except FileNotFoundError as e:
    print(f"trace_summary: {e}", file=sys.stderr)
    return 2
  hlo_text = None
  if args.hlo:
    with open(args.hlo) as f:
      hlo_text = f.read()
  summary = summarize(load_events(path), hlo_text)
  summary["trace"] = path
  summary["jax_smddp"] = capabilities.version()
  print(json.dumps(summary) if args.json else f"{path}\n{format_summary(summary)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
