"""``--compare A.json B.json``: B/A time ratios of two recorded runs per op
and size, as a table and a PNG; runs nothing."""

from __future__ import annotations

import json
import os
import statistics
import sys

from jax_smddp.tools.bench.core import format_size

def _label(path: str, meta: dict) -> str:
  layout = meta.get("layout", {})
  return f"{os.path.basename(path)} ({layout.get('spec', '?')}, {meta.get('machine', '?')})"


def compare_results(a: dict, b: dict) -> list[dict]:
  """Rows (op, size) present in both result sets, with B/A time ratios for each
  implementation (< 1: B is faster)."""
  index = {(r["op"], r["bytes_per_rank"]): r for r in a["results"]}
  rows = []
  for rb in b["results"]:
    ra = index.get((rb["op"], rb["bytes_per_rank"]))
    if ra is None or not rb["bytes_per_rank"]:  # a 0-byte row has no baseline time
      continue
    row = {"op": rb["op"], "bytes_per_rank": rb["bytes_per_rank"]}
    for impl in ("smddp", "lax"):
      ta, tb = ra[impl]["time_us"], rb[impl]["time_us"]
      row[impl] = {"a_us": ta, "b_us": tb, "ratio": tb / ta,
                   "a_busbw_gbs": ra[impl]["busbw_gbs"], "b_busbw_gbs": rb[impl]["busbw_gbs"]}
    rows.append(row)
  return rows


def write_compare_plot(path: str, rows: list[dict], label_a: str, label_b: str) -> None:
  """busbw of both files vs size (one column per op), and the B/A time ratio."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ops = list(dict.fromkeys(r["op"] for r in rows))
  fig, axes = plt.subplots(2, len(ops), figsize=(4.5 * len(ops), 6.4), squeeze=False,
                           sharex="col", gridspec_kw={"height_ratios": [2, 1]})
  for j, op in enumerate(ops):
    sel = [r for r in rows if r["op"] == op]
    sizes = [r["bytes_per_rank"] for r in sel]
    top, bottom = axes[0][j], axes[1][j]
    for impl, name in (("smddp", "jax_smddp"), ("lax", "jax.lax")):
      for side, style, lab in (("a", "o-" if impl == "smddp" else "s-", "A"),
                               ("b", "o--" if impl == "smddp" else "s--", "B")):
        top.plot(sizes, [r[impl][f"{side}_busbw_gbs"] for r in sel], style,
                 label=f"{name} {lab}", alpha=0.85)
      bottom.plot(sizes, [r[impl]["ratio"] for r in sel], "o-" if impl == "smddp" else "s--",
                  label=name)
    bottom.axhline(1.0, color="gray", lw=0.8)
    for ax in (top, bottom):
      ax.set_xscale("log", base=2)
      ax.grid(alpha=0.3)
    top.set_title(op)
    top.set_ylabel("busbw (GB/s)")
    top.legend(fontsize=7)
    bottom.set_ylabel("time B / time A")
    bottom.set_xticks(sizes, [format_size(x) for x in sizes], rotation=60, fontsize=7)
    bottom.set_xlabel("input bytes per rank")
    bottom.legend(fontsize=7)
  fig.suptitle(f"A = {label_a}\nB = {label_b}", fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compare_main(args) -> int:
  path_a, path_b = args.compare
  try:
    with open(path_a) as f:
      a = json.load(f)
    with open(path_b) as f:
      b = json.load(f)
  except (OSError, ValueError) as e:
    print(f"error: cannot read the result files: {e}", file=sys.stderr)
    return 2
  rows = compare_results(a, b)
  label_a, label_b = _label(path_a, a.get("meta", {})), _label(path_b, b.get("meta", {}))
  print(f"# A = {label_a}\n# B = {label_b}")
  print("# ratio = B time / A time (median us; < 1: B is faster)")
  if not rows:
    print("error: the files have no (op, size) in common", file=sys.stderr)
    return 1
  for op in dict.fromkeys(r["op"] for r in rows):
    print(f"\n# {op}")
    print(f"{'size':>8}  {'smddp A':>10}  {'smddp B':>10}  {'B/A':>6}  {'lax A':>10}  "
          f"{'lax B':>10}  {'B/A':>6}")
    for r in rows:
      if r["op"] != op:
        continue
      s, l = r["smddp"], r["lax"]
      print(f"{format_size(r['bytes_per_rank']):>8}  {s['a_us']:10.1f}  {s['b_us']:10.1f}  "
            f"{s['ratio']:6.2f}  {l['a_us']:10.1f}  {l['b_us']:10.1f}  {l['ratio']:6.2f}")
  ratios = sorted(r["smddp"]["ratio"] for r in rows)
  print(f"\n# jax_smddp B/A: median {statistics.median(ratios):.2f}, "
        f"range {ratios[0]:.2f} .. {ratios[-1]:.2f} over {len(ratios)} points")
  if not args.no_plot:
    plot = args.plot or os.path.join("bench_results", "compare.png")
    try:
      write_compare_plot(plot, rows, label_a, label_b)
      print(f"wrote {plot}")
    except ImportError:
      print(f"note: matplotlib not importable; skipped the plot ({plot})")
  return 0
