"""nccl-tests' command-line flags in the benchmark (:mod:`jax_smddp.tools.bench`), and its
``-a``: how a row's time is taken over the processes.

Every flag nccl-tests' src/common.cu reads (getopt "t:g:b:e:i:f:n:m:w:N:p:I:K:c:o:d:r:z:y:T:hG:C:
a:R:x:D:V:J:S:M:u:", with its long names) is understood: ``-b -e -f -i -n -w -c -d -o -a -T -r
-C`` are honoured (:data:`HONOURED`), the others are accepted at the value that means what this
benchmark does anyway and refused otherwise, at parsing, with the reason (:data:`REFUSED`).
"""

from __future__ import annotations

import argparse
import copy
import statistics

from jax_smddp.tools.bench import nccl_tests

# --dtype / -d: nccl-tests' type names (test_typenames; "char" and "int" of its oldest
# releases) and numpy's, for the element types jax_smddp's engine handles.
DTYPES = {"int8": "int8", "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
          "uint32": "uint32", "int64": "int64", "half": "float16", "float16": "float16",
          "float": "float32", "float32": "float32", "double": "float64", "float64": "float64",
          "bfloat16": "bfloat16", "bool": "bool"}
_NO_DTYPE = {
    "uint64": "jax_smddp's engine has no uint64 (the call would run jax.lax's instead)",
    "all": "this benchmark runs one type per run: run it once per type",
}
_FLOAT8 = "jax_smddp's engine has no 8-bit float types (nccl-tests' f8e4m3, f8e5m2)"

# -a / --average: nccl-tests' Allreduce of each rank's time (src/common.cu, BenchTime).
AVERAGE = {0: "process 0's median", 1: "the mean of the processes' medians",
           2: "the least of the processes' medians", 3: "the largest of the processes' medians"}
STATISTIC = {0: "process 0", 1: "mean", 2: "min", 3: "max"}  # JSON meta.statistic

HONOURED = ("-b/--minbytes", "-e/--maxbytes", "-f/--stepfactor", "-i/--stepbytes", "-n/--iters",
            "-w/--warmup_iters", "-c/--check", "-d/--datatype", "-o/--op", "-a/--average",
            "-T/--timeout", "-r/--root", "-C/--report_cputime")

_ONE_PROCESS = "one device per process here: start more processes (mpirun -n N, srun -n N) " \
               "or give --layout PxD"
_NOT_NCCL = "it sets NCCL, and jax_smddp's engine is not NCCL"
# dest: (flags, the values accepted, why any other is refused)
REFUSED = {
    "ngpus": ("-g", "--ngpus", (1,), _ONE_PROCESS),
    "nthreads": ("-t", "--nthreads", (1,), "one thread per process here: start more processes "
                 "(mpirun -n N, srun -n N) or give --layout PxD"),
    "agg_iters": ("-m", "--agg_iters", (1,), "each timed call is one collective; nccl-tests' -m "
                  "groups several in one ncclGroupStart/End, which JAX has no counterpart of"),
    "run_cycles": ("-N", "--run_cycles", (1,), "the sweep runs once: run the command again"),
    "parallel_init": ("-p", "--parallel_init", (0,), "with one thread per process there is "
                      "nothing to initialise in parallel"),
    "blocking": ("-z", "--blocking", (), "calls are timed one at a time, each waited for "
                 "(--timing chooses their order and whether the processes meet at a barrier "
                 "first); nccl-tests' launch modes of CUDA streams have no counterpart here"),
    "stream_null": ("-y", "--stream_null", (0,), "JAX chooses the streams its calls run on"),
    "cudagraph": ("-G", "--cudagraph", (0,), "each call is an XLA program JAX launches; "
                  "nccl-tests' CUDA-graph replay of NCCL calls has no counterpart here"),
    "report_timestamps": ("-S", "--report_timestamps", (0,), "rows carry no timestamp; the "
                          "JSON's meta.timestamp dates the run"),
    "output_file": ("-J", "--output_file", (), "nccl-tests' JSON layout is not written; --json "
                    "PATH writes this benchmark's"),
    "local_register": ("-R", "--local_register", (0,), _NOT_NCCL),
    "cta_policy": ("-x", "--cta_policy", (), _NOT_NCCL),
    "device_implementation": ("-D", "--device_implementation", (0,), "nccl-tests' NCCL "
                              "device-API kernels have no counterpart here"),
    "device_cta_count": ("-V", "--device_cta_count", (), "nccl-tests' NCCL device-API kernels "
                         "have no counterpart here"),
    "memory": ("-M", "--memory", (0,), "there is no memory report here"),
    "unalign": ("-u", "--unalign", (0,), "inputs are XLA's buffers, aligned as XLA allocates "
                "them"),
    "per_iter_timing": ("-I", "--per_iter_timing", (0,), "the JSON keeps every timed call's "
                        "time instead (results[].samples_us)"),
    "per_iter_skip": ("-K", "--per_iter_skip", (0,), "it needs -I, which is refused"),
}


def integer(text: str) -> int:
  """An integer as nccl-tests reads one (strtol base 0: 10, 0x10, 010)."""
  try:
    return int(text, 0)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def dtype(text: str) -> str:
  """-d / --dtype: numpy's name of a type jax_smddp's engine handles, from nccl-tests' name
  (float, half, bfloat16, int32, ...) or numpy's; anything else is refused with the list."""
  name = text.strip().lower()
  if name in DTYPES:
    return DTYPES[name]
  why = _NO_DTYPE.get(name) or (_FLOAT8 if "8" in name and name.startswith("f") else
                                "not a type this benchmark knows")
  raise argparse.ArgumentTypeError(
      f"{text!r}: {why}; choose from {', '.join(sorted(set(DTYPES) - {'char', 'int'}))}")


