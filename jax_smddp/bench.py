"""nccl-tests-style benchmark of jax_smddp's collectives against jax.lax.

Usage::

    python -m jax_smddp.bench                       # all_gather, reduce_scatter, all_reduce
    python -m jax_smddp.bench --ops all_to_all --min-bytes 1K --max-bytes 1M
    python -m jax_smddp.bench --quick --devices 4   # smoke run

For every op and size two jitted ``jax.shard_map`` programs over a 1-D mesh
``"x"`` of all (CPU) devices are built: one calling the jax_smddp collective,
one calling its ``jax.lax`` equivalent::

    all_gather      smddp.all_gather(x, "x", tiled=True)      lax.all_gather(..., tiled=True)
    reduce_scatter  smddp.psum_scatter(x, "x", tiled=True)    lax.psum_scatter(..., tiled=True)
    all_reduce      smddp.psum(x, "x")                        lax.psum(x, "x")
    all_to_all      smddp.all_to_all(x, "x", 0, 0, tiled=True) lax.all_to_all(..., 0, 0, tiled=True)

The jax_smddp result is checked against the jax.lax one before timing. Each
timed sample is one whole jitted call followed by ``block_until_ready`` (every
call is synchronised: XLA's CPU runtime can hang with many multi-device
executions in flight); the two implementations alternate call by call so that
noise hits both alike, and the median is reported.

Definitions (as in nccl-tests; n = number of ranks, t = median time):

* size: bytes of the *input buffer of one rank* (all sizes are powers of 2).
* algbw = S_total / t, in GB/s (1e9 bytes/s), where S_total is
    - all_gather:     n x size     (the gathered output),  busbw = algbw x (n-1)/n
    - reduce_scatter: size         (input of one rank),    busbw = algbw x (n-1)/n
    - all_reduce:     size         (the buffer),           busbw = algbw x 2(n-1)/n
    - all_to_all:     size         (buffer of one rank),   busbw = algbw x (n-1)/n
* speedup = lax time / smddp time (> 1: jax_smddp is faster).

A physical reference, single-threaded numpy memcpy bandwidth (``np.copyto`` of
a 64 MiB buffer), is measured in the same run. Results go to a JSON file with
the run's metadata and, when matplotlib is importable, to a busbw-vs-size plot.

The benchmark functions are importable (:func:`run_benchmark`). This module
imports jax lazily; ``import jax_smddp`` imports jax but does not start its
backends, so ``--devices`` can still set ``XLA_FLAGS`` in :func:`main`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DEFAULT_OPS = ("all_gather", "reduce_scatter", "all_reduce")
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Large sizes run fewer iterations: a sample is cut when one implementation's
# calls would move more than this many bytes in all (keeps the default run short
# on small machines); never fewer than MIN_ITERS samples.
BYTES_BUDGET = 2 << 30
MIN_ITERS = 3
MEMCPY_BYTES = 64 << 20


# --------------------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
  """Parses ``"4K"``, ``"16M"``, ``"1GiB"``, ``"4096"`` (binary suffixes) into bytes."""
  t = text.strip().upper()
  for unit in ("IB", "B"):
    if t.endswith(unit) and len(t) > len(unit):
      t = t[:-len(unit)]
      break
  num, scale = (t[:-1], _SUFFIXES[t[-1]]) if t and t[-1] in _SUFFIXES else (t, 1)
  try:
    value = int(float(num) * scale)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 4K, 16M, 1G)") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
  return value


def format_size(nbytes: int) -> str:
  """4096 -> '4K', 16777216 -> '16M'."""
  for suffix in ("G", "M", "K"):
    if nbytes >= _SUFFIXES[suffix] and nbytes % _SUFFIXES[suffix] == 0:
      return f"{nbytes // _SUFFIXES[suffix]}{suffix}"
  return str(nbytes)


def power_of_two_sizes(min_bytes: int, max_bytes: int) -> list[int]:
  """Powers of two from the first >= min_bytes up to max_bytes."""
  size = 1 << max(0, (min_bytes - 1).bit_length())
  sizes = []
  while size <= max_bytes:
    sizes.append(size)
    size *= 2
  return sizes


# --------------------------------------------------------------------------- ops

@dataclass(frozen=True)
class OpSpec:
  """One collective: how to call both implementations and how to count bytes."""
  name: str
  smddp: Callable      # (x, axis_name) -> y, per shard
  lax: Callable        # (x, axis_name) -> y, per shard
  total_factor: Callable[[int], int]   # n -> S_total / size
  bus_factor: Callable[[int], float]   # n -> busbw / algbw
  target: str          # the plugin's custom-call target, expected in the HLO


def op_specs() -> dict[str, OpSpec]:
  """The benchmarked ops (imports jax: call after XLA_FLAGS is set)."""
  import jax
  import jax_smddp as smddp

  ring = lambda n: (n - 1) / n
  return {
      "all_gather": OpSpec(
          "all_gather",
          lambda x, a: smddp.all_gather(x, a, tiled=True),
          lambda x, a: jax.lax.all_gather(x, a, tiled=True),
          total_factor=lambda n: n, bus_factor=ring, target="smddp_all_gather"),
      "reduce_scatter": OpSpec(
          "reduce_scatter",
          lambda x, a: smddp.psum_scatter(x, a, tiled=True),
          lambda x, a: jax.lax.psum_scatter(x, a, tiled=True),
          total_factor=lambda n: 1, bus_factor=ring, target="smddp_reduce_scatter"),
      "all_reduce": OpSpec(
          "all_reduce",
          lambda x, a: smddp.psum(x, a),
          lambda x, a: jax.lax.psum(x, a),
          total_factor=lambda n: 1, bus_factor=lambda n: 2 * (n - 1) / n,
          target="smddp_all_reduce"),
      "all_to_all": OpSpec(
          "all_to_all",
          lambda x, a: smddp.all_to_all(x, a, 0, 0, tiled=True),
          lambda x, a: jax.lax.all_to_all(x, a, 0, 0, tiled=True),
          total_factor=lambda n: 1, bus_factor=ring, target="smddp_all_to_all"),
  }


def build_programs(spec: OpSpec, mesh):
  """The two jitted shard_map programs (smddp, lax) for one op over mesh axis "x"."""
  import jax
  from jax.sharding import PartitionSpec as P

  def program(collective):
    body = lambda x: collective(x, "x")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  return program(spec.smddp), program(spec.lax)


def to_dtype(dtype) -> np.dtype:
  """np.dtype, also for names numpy alone does not know ("bfloat16")."""
  import jax.numpy as jnp
  return jnp.dtype(dtype)


def is_float(dtype) -> bool:
  import jax.numpy as jnp
  return bool(jnp.issubdtype(to_dtype(dtype), jnp.floating))


def make_input(nbytes: int, n: int, dtype, mesh, seed: int = 0):
  """A global 1-D array of n x nbytes, sharded so each rank holds nbytes."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  dtype = to_dtype(dtype)
  count = nbytes // dtype.itemsize
  if count == 0 or count * dtype.itemsize != nbytes or count % n:
    raise ValueError(f"{nbytes} bytes per rank is not a whole number of {n} blocks of "
                     f"{dtype.name}; choose sizes that are multiples of {n * dtype.itemsize}.")
  rng = np.random.default_rng(seed)
  if is_float(dtype):
    host = rng.standard_normal(n * count, dtype=np.float32).astype(dtype)
  elif dtype == np.bool_:
    host = rng.integers(0, 2, n * count).astype(dtype)
  else:
    host = rng.integers(-4 if np.issubdtype(dtype, np.signedinteger) else 0, 8,
                        n * count).astype(dtype)
  return jax.device_put(host, NamedSharding(mesh, P("x")))


