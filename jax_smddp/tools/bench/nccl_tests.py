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

# Our op names -> nccl-tests' collective and binary.
NAMES = {"all_gather": ("AllGather", "all_gather_perf"),
         "reduce_scatter": ("ReduceScatter", "reduce_scatter_perf"),
         "all_reduce": ("AllReduce", "all_reduce_perf"),
         "all_to_all": ("AlltoAll", "alltoall_perf")}
# nccl-tests' type names (test_typenames) for numpy's.
TYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
         "int64": "int64", "uint64": "uint64", "float16": "half", "float32": "float",
         "float64": "double", "bfloat16": "bfloat16"}
REDOPS = {"all_gather": "none", "reduce_scatter": "sum", "all_reduce": "sum", "all_to_all": "none"}
ROOT = -1  # none of these ops has a root


def bus_factor(op: str, n: int) -> float:
  """busbw / algbw for `op` over n ranks (0 for one rank: nothing crosses a bus, as
  nccl-tests prints)."""
  if n < 1:
    raise ValueError(f"{n} ranks: a collective needs at least 1")
  if op == "all_reduce":
    return 2 * (n - 1) / n
  if op in ("all_gather", "reduce_scatter", "all_to_all"):
    return (n - 1) / n
  raise ValueError(f"unknown op {op!r}; choose from {', '.join(NAMES)}")


def input_bytes(op: str, size: int, n: int) -> int:
  """One rank's input bytes for a row of size S."""
  return size // n if op == "all_gather" else size


def size_of(op: str, input_bytes_per_rank: int, n: int) -> int:
  """S of a call whose ranks each have `input_bytes_per_rank` of input."""
  return n * input_bytes_per_rank if op == "all_gather" else input_bytes_per_rank


def coll_counts(op: str, nbytes: int, n: int, itemsize: int) -> tuple[int, int, int]:
  """nccl-tests' GetCollByteCount for a -b/-e/-f/-i size of `nbytes`: (sendcount, recvcount,
  paramcount) in elements, from count = nbytes // itemsize. AllReduce takes count as given;
  AllGather, ReduceScatter and AlltoAll split it into n blocks of `base` elements, base =
  count // n rounded down to whole 16 bytes (src/all_gather.cu, reduce_scatter.cu,
  alltoall.cu since December 2024; from 2022 to then base was rounded to 4 elements, the same
  for 4-byte types)."""
  total = nbytes // itemsize
  if op == "all_reduce":
    return total, total, total
  if op not in NAMES:
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(NAMES)}")
  base = (total // n) & ~(max(1, 16 // itemsize) - 1)
  return {"all_gather": (base, n * base, base), "reduce_scatter": (n * base, base, base),
          "all_to_all": (n * base, n * base, base)}[op]


def count(op: str, size: int, n: int, itemsize: int) -> int:
  """nccl-tests' count column for a row of size S (B) of `itemsize`-byte elements."""
  elements = size // itemsize
  return elements if op == "all_reduce" else elements // n


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
          "redop": REDOPS[op], "root": ROOT}


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
_OP_OF_NAME = {name.lower(): op for op, (name, _) in NAMES.items()}


class LogError(ValueError):
  """A file that is not nccl-tests output as expected (what is wrong, what to give instead)."""


def _number(text: str):
  if text == "N/A":
    return None
  try:
    return float(text)
  except ValueError:
    return math.nan


def _op_of(text: str, path: str | None) -> str | None:
  """The collective a log is of: its "Collective test starting" line or command line (the
  binary's name), else its file name."""
  for pattern in (r"Collective test starting:\s*(\w+)", r"\b(\w+_perf)\b"):
    m = re.search(pattern, text)
    if m and m.group(1) in _OP_OF_BINARY:
      return _OP_OF_BINARY[m.group(1)]
  if path:
    base = os.path.basename(path).lower()
    for binary, op in _OP_OF_BINARY.items():
      if base.startswith(binary) or base.startswith(op):
        return op
  return None