def add_arguments(p: argparse.ArgumentParser) -> None:
  """nccl-tests' flags that cli.parse_args does not define itself (there: -b -e -f -n -w -d -T
  and their long names)."""
  g = p.add_argument_group(
      "nccl-tests' flags", "the rest of nccl-tests' command line: honoured as it means there, "
      "or refused with the reason (-g 1, -t 1 and each flag at the value that means what this "
      "benchmark does are accepted)")
  g.add_argument("-i", "--stepbytes", type=nccl_tests_size, default=1 << 20, metavar="BYTES",
                 help="the step between sizes when -f is 1 (nccl-tests' -i)")
  g.add_argument("-c", "--check", type=integer, default=1, metavar="N",
                 help="0: skip the answer check (#wrong N/A, as nccl-tests prints); 1 or more: "
                      "check every size's answer against numpy once (the inputs do not change "
                      "between checks)")
  g.add_argument("-a", "--average", type=integer, default=None, metavar="0-3",
                 help="a multi-process row's time, from each process's median per call: 0 "
                      "process 0's, 1 their mean (nccl-tests' default), 2 the least, 3 the "
                      "largest. Default 1 (--slowest: each call's slowest process instead)")
  g.add_argument("-o", "--op", default="sum", metavar="OP",
                 help="reduction of reduce_scatter and all_reduce: sum (the one benchmarked)")
  g.add_argument("-r", "--root", type=integer, default=0, metavar="RANK",
                 help="ignored: none of these collectives has a root (nccl-tests ignores it for "
                      "them too and prints root -1)")
  g.add_argument("-C", "--report_cputime", type=integer, default=0, metavar="0/1",
                 help="0 or 1: the time is the host's wall clock per call either way")
  for dest, (short, long, _, _) in REFUSED.items():
    g.add_argument(short, long, dest=dest, default=None, metavar="V", help=argparse.SUPPRESS)


def nccl_tests_size(text: str) -> int:
  from jax_smddp.tools.sizes import parse_size
  return parse_size(text)


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Refuses (p.error: the message and exit status 2) what cannot run as nccl-tests means it."""
  for dest, (short, long, accepted, why) in REFUSED.items():
    value = getattr(args, dest)
    if value is None:
      continue
    try:
      number = int(value, 0)
    except ValueError:
      number = None
    if number not in accepted:
      p.error(f"{short}/{long} {value}: {why}"
              + (f" (only {short} {accepted[0]} is accepted)" if accepted else ""))
  if args.op != "sum":
    p.error(f"-o/--op {args.op}: only sum is benchmarked (jax_smddp.psum, psum_scatter); "
            "all_gather and all_to_all take no reduction")
  if args.average is not None and args.average not in AVERAGE:
    p.error(f"-a/--average {args.average}: 0 (process 0), 1 (mean), 2 (min) or 3 (max)")
  if args.average is not None and args.slowest:
    p.error("--slowest and -a/--average both choose how a row's time is taken over the "
            "processes: give one")
  if args.check < 0:
    p.error(f"-c/--check {args.check}: 0 skips the check, 1 or more checks")
  if args.report_cputime not in (0, 1):
    p.error(f"-C/--report_cputime {args.report_cputime}: 0 or 1")
  if args.step_factor <= 1 and args.stepbytes < 1:
    p.error("-i/--stepbytes must be at least 1 byte when -f is 1")
  if args.average is None:
    args.average = 1


def over_processes(per_process: list[list[dict]], n: int, average: int) -> list[dict]:
  """Rows whose time is each process's time of a call (its median over the calls) taken over
  the processes as nccl-tests' -a takes each rank's: 0 process 0's, 1 their mean, 2 the least,
  3 the largest (src/common.cu: BenchTime's Allreduce of deltaSec). algbw, busbw and speedup
  follow, and each process's p90_us is taken alike; each process's median is kept
  ("process_medians_us"); min_us is the fastest call of any process (of process 0 with -a 0).
  `per_process`: every process's rows, the same ops and sizes in the same order."""
  take = {0: lambda v: v[0], 1: statistics.fmean, 2: min, 3: max}[average]
  out = []
  for rows in zip(*per_process):
    r = copy.deepcopy(rows[0])
    size = nccl_tests.size_of(r["op"], r["bytes_per_rank"], n)
    r["process_medians_us"] = {}
    for impl in ("smddp", "lax", "mpi4jax"):
      times = [q[impl]["time_us"] for q in rows] if impl in r else [None]
      if None in times:  # not run (mpi4jax absent, or a 0-byte row's baseline)
        continue
      f = nccl_tests.figures(r["op"], size, n, take(times) / 1e6)
      r[impl].update({"time_us": f["time"], "algbw_gbs": f["algbw"], "busbw_gbs": f["busbw"]})
      if average:
        r[impl]["min_us"] = min(q[impl].get("min_us", q[impl]["time_us"]) for q in rows)
      r["process_medians_us"][impl] = times
      p90s = [q[impl].get("p90_us") for q in rows]
      if None not in p90s:  # taken over the processes as the medians are
        r[impl]["p90_us"] = round(take(p90s), 1)
    r["speedup"] = r["lax"]["time_us"] / r["smddp"]["time_us"] if r["lax"]["time_us"] else None
    if "mpi4jax" in r:
      r["vs_mpi4jax"] = r["mpi4jax"]["time_us"] / r["smddp"]["time_us"]
    r["statistic"] = f"-a {average}: {AVERAGE[average]} per call"
    out.append(r)
  return out
