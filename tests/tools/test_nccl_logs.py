"""The reader of nccl-tests' logs (jax_smddp/tools/bench/nccl_tests.py, --nccl-tests of both
benchmarks): real outputs of NCCL 2.5 to 2.31 posted in public issues (tests/tools/data/README.md
says where each is from), each checked against what it shows (written out here) and against
nccl-tests' own arithmetic; launchers' prefixes; a log of several runs or collectives; several
logs. Under the real launchers: tests/tools/test_nccl_logs_launchers.py."""

from __future__ import annotations

import os

import pytest

from jax_smddp.tools.bench import nccl_tests

DATA = os.path.join(os.path.dirname(__file__), "data")

# file: (op, ranks the log lists, ranks of the run (for the arithmetic), item size, rows,
#        the first row's size, count, type, time, algbw, busbw, #wrong, in-place #wrong)
REAL = {
    "nccl-2.5.7_all_reduce_mpirun.log":  # named by its mpirun command line
        ("all_reduce", None, 32, 4, 2, (8, 2, "float", 77.80, 0.0, 0.0, 2e-07, 2e-07)),
    "nccl-2.8.4_all_reduce_256ranks.log":  # -c 0: no check, error N/A
        ("all_reduce", None, 256, 4, 6, (33554432, 8388608, "float", 1464.2, 22.92, 45.65, None,
                                         None)),
    "alltoall_perf_64ranks_2021.log":  # its file name alone names it
        ("all_to_all", None, 64, 4, 2, (268435456, 1048576, "float", 520935, 0.52, 0.51, 0, 1)),
    "nccl-tests-2.13.6_all_gather_1rank.log":
        ("all_gather", 1, 1, 4, 1, (33554432, 8388608, "float", 18.48, 1816.16, 0.0, 0, 0)),
    "reduce_scatter_perf_2x4gpus_2023.log":
        ("reduce_scatter", None, 8, 4, 7, (0, 0, "float", 5.70, 0.0, 0.0, 0, 0)),
    "all_gather_bfloat16_2024.log":
        ("all_gather", None, 2, 2, 7, (16777216, 4194304, "bfloat16", 108.8, 154.20, 77.10, 0, 0)),
    "alltoall_1rank_2025.log":
        ("all_to_all", 1, 1, 4, 1, (33554432, 8388608, "float", 19.56, 1715.44, 0.0, 0, None)),
    "nccl-2.30.4_alltoall_4ranks.log":
        ("all_to_all", 4, 4, 4, 1, (524288000, 32768000, "float", 1174.14, 446.53, 334.90, 0,
                                    None)),
    "nccl-2.31.2_all_reduce_2ranks.log":
        ("all_reduce", 2, 2, 4, 4, (8192, 2048, "float", 35.15, 0.23, 0.23, 0, 0)),
}


def _text(name: str) -> str:
  with open(os.path.join(DATA, name)) as f:
    return f.read()


def _summary(table: dict) -> tuple:
  return (table["op"], table["ranks"], [
      (r["size"], r["count"], r["type"], r["redop"], r["root"], r["time"], r["algbw"], r["busbw"],
       r["#wrong"], r["in_place"]) for r in table["rows"]])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(REAL))
def test_reads_real_outputs_of_nccl_2_5_to_2_31(name):
  op, ranks, n, itemsize, nrows, first = REAL[name]
  (table,) = nccl_tests.read_logs(os.path.join(DATA, name))
  assert (table["op"], table["ranks"], len(table["rows"]), table["runs"]) == (op, ranks, nrows, 1)
  r = table["rows"][0]
  got = (r["size"], r["count"], r["type"], r["time"], r["algbw"], r["busbw"], r["#wrong"],
         r["in_place"]["#wrong"])
  assert got == first
  assert r["redop"] == nccl_tests.redop(op) and r["root"] == -1
  for row in table["rows"]:
    # nccl-tests' arithmetic (src/*.cu): count is the whole buffer for AllReduce, one rank's
    # block otherwise; busbw = algbw x 2(n-1)/n (AllReduce) or (n-1)/n; algbw = S / time.
    assert row["count"] * itemsize * (1 if op == "all_reduce" else n) == row["size"]
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    for q in (row, row["in_place"]):
      assert q["busbw"] == pytest.approx(q["algbw"] * factor, abs=0.016, rel=0.005)
    if row["time"] >= 10:
      assert row["algbw"] == pytest.approx(row["size"] / row["time"] / 1e3, abs=0.006, rel=0.005)


