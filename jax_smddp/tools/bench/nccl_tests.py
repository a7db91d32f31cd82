"""nccl-tests' conventions, shared by the CPU benchmark (:mod:`jax_smddp.tools.bench`) and the GPU
benchmark (:mod:`jax_smddp.tools.gpu_bench`): what a row's size, count, algbw and busbw are, its
table, and a reader of nccl-tests' own output (``all_gather_perf -b 8 -e 128M -f 2 -g 1``).

As nccl-tests defines them (doc/PERFORMANCE.md; src/common.cu and each op's source), for n ranks:

==============  ===================================  ================================  ===========
op              S, the row's size (B)                count (elements)                  busbw/algbw
==============  ===================================  ================================  ===========
all_gather      the whole output: n x per-rank input per-rank input (sendcount)        (n-1)/n
reduce_scatter  the whole input: n x per-rank output per-rank output (recvcount)       (n-1)/n
all_reduce      the buffer                           the buffer                        2(n-1)/n
all_to_all      the buffer of one rank               one rank's block to one peer (S/n) (n-1)/n
==============  ===================================  ================================  ===========

algbw = S / time (GB/s, 1e9 bytes); busbw = algbw x the factor. nccl-tests prints, after size,
count, type, redop and root, the out-of-place time (us), algbw, busbw and #wrong (elements that
differ from the expected answer), then the same four in place. Older releases printed no redop
and root for AllGather (and no root for AlltoAll), and an "error" column (the largest difference,
e.g. 0e+00) instead of #wrong; :func:`parse_log` reads all of these.
"""

from __future__ import annotations

import csv
import math
import os
import re

from jax_smddp import _collectives

# Our op names -> nccl-tests' collective and binary.
NAMES = {"all_gather": ("AllGather", "all_gather_perf"),
         "reduce_scatter": ("ReduceScatter", "reduce_scatter_perf"),
         "all_reduce": ("AllReduce", "all_reduce_perf"),
         "all_to_all": ("AlltoAll", "alltoall_perf")}
# nccl-tests' type names (test_typenames) for numpy's.
TYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
         "int64": "int64", "uint64": "uint64", "float16": "half", "float32": "float",
         "float64": "double", "bfloat16": "bfloat16"}
ROOT = -1  # none of these ops has a root


def _known(op: str) -> None:
  if op not in NAMES:
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(NAMES)}")


def redop(op: str) -> str:
  """nccl-tests' redop column: sum for a reduction, none otherwise."""
  return "sum" if _collectives.reduces(op) else "none"


def bus_factor(op: str, n: int) -> float:
  """busbw / algbw for `op` over n ranks (0 for one rank: nothing crosses a bus, as
  nccl-tests prints)."""
  if n < 1:
    raise ValueError(f"{n} ranks: a collective needs at least 1")
  _known(op)
  return _collectives.bus_factor(op, n)


def input_bytes(op: str, size: int, n: int) -> int:
  """One rank's input bytes for a row of size S (the larger of a rank's input and output:
  a gather's output)."""
  return _collectives.input_bytes(op, size, n) if _collectives.spec(op).out_power > 0 else size


def size_of(op: str, input_bytes_per_rank: int, n: int) -> int:
  """S of a call whose ranks each have `input_bytes_per_rank` of input."""
  return _collectives.largest_bytes(op, input_bytes_per_rank, n)


