"""What a run prints and writes: the preamble, the multi-process merge and its tables, the
comparison with nccl-tests' logs, and the JSON, CSV and plot. Shared by the command line
(:mod:`~jax_smddp.tools.bench.cli`) and the run across a launched job
(:mod:`~jax_smddp.tools.bench.in_job`)."""

from __future__ import annotations

import os

from jax_smddp import config
from jax_smddp.tools.bench import core
from jax_smddp.tools.bench import nccl_flags, nccl_tests
from jax_smddp.tools.bench.core import (BYTES_BUDGET, MEMCPY_BYTES, Layout, annotate, format_size,
                                        model_meta)
from jax_smddp.tools.bench.options import iters_warmup, statistic
from jax_smddp.tools.bench.output import (arrival_table, nccl_table, phases_table,
                                          speedup_verdict, table_header, table_row, write_json,
                                          write_plot)


def print_preamble(meta: dict, iters: int, warmup: int) -> None:
  layout = meta["layout"]
  if layout["processes"] > 1:
    shape = Layout(layout["hosts"], layout["processes_per_host"], layout["devices_per_process"])
    kind = layout.get("backend", "cpu").upper()
    where = f"layout {layout['spec']} ({shape.describe()}), {layout['devices']} {kind} devices"
  else:
    where = f"{layout['devices']} CPU devices, 1 process"
  print(f"# jax_smddp bench: {where}, {meta['dtype']}, "
        f"{meta['machine']} ({meta['cpu_count']} cpus), jax {meta['jax']}, jaxlib {meta['jaxlib']}")
  if layout["processes"] > 1:
    topo = meta.get("topology") or {}
    print(f"# across processes: jax_smddp shared memory to {len(topo.get('shared_memory_peers', []))} "
          f"and libfabric ({meta.get('fabric_provider') or 'none'}) to "
          f"{len(topo.get('network_peers', []))} peer processes of process 0; "
          + ("jax.lax on gloo (TCP)" if meta.get("baseline", "lax") == "lax" else
             "the baseline is jax_smddp again") + "; times are "
          + meta.get("time_is", "process 0's medians"))
  if meta.get("link"):
    link = meta["link"]
    capped = f", capped at {meta['link_rate']} each way" if meta.get("link_rate") else ""
    print(f"# link between the hosts{capped}, measured raw in this run ({link['method']}, "
          f"{format_size(link['bytes'])} each way per round): {link['each_way_gbs']:.3f} GB/s each "
          "way; link us = the bytes each host must receive from the others at that rate; vs link "
          "= link us / time (1: the call ran at the link's rate)"
          + (f"; b: above 1 by no more than the {format_size(meta['link_burst_bytes'])} a full "
             "token bucket passes at once (it refills while the link idles between calls)"
             if meta.get("link_burst_bytes") else ""))
    if meta.get("nics", 1) > 1:
      print(f"# {meta['nics']} NICs per host (eth0..eth{meta['nics'] - 1}), each capped alike and "
            f"probed on eth0: link us is at {meta['nics']} x that rate; the baseline (gloo) "
            "binds to one")
  print(f"# memcpy reference (np.copyto, {format_size(MEMCPY_BYTES)}, one thread): "
        f"{meta['memcpy_gbs']:.2f} GB/s; memcpy us = a process's output bytes at that rate")
  print("# vs memcpy = memcpy us / jax_smddp's time: a reference, not a limit (above 1: "
        "faster than np.copyto, as streaming stores can be)")
  print(f"# {config.format_non_default()}")  # meta["jax_smddp_settings"]
  print(f"# iters {iters} (capped to {format_size(BYTES_BUDGET)} moved per size), warmup {warmup}; "
        "speedup = lax time / smddp time; * = smddp fell back to jax.lax")
  if meta.get("baseline", "lax") == "self":
    print("# baseline self: 'again' is a second compiled copy of jax_smddp's program, timed "
          "alternating with the first; its true speedup is 1.0, so each row's distance from 1.0 "
          "is what this machine's noise alone gives")