# What launchers put before each line (the task's number in it): Open MPI 4's and 5's
# --tag-output, 5's tag-detailed and tag-fullname, --timestamp-output (4 unbracketed, 5
# bracketed), srun --label (padded where there are 10 tasks or more), MPICH's -l, a time stamp.
PREFIXES = {
    "ompi4": lambda t: f"[1,{t}]<stdout>:",
    "ompi5": lambda t: f"[1,{t}]<stdout>: ",
    "ompi5-detailed": lambda t: f"[1,{t}][node-7:{4000 + t}]<stdout>: ",
    "ompi5-fullname": lambda t: f"[prterun-node-7-4000@1,{t}]<stdout>: ",
    "ompi5-timestamp": lambda t: f"[Wed Dec  2 14:31:53 2026][1,{t}]<stdout>: ",
    "ompi4-timestamp": lambda t: f"Tue Aug 14 09:23:30 2018[1,{t}]<stdout>:",
    "srun": lambda t: f"{t}: ",
    "srun-12-tasks": lambda t: f"{t:>2}: ",
    "mpich": lambda t: f"[{t}] ",
    "iso-srun": lambda t: f"2026-12-02T14:31:53.123456Z {t}: ",
}


def _prefixed(text: str, prefix, others: str = "", tasks: int = 2) -> str:
  """`text` as task 0 printed it under a launcher, lines of the other tasks (`others`, each)
  mixed in after every other line of task 0's."""
  own = [prefix(0) + line for line in text.splitlines()]
  rest = [[prefix(t) + line for line in others.splitlines()] for t in range(1, tasks)]
  out = []
  for i, line in enumerate(own):
    out.append(line)
    for lines in rest:
      if i % 2 and lines:
        out.append(lines.pop(0))
  for lines in rest:
    out += lines
  return "\n".join(out) + "\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("launcher", sorted(PREFIXES))
def test_launchers_prefixes_read_as_the_plain_log(launcher):
  """An MPI launch: task 0 prints the tables, the others NCCL's lines; or a launch without MPI:
  every task prints its own whole run (of its own ranks, here 1 each): one table, of 1 rank."""
  prefix = PREFIXES[launcher]
  tasks = 12 if launcher == "srun-12-tasks" else 2
  nccl_info = "node-7:4001:4001 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>\n" * 3
  for name in ("nccl-2.31.2_all_reduce_2ranks.log", "nccl-2.30.4_alltoall_4ranks.log",
               "alltoall_perf_64ranks_2021.log", "nccl-2.5.7_all_reduce_mpirun.log"):
    plain = nccl_tests.parse_log(_text(name), name)
    got = nccl_tests.parse_log(_prefixed(_text(name), prefix, nccl_info, tasks), name)
    assert _summary(got) == _summary(plain), (launcher, name)
  own = _text("nccl-tests-2.13.6_all_gather_1rank.log")
  got = nccl_tests.parse_log(_prefixed(own, prefix, own, tasks), "log")
  assert _summary(got) == _summary(nccl_tests.parse_log(own)) and got["runs"] == tasks
  # A log that names its collective only on the command typed before the launcher's lines.
  old = _text("alltoall_perf_64ranks_2021.log")
  typed = "$ mpirun -n 64 --tag-output ./build/alltoall_perf -b 256M -e 512M\n"
  got = nccl_tests.parse_log(typed + _prefixed(old, prefix, nccl_info, tasks), "saved.txt")
  assert _summary(got) == _summary(nccl_tests.parse_log(old, "alltoall_perf_64ranks_2021.log"))