def coll_counts(op: str, nbytes: int, n: int, itemsize: int) -> tuple[int, int, int]:
  """nccl-tests' GetCollByteCount for a -b/-e/-f/-i size of `nbytes`: (sendcount, recvcount,
  paramcount) in elements, from count = nbytes // itemsize. AllReduce takes count as given;
  AllGather, ReduceScatter and AlltoAll split it into n blocks of `base` elements, base =
  count // n rounded down to whole 16 bytes (src/all_gather.cu, reduce_scatter.cu,
  alltoall.cu since December 2024; from 2022 to then base was rounded to 4 elements, the same
  for 4-byte types)."""
  total = nbytes // itemsize
  _known(op)
  if _collectives.spec(op).plan_size == "elements":  # the count is the whole buffer
    return total, total, total
  base = (total // n) & ~(max(1, 16 // itemsize) - 1)  # a block
  send = base * n ** -_collectives.spec(op).block_power
  return send, _collectives.output_bytes(op, send, n), base


def count(op: str, size: int, n: int, itemsize: int) -> int:
  """nccl-tests' count column for a row of size S (B) of `itemsize`-byte elements."""
  elements = size // itemsize
  return elements if _collectives.spec(op).plan_size == "elements" else elements // n


def round_size(op: str, size: int, n: int, itemsize: int) -> int:
  """The size S nccl-tests prints for a -b/-e/-f/-i size: max(sendcount, recvcount) x
  itemsize (src/common.cu, TimeTest); 0 where a rank's block rounds to nothing, as nccl-tests
  prints then too."""
  send, recv, _ = coll_counts(op, size, n, itemsize)
  return max(send, recv) * itemsize


def sweep(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 1 << 20) -> list[int]:
  """nccl-tests' -b/-e/-f/-i sizes (src/common.cu, TimeTest): min_bytes, then x factor (factor
  above 1) or + step (factor 1 or less, nccl-tests' default; step 1M as its -i) while <=
  max_bytes."""
  if factor <= 1 and step < 1:
    raise ValueError("a step (-i) of at least 1 byte is needed when -f is 1")
  sizes, size = [], max(1, min_bytes)
  while size <= max_bytes:
    sizes.append(size)
    size = size * factor if factor > 1 else size + step
  return sizes


def row_sizes(op: str, sizes: list[int], n: int, itemsize: int) -> list[int]:
  """The sizes S of nccl-tests' rows for the sweep `sizes`: one per size, in order, a size
  repeated where rounding makes two equal (nccl-tests prints and times each)."""
  return [round_size(op, s, n, itemsize) for s in sizes]


def figures(op: str, size: int, n: int, seconds: float) -> dict:
  """time (us), algbw and busbw (GB/s) of a call of size S that took `seconds`."""
  algbw = size / seconds / 1e9
  return {"time": seconds * 1e6, "algbw": algbw, "busbw": algbw * bus_factor(op, n)}


def type_name(dtype) -> str:
  name = getattr(dtype, "name", str(dtype))
  return TYPES.get(name, name)


def row_head(op: str, size: int, n: int, dtype, itemsize: int) -> dict:
  """A row's size, count, type, redop and root, named as nccl-tests names them."""
  return {"size": size, "count": count(op, size, n, itemsize), "type": type_name(dtype),
          "redop": redop(op), "root": ROOT}


# --------------------------------------------------------------------------- the table

def _time(us) -> str:
  if us is None:
    return "N/A"
  return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _bw(v) -> str:
  # nccl-tests prints %6.2f; CPU rates below 1 GB/s keep a third digit so that they still read.
  return "N/A" if v is None else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def _wrong(v) -> str:
  return "N/A" if v is None else f"{v:g}"


_HEAD = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
         ("root", "", 6))
_QUAD = (("time", "(us)", 8), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7), ("#wrong", "", 6))


def header(groups: list[str], extra: list[tuple[str, str, int]] = ()) -> str:
  """nccl-tests' three header lines: the group titles over the time/algbw/busbw/#wrong column
  groups (out-of-place, in-place, then ours: a baseline), then `extra` columns."""
  lead = sum(w + 2 for _, _, w in _HEAD) - 2
  span = sum(w + 2 for _, _, w in _QUAD)
  top = "#" + " " * (lead - 1) + "".join(f"{g:^{span}}" for g in groups)
  names = "  ".join(f"{c:>{w}}" for c, _, w in _HEAD)
  units = "  ".join(f"{u:>{w}}" for _, u, w in _HEAD)
  for _ in groups:
    names += "".join(f"  {c:>{w}}" for c, _, w in _QUAD)
    units += "".join(f"  {u:>{w}}" for _, u, w in _QUAD)
  names += "".join(f"  {c:>{w}}" for c, _, w in extra)
  units += "".join(f"  {u:>{w}}" for _, u, w in extra)
  return "\n".join((top, "#" + names[1:], "#" + units[1:]))