def parse_log(text: str, path: str | None = None, op: str | None = None) -> dict:
  """nccl-tests' output as {"op", "ranks", "rows": [{size, count, type, redop, root, time,
  algbw, busbw, #wrong, in_place: {time, algbw, busbw, #wrong}}]} (None for N/A; ranks from
  its "#  Rank" lines, None if it has none). `op` overrides what the log says it is."""
  op = op or _op_of(text, path)
  if op not in NAMES:
    raise LogError(f"{path or 'the log'}: cannot tell which collective it measured (no "
                   "'Collective test starting: <op>_perf' line, command line or file name "
                   f"naming one); give it as OP:PATH with OP one of {', '.join(NAMES)}")
  columns = None
  ranks = 0
  rows = []
  for number, line in enumerate(text.splitlines(), 1):
    fields = line.split()
    if not fields:
      continue
    if fields[0] == "#":
      if len(fields) > 2 and fields[1] == "size" and fields[2] == "count":
        columns = fields[1:]
      elif len(fields) > 2 and fields[1] == "Rank":
        ranks += 1
      continue
    if fields[0].startswith("#") or not fields[0].isdigit():
      continue  # nccl-tests' other messages ("Avg bus bandwidth", warnings, ...)
    if columns is None:
      raise LogError(f"{path or 'the log'}, line {number}: a row before the column header "
                     "('#  size  count  type ...'): is this nccl-tests output, complete?")
    names = [c for c in columns if c not in ("size", "count", "type")]
    values = fields[3:]
    if "redop" in names and not math.isnan(_number(values[names.index("redop")]) or 0):
      names.remove("redop")  # old AlltoAll logs: a redop header over an empty name
    # The header names 'redop'/'root' where the rows have them; a time column follows.
    if len(values) < len(names):
      raise LogError(f"{path or 'the log'}, line {number}: {len(fields)} fields where the header "
                     f"names {len(columns)}: {line.strip()!r}")
    got = dict(zip(names, values))
    head = {"size": int(fields[0]), "count": int(fields[1]), "type": fields[2],
            "redop": got.get("redop", REDOPS[op]), "root": int(got.get("root", ROOT))}
    # Two groups of time, algbw, busbw and #wrong (or error): out of place, then in place.
    rest = [v for c, v in zip(names, values) if c not in ("redop", "root")]
    quad = lambda vals: {"time": _number(vals[0]), "algbw": _number(vals[1]),
                         "busbw": _number(vals[2]), "#wrong": _number(vals[3])}
    entry = {**head, **quad(rest[0:4])}
    entry["in_place"] = quad(rest[4:8]) if len(rest) >= 8 else None
    rows.append(entry)
  if not rows:
    raise LogError(f"{path or 'the log'}: no result rows (nccl-tests prints one per size after "
                   "its '#  size  count  type ...' header)")
  return {"op": op, "ranks": ranks or None, "rows": rows, "path": path}


def read_log(spec: str) -> dict:
  """A --nccl-tests argument: PATH, or OP:PATH naming the collective."""
  op, path = None, spec
  head, sep, tail = spec.partition(":")
  if sep and head in NAMES:
    op, path = head, tail
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError as e:
    raise LogError(f"cannot read the nccl-tests log {path}: {e}") from None
  return parse_log(text, path, op)


def compare(rows: list[dict], logs: list[dict]) -> list[dict]:
  """Our rows (with op, size, time, busbw) matched to nccl-tests' rows by op and size S:
  busbw_vs_nccl_tests = our busbw / theirs (above 1: ours moves more), time_vs_nccl_tests =
  our time / theirs (below 1: ours is faster). Sets those fields on our rows too; returns the
  matched pairs."""
  theirs = {}
  for log in logs:
    for t in log["rows"]:
      theirs.setdefault((log["op"], t["size"]), (log, t))
  out = []
  for r in rows:
    hit = theirs.get((r["op"], r["size"]))
    if hit is None:
      continue
    log, t = hit
    busbw = r["busbw"] / t["busbw"] if t.get("busbw") else None
    time = r["time"] / t["time"] if t.get("time") else None
    r.update({"nccl_tests_time": t["time"], "nccl_tests_busbw": t["busbw"],
              "busbw_vs_nccl_tests": busbw, "time_vs_nccl_tests": time})
    out.append({"op": r["op"], "size": r["size"], "ranks": r.get("ranks"),
                "nccl_tests_ranks": log["ranks"], "nccl_tests_log": log["path"],
                "time": r["time"], "busbw": r["busbw"], "nccl_tests_time": t["time"],
                "nccl_tests_busbw": t["busbw"], "busbw_vs_nccl_tests": busbw,
                "time_vs_nccl_tests": time})
  return out


def comparison_table(op: str, pairs: list[dict]) -> str:
  """Per size of `op`: nccl-tests' time and busbw beside ours, and the ratios."""
  mine = [p for p in pairs if p["op"] == op]
  if not mine:
    return ""
  ranks = {p["nccl_tests_ranks"] for p in mine} - {None}
  lines = [f"# {op} vs nccl-tests ({mine[0]['nccl_tests_log']}"
           + (f", {', '.join(map(str, sorted(ranks)))} ranks" if ranks else "")
           + "): busbw ratio = ours / theirs (above 1: ours moves more), time ratio = ours / "
           "theirs (below 1: ours is faster)",
           f"{'size':>12}  {'nccl time':>10}  {'nccl busbw':>10}  {'our time':>10}  "
           f"{'our busbw':>10}  {'busbw ratio':>11}  {'time ratio':>10}"]
  ratio = lambda v: "-" if v is None else f"{v:.2f}"
  for p in mine:
    lines.append(f"{p['size']:>12}  {_time(p['nccl_tests_time']):>10}  "
                 f"{_bw(p['nccl_tests_busbw']):>10}  {_time(p['time']):>10}  "
                 f"{_bw(p['busbw']):>10}  {ratio(p['busbw_vs_nccl_tests']):>11}  "
                 f"{ratio(p['time_vs_nccl_tests']):>10}")
  if any(p["ranks"] and p["nccl_tests_ranks"] and p["ranks"] != p["nccl_tests_ranks"]
         for p in mine):
    lines.append("# note: the log ran a different number of ranks; busbw compares across rank "
                 "counts, time does not")
  return "\n".join(lines)
