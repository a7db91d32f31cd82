"""The benchmark's output: the nccl-tests-style table, the JSON file and the
busbw plot."""

from __future__ import annotations

import json
import os

from jax_smddp.tools.bench import nccl_tests
from jax_smddp.tools.bench.core import BASELINES, PHASES, baseline_short, format_size
from jax_smddp.tools.bench.interval import P90_MARK, spread, undecided

_COLUMNS = ("size", "smddp us", "p90", "algbw", "busbw", "lax us", "p90", "busbw", "speedup",
            "90% range")
_WIDTHS = (8, 11, 10, 8, 8, 11, 10, 8, 8, 10)
_RATIO = ("vs 1p", 7)


_MODEL = (("model us", 10), ("model/meas", 10), ("algorithm", 13))
_MPI = (("mpi4jax us", 11), ("vs mpi", 7))
_MEMCPY = (("memcpy us", 10), ("vs memcpy", 9))
_LINK = (("link us", 10), ("vs link", 8), ("lax vs link", 13))


def table_header(op: str, n: int, ratio: bool = False, lax_note: str = "",
                 model: bool = False, mpi: bool = False, memcpy: bool = False,
                 link: bool = False, baseline: str = "lax", statistic: str | None = None) -> str:
  """The table's four header lines (the title, the p90 mark's legend, the groups and the
  columns); `statistic`: what a multi-process row's time is."""
  short = baseline_short(baseline)
  if baseline != "lax":
    lax_note = ""
  title = (f"# {op}: {n} ranks; size = input bytes per rank; "
           f"time = {statistic or 'the median per call'} (us); bw in GB/s")
  legend = (f"# p90: the calls' 90th percentile (us; over the processes as the time); ! = p90 "
            f"above {P90_MARK:g}x the median (the calls spread: other load, or more busy threads "
            "than cores)")
  span = lambda cols: sum(_WIDTHS[i] + 2 for i in cols) - 2
  groups = (f"{'':{_WIDTHS[0]}}  {' jax_smddp ':-^{span((1, 2, 3, 4))}}  "
            f"{f' {BASELINES[baseline]}{lax_note} ':-^{span((5, 6, 7))}}")
  columns = tuple(f"{short} us" if c == "lax us" else c for c in _COLUMNS)
  cols = "  ".join(f"{c:>{w}}" for c, w in zip(columns, _WIDTHS))
  if mpi:
    cols += "".join(f"  {c:>{w}}" for c, w in _MPI)
  if memcpy:
    cols += "".join(f"  {c:>{w}}" for c, w in _MEMCPY)
  if link:
    cols += "".join(f"  {c.replace('lax', short):>{w}}" for c, w in _LINK)
  if ratio:
    cols += f"  {_RATIO[0]:>{_RATIO[1]}}"
  if model:
    cols += "".join(f"  {c:>{w}}" for c, w in _MODEL)
  return "\n".join((title, legend, groups, cols))


def nccl_table(op: str, results: list[dict], baseline: str = "lax", lax_note: str = "",
               statistic: str | None = None) -> str:
  """`op`'s rows (core.nccl_row's fields) in nccl-tests' columns: size, count, type, redop,
  root, jax_smddp's out-of-place time, algbw, busbw, #wrong, the in-place group (N/A: not run),
  the baseline's four, and speedup = baseline time / jax_smddp time. `statistic`: what a
  multi-process row's time is (cli.statistic), said in the title."""
  rows = [r for r in results if r["op"] == op]
  if not rows:
    return ""
  r0 = rows[0]
  name = BASELINES[baseline] + (lax_note if baseline == "lax" else "")
  lines = [f"# {op} ({nccl_tests.NAMES[op][0]}), nccl-tests' columns: {r0['ranks']} ranks in "
           f"{r0['processes']} process{'es' if r0['processes'] > 1 else ''}; size = S as "
           "nccl-tests counts it (bytes), count in elements; in-place N/A: not run (see --help)"
           + (f"; time = {statistic} (us)" if statistic else ""),
           nccl_tests.header(["out-of-place", "in-place", name], [("speedup", "", 7)])]
  for r in rows:
    ours = {"time": r["time"], "algbw": r["algbw"], "busbw": r["busbw"], "#wrong": r["#wrong"]}
    base = {"time": r["baseline_time"], "algbw": r["baseline_algbw"],
            "busbw": r["baseline_busbw"], "#wrong": r["baseline_#wrong"]}
    speedup = _ratio(r["speedup"]) + ("" if r.get("engine", True) else "*")
    lines.append(nccl_tests.row(r, [ours, None, base], [(speedup, 7)]))
  return "\n".join(lines)