def row(head: dict, quads: list[dict | None], extra: list[tuple[str, int]] = ()) -> str:
  """One row: size, count, type, redop, root, then each group's time/algbw/busbw/#wrong (None or
  a missing figure: N/A), then `extra` cells (text, width)."""
  cells = [str(head[c]) for c, _, _ in _HEAD]
  line = "  ".join(f"{v:>{w}}" for v, (_, _, w) in zip(cells, _HEAD))
  for q in quads:
    q = q or {}
    vals = (_time(q.get("time")), _bw(q.get("algbw")), _bw(q.get("busbw")), _wrong(q.get("#wrong")))
    line += "".join(f"  {v:>{w}}" for v, (_, _, w) in zip(vals, _QUAD))
  return line + "".join(f"  {v:>{w}}" for v, w in extra)


# --------------------------------------------------------------------------- CSV

CSV_COLUMNS = ("op", "ranks", "processes", "size", "count", "type", "redop", "root", "time",
               "algbw", "busbw", "#wrong", "in_place_time", "in_place_algbw", "in_place_busbw",
               "in_place_#wrong", "baseline", "baseline_time", "baseline_algbw",
               "baseline_busbw", "baseline_#wrong", "speedup", "bytes_per_rank", "min_time",
               "nccl_tests_time", "nccl_tests_busbw", "busbw_vs_nccl_tests",
               "time_vs_nccl_tests")


