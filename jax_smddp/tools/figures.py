"""The seeds' figure, predicted: network utilisation of AllGather on 32 p4d nodes.

    python -m jax_smddp.tools.figures --out DIR [--preset p4d.24xlarge] [--nodes 32]

Writes ``DIR/allgather_network_utilisation.json`` (every number) and, when
matplotlib is importable, ``DIR/allgather_network_utilisation.png``.

For each number of ranks (GPUs) per node k in 1, 2, 4, 8 and each AllGather
output size O (the gathered buffer, n x S for n = nodes x k ranks of S bytes
each), the cost model (:mod:`jax_smddp.cost_model`) predicts the time of

* **ours**: jax_smddp's cross-process all_gather with the tuner's choice of
  algorithm (hierarchical rail routes for k >= 2, a direct exchange for k = 1)
  and chunk, one process per GPU, on the preset's links;
* **ring**: NCCL's ring (its tuner's latencies, the same links).

Network utilisation = bytes leaving a node over its NICs / time / line rate of
all the node's NICs (4 x 100 Gbps on p4d): the share of the node's EFA
bandwidth in use, not nccl-tests' busbw. With k ranks spread over the NICs, k
< NICs cannot reach 100% (k = 1 on p4d: at most 25%); ``usable`` in the JSON is
that ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jax_smddp import capabilities, cost_model as cm
from jax_smddp.tools.sizes import format_size

RANKS_PER_NODE = (1, 2, 4, 8)
NAME = "allgather_network_utilisation"


def output_sizes(lo: int = 1 << 20, hi: int = 8 << 30) -> list[int]:
  sizes, s = [], lo
  while s <= hi:
    sizes.append(s)
    s *= 2
  return sizes


def curves(machine: cm.Machine, nodes: int = 32, ranks_per_node=RANKS_PER_NODE,
           sizes: list[int] | None = None) -> dict:
  """The figure's numbers: per k, per output size, both implementations."""
  sizes = sizes or output_sizes()
  line = machine.network.bandwidth * machine.nics_per_host
  out = {"machine": machine.name, "description": machine.description, "nodes": nodes,
         "node_nic_line_rate_gbs": line / 1e9,
         "network_efficiency": machine.network.efficiency,
         "definition": "utilisation = bytes leaving a node over its NICs / time / line rate of "
                       "all its NICs; output = n x bytes per rank",
         "series": {}}
  for k in ranks_per_node:
    n = nodes * k
    layout = cm.Layout(nodes, k, 1)
    usable = machine.usable_nics(k) / machine.nics_per_host
    rows = []
    for o in sizes:
      s = max(1, o // n)
      ours, _ = cm.best("all_gather", s, layout, machine)
      ring = cm.nccl_predict("all_gather", s, nodes, k, machine, "ring")
      rows.append({
          "output_bytes": s * n, "bytes_per_rank": s,
          "ours_algorithm": ours.algorithm, "ours_chunk_bytes": ours.chunk_bytes,
          "ours_time_us": ours.time_us, "ours_utilisation": ours.network_utilisation(machine),
          "ours_busbw_gbs": (n - 1) * s / ours.time_s / 1e9,
          "ring_time_us": ring.time_us, "ring_utilisation": ring.network_utilisation(machine),
          "ring_busbw_gbs": (n - 1) * s / ring.time_s / 1e9,
      })
    out["series"][str(k)] = {"ranks_per_node": k, "ranks": n, "usable_share": usable,
                             "rows": rows, "summary": summary(rows, usable)}
  return out


def summary(rows: list[dict], usable: float) -> dict:
  """Peak utilisation of each implementation over the sizes, and the smallest
  output reaching 90% of that peak, and 80% / 90% of the usable NICs."""
  res = {}
  for impl in ("ours", "ring"):
    util = [(r["output_bytes"], r[f"{impl}_utilisation"]) for r in rows]
    peak = max(u for _, u in util)
    first = lambda thr: next((o for o, u in util if u >= thr), None)
    res[impl] = {"peak_utilisation": peak,
                 "peak_of_usable": peak / usable,
                 "output_at_90pct_of_peak": first(0.9 * peak),
                 "output_at_80pct_of_usable": first(0.8 * usable),
                 "output_at_90pct_of_usable": first(0.9 * usable),
                 "utilisation_at": {format_size(o, exact=False): u for o, u in util
                                    if o in (64 << 20, 256 << 20, 1 << 30, 4 << 30)}}
  a, b = res["ours"]["output_at_90pct_of_peak"], res["ring"]["output_at_90pct_of_peak"]
  res["ring_needs_x_larger_buffers"] = (b / a) if a and b else None
  return res


def plot(data_by_machine: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(data_by_machine), figsize=(6.5 * len(data_by_machine), 4.6),
                           squeeze=False)
  colors = {"1": "tab:blue", "2": "tab:orange", "4": "tab:green", "8": "tab:red"}
  for ax, data in zip(axes[0], data_by_machine):
    for k, series in data["series"].items():
      rows = series["rows"]
      x = [r["output_bytes"] for r in rows]
      ax.plot(x, [100 * r["ours_utilisation"] for r in rows], "-", color=colors.get(k),
              label=f"{k}/node jax_smddp")
      ax.plot(x, [100 * r["ring_utilisation"] for r in rows], "--", color=colors.get(k),
              label=f"{k}/node ring (NCCL)")
    ax.set_xscale("log", base=2)
    ticks = x[::2]
    ax.set_xticks(ticks, [format_size(t, exact=False) for t in ticks], rotation=45, fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_xlabel("AllGather output size (bytes)")
    ax.set_ylabel("network utilisation (% of node NIC line rate)")
    ax.set_title(f"{data['nodes']} x {data['machine']} "
                 f"({data['node_nic_line_rate_gbs'] * 8:.0f} Gbps per node), predicted",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_smddp.tools.figures", description=__doc__.split("\n")[0])
  p.add_argument("--out", default="figures", help="output folder")
  p.add_argument("--preset", action="append", default=None,
                 help=f"machine preset(s) (default: p4d.24xlarge and p5.48xlarge); {sorted(cm.PRESETS)}")
  p.add_argument("--nodes", type=int, default=32)
  p.add_argument("--no-plot", action="store_true")
  args = p.parse_args(argv)
  presets = args.preset or ["p4d.24xlarge", "p5.48xlarge"]
  unknown = [x for x in presets if x not in cm.PRESETS]
  if unknown:
    p.error(f"unknown presets {unknown}; choose from {sorted(cm.PRESETS)}")
  data = [curves(cm.PRESETS[x], args.nodes) for x in presets]
  os.makedirs(args.out, exist_ok=True)
  jpath = os.path.join(args.out, NAME + ".json")
  with open(jpath, "w") as f:
    json.dump({"jax_smddp": capabilities.version(), "figures": data}, f, indent=2)
    f.write("\n")
  print(f"wrote {jpath}")
  for d in data:
    print(f"\n# {d['nodes']} x {d['machine']}: AllGather network utilisation (% of node NIC line rate)")
    print(f"{'k/node':>6}  {'impl':>5}  {'peak':>5}  {'90% of peak at':>14}  "
          + "  ".join(f"{s:>6}" for s in ("64M", "256M", "1G", "4G")))
    for k, series in d["series"].items():
      for impl in ("ours", "ring"):
        s = series["summary"][impl]
        at = s["utilisation_at"]
        o90 = s["output_at_90pct_of_peak"]
        o90 = format_size(o90, exact=False) if o90 else "-"
        print(f"{k:>6}  {impl:>5}  {100 * s['peak_utilisation']:4.0f}%  {o90:>14}  "
              + "  ".join(f"{100 * at.get(x, float('nan')):5.0f}%" for x in ("64M", "256M", "1G", "4G")))
  if not args.no_plot:
    ppath = os.path.join(args.out, NAME + ".png")
    try:
      plot(data, ppath)
      print(f"\nwrote {ppath}")
    except ImportError:
      print("note: matplotlib is not importable; skipped the PNG")
  return 0


if __name__ == "__main__":
  sys.exit(main())