def _ratio(v: float | None, digits: int = 2) -> str:
  """A figure, or N/A where it was not measured (a 0-byte row's baseline)."""
  return "N/A" if v is None else f"{v:.{digits}f}"


def _range(iv: list[float] | None) -> str:
  return f"{iv[0]:.2f}-{iv[1]:.2f}" if iv else "-"


def _p90(entry: dict) -> str:
  """An implementation's p90 cell: marked ! where it exceeds P90_MARK x the median."""
  p = entry.get("p90_us")
  return "- " if p is None else f"{p:.1f}" + ("!" if spread(entry) else " ")


def table_row(r: dict) -> str:
  s, l = r["smddp"], r["lax"]
  cells = (format_size(r["bytes_per_rank"]), f"{s['time_us']:.1f}", _p90(s),
           f"{s['algbw_gbs']:.3f}", f"{s['busbw_gbs']:.3f}", _ratio(l["time_us"], 1), _p90(l),
           _ratio(l["busbw_gbs"], 3), _ratio(r["speedup"]) + ("" if r["engine"] else "*"),
           _range(r.get("speedup_interval")))
  row = "  ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS))
  if "mpi4jax" in r:
    cells = (f"{r['mpi4jax']['time_us']:.1f}", f"{r['vs_mpi4jax']:.2f}")
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MPI))
  if "memcpy_us" in r:
    cells = (f"{r['memcpy_us']:.1f}", f"{r['smddp']['vs_memcpy']:.2f}")
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MEMCPY))
  if "link_us" in r:
    # b: faster than the link, but no faster than a full token bucket allows (link_floor_us).
    marks = ["b" if v["vs_link"] and v["vs_link"] > 1.0
             and v["time_us"] >= r.get("link_floor_us", r["link_us"]) else "" for v in (s, l)]
    cells = (f"{r['link_us']:.1f}", f"{s['vs_link']:.2f}{marks[0]}",
             f"{_ratio(l['vs_link'])}{marks[1]}")
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _LINK))
  if "vs_in_process" in r:
    ratio = r["vs_in_process"]
    row += f"  {'-' if ratio is None else f'{ratio:.2f}':>{_RATIO[1]}}"
  pred = r.get("prediction")
  if pred:
    cells = (f"{pred['time_us']:.1f}", f"{pred['time_us'] / r['smddp']['time_us']:.2f}",
             pred["algorithm"])
    row += "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, _MODEL))
  if r.get("lax_wrong"):  # only jax.lax's can be: a wrong jax_smddp answer stops the run
    row += "  (jax.lax answer wrong vs numpy)"
  return row


def speedup_verdict(op: str, results: list[dict]) -> str:
  """One line under `op`'s table: its rows counted by where their speedup's 90 % range lies
  (interval.py): wholly above 1.0, wholly below it, or containing it."""
  rows = [r for r in results if r["op"] == op and r.get("speedup_interval")]
  faster = sum(r["speedup_interval"][0] > 1.0 for r in rows)
  undecided_rows = sum(undecided(r) for r in rows)
  return (f"# 90% range of the speedup (bootstrap over the calls): above 1.0 in {faster} of "
          f"{len(rows)} sizes, below 1.0 in {len(rows) - faster - undecided_rows}, containing "
          f"1.0 in {undecided_rows} (those calls cannot tell the two apart)")