@pytest.mark.timeout(30)
def test_concatenated_runs_of_a_launch_without_mpi_count_each_rank_once():
  """Each process of a launch without MPI printed its own run ("Rank 0" each), the outputs
  concatenated, or interleaved line by line: one table of 1 rank, not of 2."""
  one = _text("alltoall_1rank_2025.log")
  plain = nccl_tests.parse_log(one)
  table = nccl_tests.parse_log(one + one)
  assert _summary(table) == _summary(plain) and table["runs"] == 2
  lines = one.splitlines()
  interleaved = "\n".join(x for pair in zip(lines, lines) for x in pair)
  assert _summary(nccl_tests.parse_log(interleaved)) == _summary(plain)
  # An MPI launch lists each rank once: as many ranks as lines.
  assert nccl_tests.parse_log(_text("nccl-2.30.4_alltoall_4ranks.log"))["ranks"] == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prefix", ["", "[0] "])
def test_rows_cut_by_nccl_debug_lines(prefix):
  """With NCCL_DEBUG=INFO, what NCCL prints while nccl-tests times a row lands after the row's
  head and after its out-of-place group, on the row's own line (the launcher's prefix, if any,
  before it: NVIDIA/nccl issue 1453's log): the row's pieces are joined."""
  name = "nccl-2.31.2_all_reduce_2ranks.log"
  info = "gpu-node-1:4711:4711 [0] NCCL INFO {} Bytes -> Algo 1 proto 2 time 35.1"
  out = []
  for line in _text(name).splitlines():
    f = line.split()
    if not f or not f[0].isdigit():
      out.append(prefix + line)
      continue
    glued = prefix + info.format(f[0])
    out += [prefix + "  ".join(f[:5]) + glued, glued, prefix + "  ".join(f[5:9]) + glued,
            prefix + "  ".join(f[9:])]
  got = nccl_tests.parse_log("\n".join(out), name)
  assert _summary(got) == _summary(nccl_tests.parse_log(_text(name), name))


BROADCAST = """# Collective test starting: broadcast_perf
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
        1024           256     float    none       0    10.00    0.10    0.10      0    10.00    0.10    0.10      0
"""


@pytest.mark.timeout(30)
def test_a_log_of_several_binaries_gives_a_table_per_collective(tmp_path):
  """Binaries run one after another into one file (here also one we do not compare, and an
  all_reduce at another rank count): one table per collective and rank count, each labelled
  with its log, where in it, and its ranks."""
  reduce2 = _text("nccl-2.31.2_all_reduce_2ranks.log")
  a2a = _text("nccl-2.30.4_alltoall_4ranks.log")
  reduce256 = _text("nccl-2.8.4_all_reduce_256ranks.log")
  path = tmp_path / "sweep.log"
  path.write_text(reduce2 + BROADCAST + a2a + reduce256)
  tables = nccl_tests.read_logs(str(path))
  assert [(t["op"], t["ranks"], len(t["rows"])) for t in tables] == \
      [("all_reduce", 2, 4), ("all_to_all", 4, 1), ("all_reduce", None, 6)]
  # Where each run starts: its first nccl-tests line (the version, nThread or column header).
  starts = [len(before.splitlines()) + next(
      i for i, line in enumerate(part.splitlines(), 1)
      if line.startswith(("# nccl-tests version", "# nThread", "#       size")))
            for before, part in (("", reduce2), (reduce2 + BROADCAST, a2a),
                                 (reduce2 + BROADCAST + a2a, reduce256))]
  assert [t["line"] for t in tables] == starts == [1, 21, 40]
  assert tables[0]["label"] == f"{path}, line 1, 2 ranks"
  for t, name in zip(tables, ("nccl-2.31.2_all_reduce_2ranks.log",
                              "nccl-2.30.4_alltoall_4ranks.log",
                              "nccl-2.8.4_all_reduce_256ranks.log")):
    assert _summary(t)[2] == _summary(nccl_tests.parse_log(_text(name), name))[2]
  with pytest.raises(nccl_tests.LogError, match="holds 3 tables"):
    nccl_tests.read_log(str(path))
  with pytest.raises(nccl_tests.LogError, match="broadcast_perf output; the benchmarks compare"):
    nccl_tests.parse_logs(BROADCAST, "b.log")