def print_nccl_comparison(args, meta: dict, results: list[dict], logs: list[dict]) -> None:
  """Matches our rows to the --nccl-tests logs' (op, size S), prints the ratios per op and
  keeps them in the JSON (meta["nccl_tests"]) and the CSV (the rows' nccl_tests_* fields)."""
  if not logs:
    return
  pairs = nccl_tests.compare(results, logs)
  meta["nccl_tests"] = {"logs": [{"path": g["path"], "line": g["line"], "op": g["op"],
                                  "ranks": g["ranks"], "rows": len(g["rows"]), "runs": g["runs"]}
                                 for g in logs],
                        "comparison": pairs,
                        "definition": "busbw_vs_nccl_tests = our busbw / theirs; "
                                      "time_vs_nccl_tests = our time / theirs; matched by op "
                                      "and size S"}
  for op in args.ops:
    table = nccl_tests.comparison_table(op, pairs)
    if table:
      print()
      print(table)
  unmatched = sorted({g["op"] for g in logs if g["op"] in args.ops} - {p["op"] for p in pairs})
  if unmatched:
    print(f"\n# note: no size of {', '.join(unmatched)} in the nccl-tests logs matches this "
          "run's sizes S; run the same -b/-e/-f as the log")
  not_run = sorted({g["op"] for g in logs} - set(args.ops))
  if not_run:
    print(f"\n# note: the nccl-tests logs also hold {', '.join(not_run)}, which this run did not "
          "time (--ops)")


def write_outputs(args, meta: dict, results: list[dict]) -> None:
  write_json(args.json, meta, results)
  print(f"\nwrote {args.json}")
  if args.csv:
    nccl_tests.write_csv(args.csv, results)
    print(f"wrote {args.csv}")
  if not args.no_plot:
    plot = args.plot or os.path.join("bench_results", "bench.png")
    try:
      write_plot(plot, meta, results)
      print(f"wrote {plot}")
    except ImportError:
      print(f"note: matplotlib not importable; skipped the plot ({plot})")


def report_multi_process(args, layout: Layout, per_process: list[list[dict]], meta: dict,
                         logs: list[dict], in_process: list[dict] | None = None,
                         link: dict | None = None, lax_note: str = " (gloo)") -> list[dict]:
  """Merges every process's rows (times taken over the processes as -a says, or --slowest's;
  each call after its last arrival; #wrong summed over the processes), prints the tables and
  writes the outputs."""
  iters, warmup = iters_warmup(args)
  if args.slowest:
    results = core.slowest_process(per_process, layout.devices)
  else:
    results = nccl_flags.over_processes(per_process, layout.devices, args.average)
  core.after_arrival(per_process, results)
  core.sum_wrong(per_process, results)
  if in_process is not None:
    ref = {(r["op"], r["bytes_per_rank"]): r for r in in_process}
    for r in results:
      other = ref.get((r["op"], r["bytes_per_rank"]))
      r["in_process_smddp_time_us"] = other["smddp"]["time_us"] if other else None
      r["vs_in_process"] = (r["smddp"]["time_us"] / other["smddp"]["time_us"]) if other else None
  # With several NICs per host every one is capped alike: the hosts' link is their sum.
  link_gbs = link["each_way_gbs"] * meta.get("nics", 1) if link else None
  # What a capped link's full buckets pass uncapped (one per NIC): the floor of the reference.
  from jax_smddp.tools import netns
  burst = netns.BURST_BYTES * meta.get("nics", 1) if meta.get("link_rate") else 0
  meta["link_burst_bytes"] = burst
  for r in results:
    annotate(r, layout, predict=args.predict, memcpy_gbs=meta["memcpy_gbs"], link_gbs=link_gbs,
             burst_bytes=burst)
    core.nccl_row(r, layout.devices, args.dtype, layout.processes)
  # statistic: slowest, or -a's process 0 / mean / min / max; time_is: the sentence
  meta["statistic"] = "slowest" if args.slowest else nccl_flags.STATISTIC[args.average]
  meta["time_is"] = statistic(args, layout.processes)
  if args.predict:
    meta["model"] = model_meta()
  if in_process is not None:
    meta["in_process"] = {"layout": f"1x{layout.devices}", "results": in_process,
                          "vs_in_process": "multi-process smddp time / in-process smddp time"}
  print_preamble(meta, iters, warmup)
  if in_process is not None:
    print(f"# vs 1p = this layout's jax_smddp time / jax_smddp time with {layout.devices} "
          "devices in one process (< 2: the target)")
  for op in args.ops:
    print()
    print(nccl_table(op, results, args.baseline, lax_note, meta["time_is"]))
    print()
    print(table_header(op, layout.devices, ratio=in_process is not None, lax_note=lax_note,
                       model=args.predict, mpi=args.mpi4jax, memcpy=True, link=link is not None,
                       baseline=args.baseline, statistic=meta["time_is"]))
    for r in results:
      if r["op"] == op:
        print(table_row(r))
    print(speedup_verdict(op, results))
    print()
    print(arrival_table(op, results, cores=meta["cpu_count"], baseline=args.baseline))
    if any(r.get("sent_per_call_by_host") for r in results if r["op"] == op):
      print()
      print(interface_table(op, results, lax_note))
    if args.phases:
      print()
      print(phases_table(op, results))
  print_nccl_comparison(args, meta, results, logs)
  write_outputs(args, meta, results)
  return results