def arrival_table(op: str, results: list[dict], cores: int | None = None,
                  baseline: str = "lax") -> str:
  """Multi-process layouts: `op`'s calls timed from the last process's start to the last
  process's end (core.after_arrival), how far apart the processes started, and the CPU time
  the processes used per call beside the machine's `cores`."""
  lines = [f"# {op}: each call from the last process's start to the last one's end (median us: "
           "the wait for a late peer left out), and skew = how far apart the processes started "
           "(median us; left by the previous call, either library's, and the scheduler); cpu = "
           "the CPU time all processes used per call (median us, every thread, the kernel's work "
           f"included; {cores or '?'} cores here: near cores x us, a call ran the machine flat "
           "out, and which library wins is the scheduler's as much as theirs)",
           "    size     smddp us       lax us   speedup   90% range   smddp skew     lax skew"
           "    smddp cpu      lax cpu".replace("  lax", f"{baseline_short(baseline):>5}")]
  for r in results:
    aa = r.get("after_arrival")
    if r["op"] != op or not aa:
      continue
    cpu = [f"{aa[i]['cpu_us']:.0f}" if "cpu_us" in aa[i] else "-" for i in ("smddp", "lax")]
    cells = (format_size(r["bytes_per_rank"]), f"{aa['smddp']['time_us']:.1f}",
             f"{aa['lax']['time_us']:.1f}", f"{r['after_arrival_speedup']:.2f}",
             _range(r.get("after_arrival_interval")), f"{aa['smddp']['skew_us']:.1f}",
             f"{aa['lax']['skew_us']:.1f}", *cpu)
    widths = (8, 12, 12, 9, 11, 12, 12, 12, 12)
    lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
  return "\n".join(lines)


def phases_table(op: str, results: list[dict]) -> str:
  """Where jax_smddp's calls of `op` spent their time (jax_smddp.distributed.call_phases(),
  means over the timed calls), beside the mean time per call seen from Python;
  "outside" is the rest: XLA's dispatch of the program and the hand-backs around the call."""
  lines = [f"# {op}: where a jax_smddp call's time went, us per call (process 0; local + queue + "
           "agree + body = the call; wait: of agree and body, waiting for links; sleep: of wait, "
           "asleep; inline: the share of calls run on XLA's thread, no hand-off)",
           "    size   mean us     local     queue     agree      body      wait     sleep  sleeps"
           "   outside  inline"]
  for r in results:
    ph = r.get("smddp_phases")
    if r["op"] != op or not ph:
      continue
    inside = sum(ph[f"{k}_us"] for k in PHASES[:4])  # local, queue, agree, body: the call
    mean = r["smddp"]["mean_us"]
    cells = [format_size(r["bytes_per_rank"]), f"{mean:.1f}"]
    cells += [f"{ph[f'{k}_us']:.1f}" for k in PHASES]
    cells += [f"{ph['sleeps']:.1f}", f"{mean - inside:.1f}", f"{ph.get('inline', 0):.2f}"]
    widths = (8, 9, 9, 9, 9, 9, 9, 9, 7, 9, 6)
    lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
  return "\n".join(lines)


def write_json(path: str, meta: dict, results: list[dict]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
    f.write("\n")


def write_plot(path: str, meta: dict, results: list[dict]) -> None:
  """busbw vs size, one subplot per op, both implementations (needs matplotlib)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ops = list(dict.fromkeys(r["op"] for r in results))
  fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
  for ax, op in zip(axes[0], ops):
    rows = [r for r in results if r["op"] == op]
    sizes = [r["bytes_per_rank"] for r in rows]
    for impl, style in (("smddp", "o-"), ("lax", "s--")):
      ax.plot(sizes, [r[impl]["busbw_gbs"] or float("nan") for r in rows], style,
              label="jax_smddp" if impl == "smddp" else BASELINES[meta.get("baseline", "lax")])
    if any(r.get("prediction") for r in rows):  # busbw scales as 1 / time
      pred = [(r["bytes_per_rank"], r["smddp"]["busbw_gbs"] * r["smddp"]["time_us"] /
               r["prediction"]["time_us"]) for r in rows if r.get("prediction")]
      ax.plot(*zip(*pred), "x:", color="tab:blue", label="jax_smddp, model")
    if any(r.get("vs_in_process") for r in rows):  # busbw scales as 1 / time
      ref = [(r["bytes_per_rank"], r["smddp"]["busbw_gbs"] * r["vs_in_process"])
             for r in rows if r.get("vs_in_process")]
      ax.plot(*zip(*ref), "^:", label="jax_smddp, 1 process")
    ax.axhline(meta["memcpy_gbs"], color="gray", lw=0.8, ls=":", label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=60, fontsize=7)
    ax.set_title(op)
    ax.set_xlabel("input bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  layout = meta["layout"]
  where = (f"layout {layout['spec']} ({layout['processes']} processes, "
           f"jax.lax across processes: gloo), " if layout.get("processes", 1) > 1 else "")
  if meta.get("baseline", "lax") != "lax":
    where = where.replace("jax.lax across processes: gloo", "against itself")
  fig.suptitle(f"{layout['devices']} CPU devices, {where}{meta['dtype']}, {meta['machine']}",
               fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