@pytest.mark.timeout(30)
def test_several_logs_compare_each_as_its_own_table():
  """Two logs of one op, and one of another: each comparison block names its collective, log
  and ranks; our row's own fields come from the first log with the size."""
  a = nccl_tests.read_logs(os.path.join(DATA, "nccl-2.31.2_all_reduce_2ranks.log"))
  b = nccl_tests.read_logs("all_reduce:" + os.path.join(DATA, "nccl-2.5.7_all_reduce_mpirun.log"))
  c = nccl_tests.read_logs(os.path.join(DATA, "nccl_tests_all_gather_2ranks.log"))
  ours = [{"op": "all_reduce", "size": 8192, "time": 70.3, "busbw": 0.115, "ranks": 2},
          {"op": "all_reduce", "size": 16, "time": 151.46, "busbw": 0.0001, "ranks": 2},
          {"op": "all_gather", "size": 65536, "time": 19.06, "busbw": 1.72, "ranks": 2}]
  pairs = nccl_tests.compare(ours, a + b + c)
  assert [(p["op"], p["size"], p["nccl_tests_table"]) for p in pairs] == [
      ("all_reduce", 8192, a[0]["label"]), ("all_reduce", 16, b[0]["label"]),
      ("all_gather", 65536, c[0]["label"])]
  assert ours[0]["busbw_vs_nccl_tests"] == pytest.approx(0.5)
  assert ours[1]["time_vs_nccl_tests"] == pytest.approx(2.0)
  text = nccl_tests.comparison_table("all_reduce", pairs)
  assert text.count("# all_reduce vs nccl-tests (") == 2, text
  assert f"({a[0]['label']})" in text and "nccl-2.31.2_all_reduce_2ranks.log, 2 ranks" in text
  assert f"({b[0]['label']})" in text and "all_gather" not in text


@pytest.mark.timeout(30)
def test_which_collective_a_log_is(tmp_path):
  """Its own lines first, then OP:PATH, then its file name; named nowhere: how to name it."""
  text = _text("alltoall_perf_64ranks_2021.log")
  with pytest.raises(nccl_tests.LogError, match="give it as OP:PATH with OP one of all_gather"):
    nccl_tests.parse_logs(text, "saved.txt")
  assert nccl_tests.parse_log(text, "saved.txt", op="all_to_all")["op"] == "all_to_all"
  for name in ("alltoall.log", "nccl-2.7.8-all_to_all.txt", "AllToAll_8gpus.out"):
    (tmp_path / name).write_text(text)
    assert nccl_tests.read_log(str(tmp_path / name))["op"] == "all_to_all", name
  (tmp_path / "allreduce_allgather.log").write_text(text)  # names two: none
  with pytest.raises(nccl_tests.LogError, match="OP:PATH"):
    nccl_tests.read_log(str(tmp_path / "allreduce_allgather.log"))
  # The log's own name beats the file name and must agree with OP:
  own = _text("nccl-2.30.4_alltoall_4ranks.log")
  (tmp_path / "all_gather_perf.log").write_text(own)
  assert nccl_tests.read_log(str(tmp_path / "all_gather_perf.log"))["op"] == "all_to_all"
  with pytest.raises(nccl_tests.LogError, match="says it ran all_to_all, not all_reduce"):
    nccl_tests.read_log("all_reduce:" + str(tmp_path / "all_gather_perf.log"))
  # In a log of several runs, OP: names those that name nothing.
  mixed = tmp_path / "mixed.txt"
  mixed.write_text(_text("nccl-2.31.2_all_reduce_2ranks.log") + text)
  with pytest.raises(nccl_tests.LogError, match="line 18: cannot tell which collective"):
    nccl_tests.read_logs(str(mixed))
  assert [t["op"] for t in nccl_tests.read_logs(f"all_to_all:{mixed}")] == \
      ["all_reduce", "all_to_all"]
  # A packaged build's binary name (srun --mpi=pmix all_reduce_perf_mpi ...).
  plain = _text("nccl-2.8.4_all_reduce_256ranks.log").replace("all_reduce_perf", "all_gather_perf_mpi")
  assert nccl_tests.parse_log(plain)["op"] == "all_gather"