def interface_table(op: str, results: list[dict], lax_note: str = "") -> str:
  """The bytes each simulated host's interfaces sent per call, for jax_smddp and the baseline
  (the kernel's counters in each host's namespace, read around the timed calls), and how far
  apart the host's interfaces are (max/min - 1: the NICs' balance)."""
  lines = [f"# {op}: bytes sent per call by each host's interfaces (kernel counters), "
           f"jax_smddp | baseline{lax_note}; spread = busiest/idlest - 1"]
  for r in results:
    if r["op"] != op or not r.get("sent_per_call_by_host"):
      continue
    cells = []
    for h, sent in enumerate(r["sent_per_call_by_host"]):
      if not sent:
        continue
      for impl in ("smddp", "lax"):
        counts = sent.get(impl, {})
        vals = [v for v in counts.values()]
        spread = (max(vals) / min(vals) - 1) if vals and min(vals) > 0 else float("inf")
        named = " ".join(f"{i}={format_size(v)}" for i, v in counts.items())
        cells.append(f"h{h} {'smddp' if impl == 'smddp' else 'base'}: {named} "
                     f"(spread {spread:.0%})" if len(vals) > 1 else
                     f"h{h} {'smddp' if impl == 'smddp' else 'base'}: {named}")
    lines.append(f"{format_size(r['bytes_per_rank']):>8}/rank  " + " | ".join(cells))
  lines.extend(predicted_lines(op, results))
  return "\n".join(lines)


def predicted_lines(op: str, results: list[dict]) -> list[str]:
  """The busiest host's bytes per call against the model's (docs/performance_model.md, "Bytes
  on the wire": jax_smddp's algorithms, gloo's ring), and the speedup the model's bytes predict
  on a capped link (gloo's / jax_smddp's)."""
  lines = []
  for r in results:
    pred, hosts = r.get("predicted_sent"), r.get("sent_per_call_by_host")
    if r["op"] != op or not pred or not hosts or not all(hosts):
      continue
    cells = []
    for impl, name in (("smddp", "smddp"), ("lax", "base")):
      busiest = max(sum(h.get(impl, {}).values()) for h in hosts)
      want = pred.get(impl)
      cells.append(f"{name} {format_size(busiest)} / {format_size(want)} = {busiest / want:.2f}"
                   if want else f"{name} {format_size(busiest)} / -")
    lead = (f"; bytes predict {pred['lax'] / pred['smddp']:.2f}x"
            if pred.get("lax") and pred.get("smddp") else "")
    lines.append(f"{format_size(r['bytes_per_rank']):>8}/rank  busiest host, measured / "
                 f"predicted: " + ", ".join(cells) + lead)
  if lines:
    lines.insert(0, f"# {op}: the busiest host's bytes per call against the model's "
                 "(docs/between_hosts.md, 'Bytes on the wire'); the speedup they predict "
                 "on a capped link = gloo's / jax_smddp's")
  return lines
