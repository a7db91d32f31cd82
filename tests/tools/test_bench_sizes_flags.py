"""The benchmark's sizes are nccl-tests' sizes, row for row, and its command line takes
nccl-tests' flags (issue 67, items 3 and 5): each size rule below is written out here from
nccl-tests' sources (src/common.cu, all_gather.cu, reduce_scatter.cu, all_reduce.cu,
alltoall.cu, NVIDIA/nccl-tests 2.19), independently of jax_smddp/tools/bench/nccl_tests.py."""

import json
import os
import subprocess
import sys

import pytest

from jax_smddp.tools.bench import core, nccl_flags, nccl_tests
from jax_smddp.tools.bench.options import parse_args, selected_sizes
from jax_smddp.tools.sizes import parse_size

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
ITEMSIZE = {"int8": 1, "half": 2, "float": 4, "double": 8}


def nccl_tests_rows(op: str, minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int,
                    nranks: int, word: int) -> list[tuple[int, int]]:
  """(size, count) of each row nccl-tests prints, as its TimeTest loop, setupArgs and the op's
  GetCollByteCount compute them (sizes in bytes, counts in elements)."""
  out, size = [], minbytes
  while size <= maxbytes:
    count = size // word
    align = 16 // word  # (count/nranks) & ~(16/eltSize - 1): whole 16 bytes per block
    if op == "all_reduce":
      send = recv = param = count
    else:
      base = (count // nranks) // align * align
      send, recv, param = {"all_gather": (base, base * nranks, base),
                           "reduce_scatter": (base * nranks, base, base),
                           "all_to_all": (base * nranks, base * nranks, base)}[op]
    out.append((max(send, recv) * word, param))  # writeBenchmarkLinePreamble(max(...), nbytes/word)
    size = size * stepfactor if stepfactor > 1 else size + stepbytes
  return out


def our_rows(op: str, argv: list[str], n: int, word: int) -> list[tuple[int, int]]:
  """(size, count) of our rows for a command line: the sweep the CLI selects, the per-rank
  input run_benchmark gives each row, and the size and count core.nccl_row prints for it."""
  args = parse_args(argv)
  dtype = core.to_dtype(args.dtype)
  assert dtype.itemsize == word
  out = []
  for size in nccl_tests.row_sizes(op, selected_sizes(args), n, word):
    row = {"op": op, "bytes_per_rank": nccl_tests.input_bytes(op, size, n),
           "smddp": {"time_us": 1.0, "algbw_gbs": 0.0, "busbw_gbs": 0.0},
           "lax": {"time_us": 1.0, "algbw_gbs": 0.0, "busbw_gbs": 0.0}}
    core.nccl_row(row, n, dtype)
    out.append((row["size"], row["count"]))
  return out


SWEEPS = [("8", "128M", "2", "1M"), ("64", "8K", "2", "1M"), ("1000", "1M", "3", "1M"),
          ("4", "600", "1", "52"), ("1K", "9K", "1", "1K"), ("7", "100", "2", "1")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", OPS)
def test_rows_are_nccl_tests_rows_for_1_to_64_ranks(op):
  for n in range(1, 65):
    for b, e, f, i in SWEEPS:
      for dtype, word in ITEMSIZE.items():
        want = nccl_tests_rows(op, parse_size(b), parse_size(e), int(f), parse_size(i), n,
                               word)
        got = our_rows(op, ["-b", b, "-e", e, "-f", f, "-i", i, "-d", dtype], n, word)
        assert got == want, (op, n, b, e, f, i, dtype)


def test_the_issues_three_rank_example():
  """Issue 67: 3 ranks, -b 64 -e 8K, float: all_gather's first rows and all_reduce's."""
  argv = ["-b", "64", "-e", "8K"]
  assert our_rows("all_gather", argv, 3, 4)[:4] == [(48, 4), (96, 8), (240, 20), (480, 40)]
  assert our_rows("all_reduce", argv, 3, 4)[:3] == [(64, 16), (128, 32), (256, 64)]
  # -b 8: nccl-tests' all_gather starts at 8 bytes of sweep, its rows at 0 bytes until a rank's
  # block holds 16 bytes
  assert our_rows("all_gather", ["-b", "8", "-e", "64"], 3, 4) == [(0, 0), (0, 0), (0, 0),
                                                                   (48, 4)]


def test_the_sweep_steps_as_nccl_tests():
  assert nccl_tests.sweep(8, 64, 2) == [8, 16, 32, 64]
  assert nccl_tests.sweep(1 << 20, 4 << 20, 1) == [1 << 20, 2 << 20, 3 << 20, 4 << 20]  # -i 1M
  assert nccl_tests.sweep(100, 400, 1, 100) == [100, 200, 300, 400]
  assert selected_sizes(parse_args(["-b", "4K", "-e", "12K", "-f", "1", "-i", "4K"])) == \
      [4096, 8192, 12288]


# nccl-tests' getopt string and long names (src/common.cu, main)
GETOPT = "t:g:b:e:i:f:n:m:w:N:p:I:K:c:o:d:r:z:y:T:hG:C:a:R:x:D:V:J:S:M:u:"
LONG = {"t": "nthreads", "g": "ngpus", "b": "minbytes", "e": "maxbytes", "i": "stepbytes",
        "f": "stepfactor", "n": "iters", "m": "agg_iters", "w": "warmup_iters", "N": "run_cycles",
        "p": "parallel_init", "c": "check", "o": "op", "d": "datatype", "r": "root",
        "z": "blocking", "y": "stream_null", "T": "timeout", "G": "cudagraph",
        "C": "report_cputime", "S": "report_timestamps", "J": "output_file", "a": "average",
        "R": "local_register", "x": "cta_policy", "D": "device_implementation",
        "V": "device_cta_count", "M": "memory", "u": "unalign", "I": "per_iter_timing",
        "K": "per_iter_skip"}
# Flags honoured: nccl-tests' value -> what the parsed options hold
HONOURED = {"b": ("64", "min_bytes", 64), "e": ("1M", "max_bytes", 1 << 20),
            "i": ("2K", "stepbytes", 2048), "f": ("4", "step_factor", 4),
            "n": ("7", "iters", 7), "w": ("2", "warmup", 2), "c": ("0", "check", 0),
            "o": ("sum", "op", "sum"), "d": ("half", "dtype", "float16"),
            "T": ("60", "timeout", 60), "a": ("3", "average", 3), "r": ("2", "root", 2),
            "C": ("1", "report_cputime", 1), "g": ("1", "ngpus", "1"), "t": ("1", "nthreads", "1")}
# Flags refused: a value nccl-tests takes that cannot run here
REFUSED = {"g": "2", "t": "4", "m": "8", "N": "3", "p": "1", "z": "1", "y": "1", "G": "5",
           "S": "1", "J": "out.json", "R": "1", "x": "1", "D": "1", "V": "16", "M": "1", "u": "1",
           "I": "1", "K": "2", "o": "max", "a": "4", "d": "f8e4m3"}


def test_every_nccl_tests_flag_is_known():
  flags = [c for c in GETOPT if c != ":"]
  assert sorted(flags) == sorted(list(LONG) + ["h"])
  assert set(HONOURED) | set(REFUSED) == set(LONG)


@pytest.mark.parametrize("flag", sorted(HONOURED))
def test_honoured_flags(flag):
  value, dest, want = HONOURED[flag]
  for name in (f"-{flag}", f"--{LONG[flag]}"):
    args = parse_args([name, value] + (["-e", "4M"] if flag == "b" else []))
    assert getattr(args, dest) == want, name


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_say_why(flag, capsys):
  for name in (f"-{flag}", f"--{LONG[flag]}"):
    with pytest.raises(SystemExit) as e:
      parse_args([name, REFUSED[flag]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert "unrecognized" not in err and f"-{flag}" in message, message
    assert len(message.split(": ", 2)[-1].split()) >= 5, f"no reason given: {message}"


@pytest.mark.parametrize("name", ["float8", "f8e5m2", "uint64", "all", "complex64"])
def test_an_unsupported_dtype_is_refused_at_parsing(name, capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(["--dtype", name])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "choose from" in err and "float" in err and "bfloat16" in err and "half" in err


def test_nccl_tests_type_names():
  for nccl, ours in (("float", "float32"), ("half", "float16"), ("double", "float64"),
                     ("bfloat16", "bfloat16"), ("int32", "int32"), ("int8", "int8"),
                     ("uint8", "uint8"), ("uint32", "uint32"), ("int64", "int64"),
                     ("float32", "float32")):
    assert parse_args(["-d", nccl]).dtype == ours
    assert nccl_tests.type_name(core.to_dtype(ours)) == nccl or nccl == "float32"


def _rows(times: list[float], lax: list[float | None]) -> list[list[dict]]:
  """Every process's row of one all_reduce size, with its median per call (us)."""
  return [[{"op": "all_reduce", "bytes_per_rank": 1 << 20,
            "smddp": {"time_us": t, "min_us": t - 1},
            "lax": {"time_us": b, "min_us": b and b - 1}, "samples_us": {}}]
          for t, b in zip(times, lax)]


@pytest.mark.parametrize("average,want", [(0, 100.0), (1, 300.0), (2, 100.0), (3, 600.0)])
def test_average_over_processes_as_nccl_tests_a(average, want):
  """nccl-tests' -a: rank 0's time, the ranks' mean, min or max (src/common.cu, Allreduce)."""
  n = 8  # 4 processes of 2 devices
  rows = nccl_flags.over_processes(_rows([100.0, 200.0, 600.0, 300.0], [400.0] * 4), n,
                                   average)
  r = rows[0]
  assert r["smddp"]["time_us"] == pytest.approx(want)
  algbw = (1 << 20) / (want * 1e-6) / 1e9  # S / time: all_reduce's S is the buffer
  assert r["smddp"]["algbw_gbs"] == pytest.approx(algbw)
  assert r["smddp"]["busbw_gbs"] == pytest.approx(algbw * 2 * (n - 1) / n)
  assert r["speedup"] == pytest.approx(400.0 / want)
  assert r["process_medians_us"]["smddp"] == [100.0, 200.0, 600.0, 300.0]
  nothing = nccl_flags.over_processes(_rows([100.0, 200.0], [None, None]), 2, average)[0]
  assert nothing["lax"]["time_us"] is None and nothing["speedup"] is None


def test_the_default_average_is_nccl_tests_and_slowest_stays_apart(capsys):
  assert parse_args([]).average == 1
  assert parse_args(["--slowest"]).slowest
  with pytest.raises(SystemExit):
    parse_args(["--slowest", "-a", "1"])
  assert "give one" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_run_prints_nccl_tests_rows_zero_bytes_included(tmp_path):
  """3 ranks, -b 8 -e 64: all_gather's rows are nccl-tests' (0, 0, 0 then 48 bytes), a 0-byte
  row timed for jax_smddp (jax.lax cannot lower it: N/A); -c 0 leaves #wrong unchecked."""
  out = tmp_path / "bench.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "jax_smddp.tools.bench", "--devices", "3", "--ops",
       "all_gather,all_reduce", "-b", "8", "-e", "64", "-n", "3", "-w", "1", "-c", "0",
       "--no-plot", "--json", str(out)], capture_output=True, text=True, env=env, timeout=280)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads(out.read_text())["results"]
  gather = [r for r in results if r["op"] == "all_gather"]
  assert [(r["size"], r["count"]) for r in gather] == [(0, 0), (0, 0), (0, 0), (48, 4)]
  assert gather[0]["smddp"]["time_us"] > 0 and gather[0]["lax"]["time_us"] is None
  assert gather[-1]["#wrong"] is None and gather[-1]["speedup"] > 0
  reduce = [r for r in results if r["op"] == "all_reduce"]
  assert [(r["size"], r["count"]) for r in reduce] == [(8, 2), (16, 4), (32, 8), (64, 16)]
  lines = [ln.split() for ln in proc.stdout.splitlines()]
  printed = [ln for ln in lines if len(ln) > 5 and ln[2] == "float" and ln[3] == "none"]
  assert [ln[:2] for ln in printed] == [["0", "0"]] * 3 + [["48", "4"]]
  assert printed[0][-2:] == ["N/A", "N/A"] and printed[-1][8] == "N/A"  # speedup; #wrong


@pytest.mark.parametrize("op", OPS)
def test_the_gpu_benchmark_runs_nccl_tests_rows(op):
  """gpu_bench -b/-e/-f/-i: each op's rows are nccl-tests' (float; its 0-byte rows left out),
  and each row's inputs and expected outputs are a real collective's (numpy, every rank)."""
  import argparse

  import numpy as np

  from jax_smddp.tools import gpu_bench
  for n in (1, 2, 3, 5, 8, 64):
    for b, e, f, i in SWEEPS:
      sweep = nccl_tests.sweep(parse_size(b), parse_size(e), int(f), parse_size(i))
      rows = gpu_bench._rows(op, argparse.Namespace(sweep=sweep, sizes=[]), n)
      want = [r for r in nccl_tests_rows(op, parse_size(b), parse_size(e), int(f),
                                         parse_size(i), n, 4) if r[0]]
      got = [(gpu_bench.nccl_figures({"op": op, "bytes_per_rank": 4 * local // n, "size": size,
                                      "ranks": n, "smddp_s": 1e-3})["size"],
              nccl_tests.count(op, size, n, 4)) for local, size in rows]
      assert got == want, (op, n, b, e, f, i)
  for n in (2, 3, 5):
    for local, _ in gpu_bench._rows(op, argparse.Namespace(sweep=[12, 64, 1000], sizes=[]), n):
      outputs = _numpy_outputs(op, [gpu_bench._input(op, r, n, local) for r in range(n)])
      for r in range(n):
        np.testing.assert_array_equal(outputs[r], gpu_bench._expected(op, r, n, local))


def _numpy_outputs(op: str, inputs: list) -> list:
  """Each rank's output of `op` on the ranks' `inputs`, by numpy."""
  import numpy as np
  n = len(inputs)
  if op == "all_gather":
    return [np.concatenate(inputs)] * n
  if op == "all_reduce":
    return [np.sum(inputs, axis=0)] * n
  if op == "reduce_scatter":
    return np.split(np.sum(inputs, axis=0), n)
  # all_to_all: rank r receives block r of every rank, in rank order
  return [np.concatenate([np.split(x, n)[r] for x in inputs]) for r in range(n)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("op", OPS)
def test_gpu_bench_bodies_run_the_engine_and_give_the_reference(op):
  """The GPU bench's programs (the CPU bench's calls, core.op_calls), run here on CPU devices:
  jax_smddp's calls the engine, and both give numpy's answer of _input (as above)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax_smddp.tools import gpu_bench
  n, local = 4, 12
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  x = jax.device_put(np.concatenate([gpu_bench._input(op, r, n, local) for r in range(n)]),
                     NamedSharding(mesh, P("x")))
  ours, lax = (jax.jit(jax.shard_map(b, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
               for b in gpu_bench._bodies(op))
  assert f"smddp_{op}" in ours.lower(x).as_text()
  assert "smddp_" not in lax.lower(x).as_text()
  want = np.stack(_numpy_outputs(op, [gpu_bench._input(op, r, n, local) for r in range(n)]))
  for f in (ours, lax):
    np.testing.assert_array_equal(np.asarray(f(x)), want)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("average,take", [("3", max), (None, lambda v: sum(v) / len(v))])
def test_two_processes_take_the_time_as_a_says(tmp_path, average, take):
  """--layout 2x1: a row's time is the processes' medians taken as -a says (default: mean)."""
  out = tmp_path / "bench.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "jax_smddp.tools.bench", "--layout", "2x1", "--ops", "all_reduce",
       "-b", "64", "-e", "128", "-n", "5", "-w", "1", "--no-plot", "--json", str(out)]
      + (["-a", average] if average else []), capture_output=True, text=True, env=env,
      timeout=180)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["meta"]["statistic"] == ("max" if average else "mean")
  assert data["meta"]["time_is"] in proc.stdout
  for r in data["results"]:
    for impl in ("smddp", "lax"):
      medians = r["process_medians_us"][impl]
      assert len(medians) == 2
      assert r[impl]["time_us"] == pytest.approx(take(medians))