def write_csv(path: str, rows: list[dict]) -> None:
  """One line per op and size with every column of CSV_COLUMNS (empty: not measured)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: ("" if r.get(k) is None else r[k]) for k in CSV_COLUMNS})


# --------------------------------------------------------------------------- nccl-tests' logs

_OP_OF_BINARY = {binary: op for op, (_, binary) in NAMES.items()}
# Every nccl-tests binary (src/*.cu), so that a log of one we do not compare is named as such.
# "all_reduce_perf_mpi" and the like: packaged builds add a suffix.
_BINARY = re.compile(r"\b(all_gather|all_reduce|alltoallv?|broadcast|reduce_scatter|reduce|gather|"
                     r"scatter|sendrecv|hypercube)_perf\w*")
_STARTING = re.compile(r"#\s*Collective test starting:\s*(\S+)")
# Lines that open a run: nccl-tests 2.17+ prints its version and the binary, every release the
# "# nThread ..." line (nccl-tests' src/common.cu, src/util.cu).
_MARKERS = (("version", re.compile(r"#\s*nccl-tests version\b")), ("starting", _STARTING),
            ("nthread", re.compile(r"#\s*nThread\s+\d")))
# Launchers' per-line prefixes, and the task each names: Open MPI's --tag-output
# ("[1,0]<stdout>:", Open MPI 5 adds a space; tag-detailed "[1,0][host:pid]<stdout>: ",
# tag-fullname "[prterun-host-1@1,0]<stdout>: "), its --timestamp-output (a date, bracketed in
# Open MPI 5), srun --label ("0: ", padded to the widest task number: " 0: "), MPICH's and Intel
# MPI's -l ("[0] "), and an ISO time stamp (kubectl logs --timestamps, ts).
_OMPI = re.compile(r"(?:\[?[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\]?)?"
                   r"((?:\[[^\]\s]*\])*)<std(?:out|err|diag)>: ?")
_OMPI_TASK = re.compile(r"\[(?:[^\]@]*@)?\d+,(\d+)\]")
_SRUN = re.compile(r"\s*(\d+): ")
_MPICH = re.compile(r"\[(\d+)\] ")
_STAMP = re.compile(r"\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?:? ")


class LogError(ValueError):
  """A file that is not nccl-tests output as expected (what is wrong, what to give instead)."""


def _number(text: str):
  if text == "N/A":
    return None
  try:
    return float(text)
  except ValueError:
    return math.nan


def _op_of_binary(name: str) -> str:
  """Our op for an nccl-tests binary's name, or the binary's collective when we have no such op."""
  base = _BINARY.match(name)
  collective = base.group(1) if base else name
  return _OP_OF_BINARY.get(collective + "_perf", collective)


def _op_of_path(path: str | None) -> str | None:
  """The collective a file name names (all_gather_perf.log, allreduce-2.7.8.txt, ...), or None."""
  base = re.sub(r"[^a-z]", "", os.path.basename(path or "").lower())
  ops = {op for op in NAMES if op.replace("_", "") in base}
  return ops.pop() if len(ops) == 1 else None


def _strip(line: str) -> tuple[int | None, str]:
  """(the launcher's task number or None, the line without its launcher's prefixes)."""
  task = None
  for _ in range(4):  # a time stamp and a tag, in either order
    m = _OMPI.match(line)
    if m:
      t = _OMPI_TASK.search(m.group(1))
      task = int(t.group(1)) if t and task is None else task
    else:
      m = _SRUN.match(line) or _MPICH.match(line)
      if m:
        task = int(m.group(1)) if task is None else task
      else:
        m = _STAMP.match(line)
    if not m:
      break
    line = line[m.end():]
  return task, line


def _streams(text: str) -> list[list[tuple[int, str]]]:
  """The log's lines as each task of a launcher printed them ((line number, text) each, without
  prefixes), the lowest task first; an unprefixed log is one stream."""
  streams: dict = {}
  for number, line in enumerate(text.splitlines(), 1):
    task, line = _strip(line)
    streams.setdefault(task, []).append((number, line))
  return [streams[k] for k in sorted(streams, key=lambda t: (t is None, t or 0))]


def _row(fields: list[str], columns: list[str]) -> dict | None:
  """One result row read by its header's column names, or None if it is not one."""
  try:
    size, count_ = int(fields[0]), int(fields[1])
  except (ValueError, IndexError):
    return None
  values = fields[3:]
  # The names before the first time column (redop, root where printed), then a group per time
  # column: time (or cputime), algbw, busbw, #wrong (or error) and, with -I, i_min .. i_cv%.
  head, groups = [], []
  for c in columns[3:]:
    if c in ("time", "cputime"):
      groups.append([])
    (groups[-1] if groups else head).append(c)
  got = {}
  for name in head:
    if name == "redop" and values and not math.isnan(_number(values[0]) or 0):
      continue  # old AlltoAll logs: a redop header over an empty name
    if values:
      got[name] = values.pop(0)
  quads = []
  for group in groups:
    if len(values) < 4:
      break
    q = dict(zip(group, values))
    values = values[len(group):]
    quads.append({"time": _number(q.get("time", q.get("cputime"))), "algbw": _number(q["algbw"]),
                  "busbw": _number(q["busbw"]),
                  "#wrong": _number(q.get("#wrong", q.get("error", "N/A")))})
  try:
    root = int(got.get("root", ROOT))
  except ValueError:
    return None  # what is left of a row cut short
  if not quads or quads[0]["time"] is None or math.isnan(quads[0]["time"]):
    return None
  return {"size": size, "count": count_, "type": fields[2], "redop": got.get("redop"),
          "root": root, **quads[0], "in_place": quads[1] if len(quads) > 1 else None}