@pytest.mark.timeout(30)
def test_columns_are_read_by_their_header_names():
  """nccl-tests 2.19's -I 1 (per-iteration columns after each group) and -S (a time stamp
  after the row), and -C 1 (cputime): the header's names say which value is which (src/util.cu,
  writeResultHeader and writeBenchmarkLineBody)."""
  head = ("#       size         count      type   redop    root     time   algbw   busbw  #wrong"
          "    i_min    i_max    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min"
          "    i_max    i_p99    i_cv%           timestamp\n")
  row = ("       65536         16384     float     sum      -1    67.93    0.96    0.96       0"
         "    60.01    80.02    79.03     3.04    64.71    1.01    1.01       0    61.05    70.06"
         "    69.07     2.08  2026-07-09 10:00:00\n")
  got = nccl_tests.parse_log("# Collective test starting: all_reduce_perf\n" + head + row)
  (r,) = got["rows"]
  assert (r["time"], r["algbw"], r["busbw"], r["#wrong"]) == (67.93, 0.96, 0.96, 0)
  assert r["in_place"] == {"time": 64.71, "algbw": 1.01, "busbw": 1.01, "#wrong": 0}
  cpu = head.replace(" time", "cputime").split("    i_min")[0] + "\n"
  got = nccl_tests.parse_log("all_reduce_perf -C 1\n" + cpu + row.split("    60.01")[0] + "\n")
  assert got["rows"][0]["time"] == 67.93 and got["rows"][0]["in_place"] is None


@pytest.mark.timeout(120)
def test_the_benchmark_compares_with_each_table_of_each_log(tmp_path):
  """`--nccl-tests` given twice, the first a log of two binaries kept by mpirun --tag-output:
  one comparison per table of the ops run, each named; the JSON lists every table."""
  import json
  import subprocess
  import sys
  prefixed = "".join(f"[1,0]<stdout>: {line}\n"
                     for line in _text("nccl-2.31.2_all_reduce_2ranks.log").splitlines())
  sweep = tmp_path / "sweep.log"
  sweep.write_text(prefixed + _text("nccl-2.30.4_alltoall_4ranks.log"))
  second = os.path.join(DATA, "nccl-2.31.2_all_reduce_2ranks.log")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(
      ("JAX_SMDDP_", "OMPI_", "PMIX_", "SLURM_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
  proc = subprocess.run([sys.executable, "-m", "jax_smddp.tools.bench", "--quick", "--devices", "2",
                         "--ops", "all_reduce", "-b", "8K", "-e", "8K", "--no-plot", "--json",
                         str(tmp_path / "b.json"), "--nccl-tests", str(sweep), "--nccl-tests",
                         second], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=110)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  titles = [line.split(":")[0] for line in proc.stdout.splitlines()
            if line.startswith("# all_reduce vs nccl-tests")]
  assert titles == [f"# all_reduce vs nccl-tests ({sweep}, line 1, 2 ranks)",
                    f"# all_reduce vs nccl-tests ({second}, 2 ranks)"], proc.stdout[-3000:]
  assert "also hold all_to_all, which this run did not time" in proc.stdout
  meta = json.loads((tmp_path / "b.json").read_text())["meta"]["nccl_tests"]
  assert [(g["path"], g["op"], g["ranks"], g["rows"], g["line"]) for g in meta["logs"]] == [
      (str(sweep), "all_reduce", 2, 4, 1), (str(sweep), "all_to_all", 4, 1, 18),
      (second, "all_reduce", 2, 4, 1)]
  assert [p["nccl_tests_busbw"] for p in meta["comparison"]] == [0.23, 0.23]