def check_result(spec: OpSpec, dtype, got, want, nbytes: int) -> None:
  """Raises AssertionError unless jax_smddp's answer matches jax.lax's."""
  got, want = np.asarray(got), np.asarray(want)
  where = f"jax_smddp {spec.name} ({format_size(nbytes)}/rank, {to_dtype(dtype).name})"
  if got.shape != want.shape:
    raise AssertionError(f"{where}: shape {got.shape} != jax.lax shape {want.shape}")
  if is_float(dtype):
    # float32/64: rtol 1e-5. Half-precision sums may round differently by order.
    rtol = 1e-5 if to_dtype(dtype).itemsize >= 4 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol, err_msg=where)
  else:
    np.testing.assert_array_equal(got, want, err_msg=where)


def uses_engine(program, x, target: str) -> bool:
  """True if the lowered program calls the plugin (not a jax.lax fallback)."""
  return target in program.lower(x).as_text()


# --------------------------------------------------------------------------- timing

def iters_for(bytes_per_call: int, iters: int) -> int:
  """`iters`, cut for large sizes so one implementation moves <= BYTES_BUDGET."""
  return max(min(iters, MIN_ITERS), min(iters, BYTES_BUDGET // max(1, bytes_per_call)))


def time_alternating(fns, x, iters: int, warmup: int) -> list[list[float]]:
  """Seconds per call of each fn(x), calls interleaved (a, b, a, b, ...), each synced."""
  for _ in range(warmup):
    for fn in fns:
      fn(x).block_until_ready()
  samples = [[] for _ in fns]
  for _ in range(iters):
    for fn, out in zip(fns, samples):
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      out.append(time.perf_counter() - t0)
  return samples


def bandwidths(spec: OpSpec, nbytes: int, n: int, seconds: float) -> dict:
  """nccl-tests figures for one median time."""
  algbw = spec.total_factor(n) * nbytes / seconds / 1e9
  return {"time_us": seconds * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * spec.bus_factor(n)}


def memcpy_bandwidth(nbytes: int = MEMCPY_BYTES, repeats: int = 5) -> float:
  """Median single-threaded numpy copy bandwidth in GB/s (bytes copied / time)."""
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # fault the pages in
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times) / 1e9


# --------------------------------------------------------------------------- driver

def run_benchmark(ops, sizes, *, dtype="float32", iters: int = 20, warmup: int = 3,
                  devices=None, report: Callable[[dict], None] | None = None) -> list[dict]:
  """Benchmarks `ops` at each per-rank size in `sizes` (bytes); returns one dict per
  (op, size) as in the JSON "results" list. `devices` defaults to all CPU devices.
  `report` is called with each result as it is ready (e.g. to print a row).

  Raises AssertionError if a jax_smddp result differs from jax.lax's.
  """
  import jax

  devices = list(devices if devices is not None else jax.devices("cpu"))
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  specs = op_specs()
  unknown = [op for op in ops if op not in specs]
  if unknown:
    raise ValueError(f"unknown ops {unknown}; choose from {list(specs)}")
  results = []
  for op in ops:
    spec = specs[op]
    smddp_fn, lax_fn = build_programs(spec, mesh)
    for nbytes in sizes:
      x = make_input(nbytes, n, dtype, mesh)
      check_result(spec, dtype, smddp_fn(x), lax_fn(x), nbytes)
      k = iters_for(n * nbytes * spec.total_factor(n), iters)
      t_smddp, t_lax = (statistics.median(s) for s in
                        time_alternating((smddp_fn, lax_fn), x, k, warmup))
      result = {
          "op": op, "bytes_per_rank": nbytes, "iters": k,
          "engine": uses_engine(smddp_fn, x, spec.target),
          "smddp": bandwidths(spec, nbytes, n, t_smddp),
          "lax": bandwidths(spec, nbytes, n, t_lax),
          "speedup": t_lax / t_smddp,
      }
      results.append(result)
      if report:
        report(result)
      del x
  return results


def metadata(n_devices: int, dtype: str, memcpy_gbs: float) -> dict:
  """Machine, software and layout of this run."""
  import jax
  import jaxlib
  return {
      "machine": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
      "layout": {"processes": 1, "devices": n_devices, "backend": "cpu"},
      "dtype": to_dtype(dtype).name,
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "memcpy_gbs": memcpy_gbs,
      "definitions": {
          "bytes_per_rank": "input buffer bytes of one rank",
          "time_us": "median wall time of one jitted call incl. block_until_ready",
          "algbw_gbs": "S_total / time; S_total = n*bytes_per_rank for all_gather, "
                       "bytes_per_rank otherwise",
          "busbw_gbs": "algbw * (n-1)/n, or * 2(n-1)/n for all_reduce",
          "speedup": "lax time / smddp time",
      },
  }


# --------------------------------------------------------------------------- output

_COLUMNS = ("size", "smddp us", "algbw", "busbw", "lax us", "busbw", "speedup")
_WIDTHS = (8, 11, 8, 8, 11, 8, 8)


def table_header(op: str, n: int) -> str:
  title = (f"# {op}: {n} ranks; size = input bytes per rank; "
           "time = median us per call; bw in GB/s")
  span = lambda cols: sum(_WIDTHS[i] + 2 for i in cols) - 2
  groups = (f"{'':{_WIDTHS[0]}}  {' jax_smddp ':-^{span((1, 2, 3))}}  "
            f"{' jax.lax ':-^{span((4, 5))}}")
  cols = "  ".join(f"{c:>{w}}" for c, w in zip(_COLUMNS, _WIDTHS))
  return "\n".join((title, groups, cols))


def table_row(r: dict) -> str:
  s, l = r["smddp"], r["lax"]
  cells = (format_size(r["bytes_per_rank"]), f"{s['time_us']:.1f}", f"{s['algbw_gbs']:.3f}",
           f"{s['busbw_gbs']:.3f}", f"{l['time_us']:.1f}", f"{l['busbw_gbs']:.3f}",
           f"{r['speedup']:.2f}" + ("" if r["engine"] else "*"))
  return "  ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS))


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
      ax.plot(sizes, [r[impl]["busbw_gbs"] for r in rows], style,
              label="jax_smddp" if impl == "smddp" else "jax.lax")
    ax.axhline(meta["memcpy_gbs"], color="gray", lw=0.8, ls=":", label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=60, fontsize=7)
    ax.set_title(op)
    ax.set_xlabel("input bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  layout = meta["layout"]
  fig.suptitle(f"{layout['devices']} CPU devices, {meta['dtype']}, {meta['machine']}", fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jax_smddp.bench",
                              description="nccl-tests-style benchmark: jax_smddp vs jax.lax.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=8,
                 help="CPU devices (sets XLA_FLAGS --xla_force_host_platform_device_count "
                      "unless already set)")
  p.add_argument("--ops", default=",".join(DEFAULT_OPS), help=f"comma list from {','.join(OPS)}")
  p.add_argument("--min-bytes", type=parse_size, default="4K", help="smallest size per rank")
  p.add_argument("--max-bytes", type=parse_size, default="16M", help="largest size per rank")
  p.add_argument("--iters", type=int, default=20, help="timed calls per implementation "
                 f"(fewer for large sizes: at most {format_size(BYTES_BUDGET)} moved each)")
  p.add_argument("--warmup", type=int, default=3, help="untimed calls per implementation")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--json", default=os.path.join("bench_results", "bench.json"))
  p.add_argument("--plot", default=None,
                 help="PNG path (default bench_results/bench.png when matplotlib is importable)")
  p.add_argument("--no-plot", action="store_true", help="skip the plot")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: every 4th size, 3 iters, 1 warmup")
  args = p.parse_args(argv)
  args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
  bad = [op for op in args.ops if op not in OPS]
  if bad:
    p.error(f"unknown ops {bad}; choose from {','.join(OPS)}")
  if args.min_bytes > args.max_bytes:
    p.error("--min-bytes is larger than --max-bytes")
  if args.iters < 1 or args.warmup < 0 or args.devices < 1:
    p.error("--iters and --devices must be >= 1, --warmup >= 0")
  return args


def set_device_count(n: int) -> None:
  """Asks XLA for n host devices, unless XLA_FLAGS already chooses a count.

  XLA reads XLA_FLAGS when jax creates its backends (on first use, not at
  ``import jax``, which ``import jax_smddp`` does), so this only works before.
  """
  if "jax" in sys.modules:
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
      return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def selected_sizes(args) -> list[int]:
  sizes = power_of_two_sizes(args.min_bytes, args.max_bytes)
  if args.quick:  # every 4th size, always including the largest
    sizes = sorted(set(sizes[::-4]))
  return sizes


def main(argv=None) -> int:
  args = parse_args(argv)
  set_device_count(args.devices)
  import jax  # after XLA_FLAGS is set

  devices = jax.devices("cpu")
  if len(devices) < args.devices:
    print(f"note: only {len(devices)} CPU devices available (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
  devices = devices[:args.devices]
  n = len(devices)
  iters, warmup = (min(args.iters, 3), min(args.warmup, 1)) if args.quick else (args.iters, args.warmup)
  sizes = selected_sizes(args)

  memcpy_gbs = memcpy_bandwidth()
  meta = metadata(n, args.dtype, memcpy_gbs)
  print(f"# jax_smddp bench: {n} CPU devices, 1 process, {meta['dtype']}, "
        f"{meta['machine']} ({meta['cpu_count']} cpus), jax {meta['jax']}, jaxlib {meta['jaxlib']}")
  print(f"# memcpy reference (np.copyto, {format_size(MEMCPY_BYTES)}): {memcpy_gbs:.2f} GB/s")
  print(f"# iters {iters} (capped to {format_size(BYTES_BUDGET)} moved per size), warmup {warmup}; "
        "speedup = lax time / smddp time; * = smddp fell back to jax.lax")

  results = []
  for op in args.ops:
    print()
    print(table_header(op, n))
    results += run_benchmark([op], sizes, dtype=args.dtype, iters=iters, warmup=warmup,
                             devices=devices, report=lambda r: print(table_row(r), flush=True))

  write_json(args.json, meta, results)
  print(f"\nwrote {args.json}")
  if not args.no_plot:
    plot = args.plot or os.path.join("bench_results", "bench.png")
    try:
      write_plot(plot, meta, results)
      print(f"wrote {plot}")
    except ImportError:
      print(f"note: matplotlib not importable; skipped the plot ({plot})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