_VALUE = re.compile(r"N/A|-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def _values(fields: list[str], start: bool) -> list[str]:
  """A row's line, or a piece of one, up to where another line's text was glued on: at a row's
  start size, count and type and a redop's name, then numbers and N/A; a value with text glued
  to it is kept."""
  out = []
  for i, f in enumerate(fields):
    word = re.match(r"[A-Za-z]\w*$", f) if start and i in (2, 3) else None
    m = word if start and i == 2 else word or _VALUE.match(f)
    if not m:
      break
    out.append(m.group(0))
    if m.end() < len(f):
      break
  return out


def _take(run: dict, fields: list[str]) -> None:
  """A row's line, or a piece of one: what NCCL prints while nccl-tests times a row (with
  NCCL_DEBUG=INFO) lands after the row's head and after each group, on the row's line (NVIDIA/nccl
  issue 1453's log); the pieces are joined until the row has every group its header names."""
  start = len(fields) > 2 and fields[0].isdigit() and fields[1].isdigit() and fields[2][:1].isalpha()
  values = _values(fields, start)
  if start:
    _flush(run)
    run["piece"] = values
  elif run["piece"] is not None and len(values) >= 4:  # a group: time, algbw, busbw, #wrong
    run["piece"] += values
  else:
    return
  row = _row(run["piece"], run["columns"])
  groups = sum(c in ("time", "cputime") for c in run["columns"])
  if row is not None and 1 + (row["in_place"] is not None) >= groups:
    _flush(run)


def _flush(run: dict) -> None:
  """The row whose pieces were being joined, as far as it got (a copy of one a run already has,
  in a run of interleaved copies, is dropped)."""
  row = _row(run["piece"], run["columns"]) if run["piece"] else None
  run["piece"] = None
  key = row and (row["size"], row["type"], row["redop"], row["root"])
  if row and not (run["copies"] and key in {(r["size"], r["type"], r["redop"], r["root"])
                                            for r in run["rows"]}):
    run["rows"].append(row)


def _runs(stream: list[tuple[int, str]]) -> tuple[list[dict], int | None]:
  """One stream's runs of an nccl-tests binary: {"op" (as the run names it, or None), "ranks"
  (the distinct ranks of its "#  Rank N ..." lines), "rows", "line"}; and the line number of a
  row printed before any column header (None if none)."""
  runs, run, pending, orphan = [], None, None, None

  def start(number):
    nonlocal run, pending
    # A run's start printed again before its rows: processes' copies of one run, their lines
    # interleaved; each row then comes once per process, and the first is kept.
    copies = bool(run and not run["rows"] and run["columns"] is None)
    if run:
      _flush(run)
    if run and run["rows"]:
      runs.append(run)
    elif copies and pending is None:
      pending = run["op"]
    run = {"op": pending, "ranks": set(), "rows": [], "line": number, "end": number,
           "after": runs[-1]["end"] if runs else 0, "columns": None, "markers": set(),
           "copies": copies, "piece": None}
    pending = None

  for number, line in stream:
    fields = line.split()
    if not fields:
      continue
    if run:
      run["end"] = number
    if fields[0].startswith("#"):
      marker = next((k for k, pattern in _MARKERS if pattern.match(line)), None)
      header = len(fields) > 2 and fields[1] == "size" and fields[2] == "count"
      if marker and (run is None or run["columns"] or marker in run["markers"]):
        start(number)
      elif header and (run is None or run["rows"]):
        start(number)
      if marker:
        run["markers"].add(marker)
      if header:
        run["columns"] = fields[1:]
      elif len(fields) > 2 and fields[1] == "Rank" and fields[2].isdigit():
        if run is None:
          start(number)
        run["ranks"].add(int(fields[2]))
      m = _STARTING.match(line)
      if m:
        run["op"] = _op_of_binary(m.group(1))
      continue
    named = [m.group(0) for m in _BINARY.finditer(line)]
    if named:  # a command line: the run it starts, or the next one
      if run is None or run["rows"]:
        pending = _op_of_binary(named[-1])
      elif run["op"] is None:
        run["op"] = _op_of_binary(named[-1])
      continue
    if not _VALUE.match(fields[0]):
      continue  # nccl-tests' other messages, NCCL's, the launcher's
    if run is None or run["columns"] is None:
      if len(fields) > 2 and fields[1].isdigit() and orphan is None:
        orphan = number
      continue
    _take(run, fields)
  if run:
    _flush(run)
  if run and run["rows"]:
    runs.append(run)
  return runs, orphan


def parse_logs(text: str, path: str | None = None, op: str | None = None) -> list[dict]:
  """nccl-tests' output as its tables, one per collective and rank count: [{"op", "ranks",
  "rows": [{size, count, type, redop, root, time, algbw, busbw, #wrong, in_place: {time, algbw,
  busbw, #wrong}}], "path", "line" (where its first run starts), "runs" (how many runs it
  merges), "label"}] (None for N/A; ranks from the "#  Rank N" lines, each rank once, None if
  none). Launchers' prefixes (mpirun --tag-output, srun --label, ...) are read; several binaries
  run one after another each give a table; the same run printed by several processes (a launch
  without MPI) gives one. `op` names the collective of runs that do not name theirs."""
  where = path or "the log"
  runs, orphan = [], None
  for stream in _streams(text):
    got, first = _runs(stream)
    runs += got
    orphan = orphan or first
  if not runs:
    if orphan:
      raise LogError(f"{where}, line {orphan}: a row before the column header ('#  size  count  "
                     "type ...'): is this nccl-tests output, complete?")
    raise LogError(f"{where}: no result rows (nccl-tests prints one per size after its '#  size  "
                   "count  type ...' header)")
  from_name = _op_of_path(path)
  # Binaries named anywhere, by line: the command typed before a launcher's tagged lines is not
  # in the stream of the task that printed the run (those after the stream's run before).
  named = [(number, _op_of_binary(m.group(0))) for number, line in
           enumerate(text.splitlines(), 1) for m in _BINARY.finditer(line)]
  says = {run["op"] for run in runs}
  if op and None not in says and op not in says:
    raise LogError(f"{where}: nccl-tests says it ran {', '.join(sorted(says))}, not {op}: give the "
                   "log as PATH (OP:PATH names the collective of runs a log does not name)")
  tables: dict = {}
  for run in runs:  # the lowest task's first: its copy of a run is the one kept
    before = [o for number, o in named if run["after"] < number < run["line"]]
    name = run["op"] or op or (before[-1] if before else from_name)
    if name is None:
      raise LogError(f"{where}, line {run['line']}: cannot tell which collective it measured (no "
                     "'Collective test starting: <op>_perf' line, command line or file name "
                     f"naming one); give it as OP:PATH with OP one of {', '.join(NAMES)}")
    ranks = len(run["ranks"]) or None
    table = tables.setdefault((name, ranks), {"op": name, "ranks": ranks, "rows": [],
                                              "path": path, "line": run["line"], "runs": 0})
    seen = {(r["size"], r["type"], r["redop"], r["root"]) for r in table["rows"]}
    for r in run["rows"]:  # a copy of a run another process printed adds nothing
      r = {**r, "redop": r["redop"] or (redop(name) if name in NAMES else "none")}
      if (r["size"], r["type"], r["redop"], r["root"]) not in seen:
        table["rows"].append(r)
    table["runs"] += 1
  ours = [t for t in tables.values() if t["op"] in NAMES]
  if not ours:
    others = sorted({t["op"] for t in tables.values()})
    raise LogError(f"{where}: nccl-tests' {', '.join(o + '_perf' for o in others)} output; "
                   f"the benchmarks compare {', '.join(NAMES)} only")
  for t in ours:
    t["label"] = (f"{where}" + (f", line {t['line']}" if len(ours) > 1 else "")
                  + (f", {t['ranks']} rank{'s' * (t['ranks'] != 1)}" if t["ranks"] else ""))
  return ours


def parse_log(text: str, path: str | None = None, op: str | None = None) -> dict:
  """The one table of a log of one collective (:func:`parse_logs`; LogError if it holds more)."""
  tables = parse_logs(text, path, op)
  if len(tables) > 1:
    raise LogError(f"{path or 'the log'}: holds {len(tables)} tables (" + ", ".join(
        t["label"] for t in tables) + "); read it with parse_logs")
  return tables[0]


def read_logs(spec: str) -> list[dict]:
  """A --nccl-tests argument, PATH or OP:PATH naming the collective, as its tables
  (:func:`parse_logs`)."""
  op, path = None, spec
  head, sep, tail = spec.partition(":")
  if sep and head in NAMES:
    op, path = head, tail
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError as e:
    raise LogError(f"cannot read the nccl-tests log {path}: {e}") from None
  return parse_logs(text, path, op)


def read_log(spec: str) -> dict:
  """The one table of a --nccl-tests argument (:func:`read_logs`)."""
  tables = read_logs(spec)
  if len(tables) > 1:
    raise LogError(f"{spec}: holds {len(tables)} tables; read it with read_logs")
  return tables[0]


def compare(rows: list[dict], logs: list[dict]) -> list[dict]:
  """Our rows (with op, size, time, busbw) matched to each nccl-tests table's rows by op and size
  S (of our type where the table has several): busbw_vs_nccl_tests = our busbw / theirs (above
  1: ours moves more), time_vs_nccl_tests = our time / theirs (below 1: ours is faster). Sets
  those fields on our rows too, from the first table that has the size; returns the matched
  pairs, one per our row and table."""
  out = []
  for r in rows:
    first = True
    for log in logs:
      same = [t for t in log["rows"] if t["size"] == r["size"]] if log["op"] == r["op"] else []
      if not same:
        continue
      t = next((t for t in same if t["type"] == r.get("type")), same[0])
      busbw = r["busbw"] / t["busbw"] if t.get("busbw") else None
      time = r["time"] / t["time"] if t.get("time") else None
      if first:
        r.update({"nccl_tests_time": t["time"], "nccl_tests_busbw": t["busbw"],
                  "busbw_vs_nccl_tests": busbw, "time_vs_nccl_tests": time})
        first = False
      out.append({"op": r["op"], "size": r["size"], "ranks": r.get("ranks"),
                  "nccl_tests_ranks": log["ranks"], "nccl_tests_log": log["path"],
                  "nccl_tests_table": log.get("label") or log["path"],
                  "time": r["time"], "busbw": r["busbw"], "nccl_tests_time": t["time"],
                  "nccl_tests_busbw": t["busbw"], "busbw_vs_nccl_tests": busbw,
                  "time_vs_nccl_tests": time})
  return out


def comparison_table(op: str, pairs: list[dict]) -> str:
  """Per nccl-tests table of `op` (its log, where in it, its ranks), per size: its time and
  busbw beside ours, and the ratios."""
  blocks = {}
  for p in pairs:
    if p["op"] == op:
      blocks.setdefault(p.get("nccl_tests_table") or p["nccl_tests_log"], []).append(p)
  ratio = lambda v: "-" if v is None else f"{v:.2f}"
  out = []
  for label, mine in blocks.items():
    lines = [f"# {op} vs nccl-tests ({label}): busbw ratio = ours / theirs (above 1: ours moves "
             "more), time ratio = ours / theirs (below 1: ours is faster)",
             f"{'size':>12}  {'nccl time':>10}  {'nccl busbw':>10}  {'our time':>10}  "
             f"{'our busbw':>10}  {'busbw ratio':>11}  {'time ratio':>10}"]
    for p in mine:
      lines.append(f"{p['size']:>12}  {_time(p['nccl_tests_time']):>10}  "
                   f"{_bw(p['nccl_tests_busbw']):>10}  {_time(p['time']):>10}  "
                   f"{_bw(p['busbw']):>10}  {ratio(p['busbw_vs_nccl_tests']):>11}  "
                   f"{ratio(p['time_vs_nccl_tests']):>10}")
    if any(p["ranks"] and p["nccl_tests_ranks"] and p["ranks"] != p["nccl_tests_ranks"]
           for p in mine):
      lines.append("# note: the log ran a different number of ranks; busbw compares across rank "
                   "counts, time does not")
    out.append("\n".join(lines))
  return "\n\n".join(out)
