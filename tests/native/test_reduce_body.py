"""The GPU reduction and copy kernels' per-thread work (cuda/reduce_body.cuh,
cuda/copy_body.cuh), built by nvcc as host code and run on the CPU
(tests/native/reduce_body_test.cu, copy_body_test.cu): every thread of a
launch in turn, with the vector width or unit the launcher chooses, on numpy
data, against numpy. What a GPU adds (the launch, the memory system) is
tested by tests/gpu on a GPU machine."""

import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from helpers import native_program

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(NVCC is None, reason="no nvcc: the install is CPU only")]

DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
          "i8": np.int8, "u8": np.uint8, "i32": np.int32, "u32": np.uint32, "i64": np.int64}


@pytest.fixture(scope="module")
def program():
  """tests/native/reduce_body_test.cu, built by CMake with nvcc as a host program."""
  return native_program("reduce_body_test")


@pytest.fixture(scope="module")
def copier():
  return native_program("copy_body_test")


def reference(sources, op, dtype):
  """op over the sources in order; 16-bit floats in f32, rounded once; ints wrap."""
  dtype = np.dtype(dtype)
  wide = np.float32 if dtype.itemsize == 2 and dtype.kind in "fV" else dtype
  acc = sources[0].astype(wide)
  for s in sources[1:]:
    s = s.astype(wide)
    acc = acc + s if op == "sum" else np.maximum(acc, s) if op == "max" else np.minimum(acc, s)
  return acc.astype(dtype)


def run(program, tmp_path, name, op, n, count, rows, spitch, dpitch, misalign, threads, seed=0,
        dests=1, unroll=1):
  """`dests`: the result stored into that many destinations (the program checks they agree);
  `unroll` 2: twice the vectors per thread where the launcher allows it."""
  dtype = np.dtype(DTYPES[name])
  rng = np.random.default_rng(seed)
  shape = (n, rows, spitch)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    data = rng.integers(info.min, info.max, size=shape, dtype=np.int64 if dtype.kind == "i"
                        else np.uint64, endpoint=True).astype(dtype)
  else:
    data = (rng.standard_normal(shape) * 10).astype(dtype)
  sentinel = np.full((rows, dpitch), 77, dtype)  # what the call must leave alone
  (tmp_path / "in").write_bytes(data.tobytes())
  (tmp_path / "out").write_bytes(sentinel.tobytes())
  run = subprocess.run([program, name, op, str(n), str(count), str(rows), str(spitch), str(dpitch),
                        str(misalign), str(threads), str(tmp_path / "in"), str(tmp_path / "out"),
                        str(dests), str(unroll)],
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stdout + run.stderr
  got = np.frombuffer((tmp_path / "out").read_bytes(), dtype).reshape(rows, dpitch)
  want = reference([data[k, :, :count] for k in range(n)], op, dtype)
  np.testing.assert_array_equal(got[:, :count], want, err_msg=f"{name} {op}")
  np.testing.assert_array_equal(got[:, count:], sentinel[:, count:], err_msg="past the rows")
  return int(run.stdout.split()[-1])


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_every_type_and_op_in_vectors(program, tmp_path, name, op):
  """Aligned rows: 16-byte vectors (4 floats, 8 bf16, 16 int8 per load), 3 sources, 5 rows
  with padding between them, more threads than vectors and fewer."""
  itemsize = np.dtype(DTYPES[name]).itemsize
  per16 = 16 // itemsize
  for threads in (7, 4096):
    width = run(program, tmp_path, name, op, n=3, count=per16 * 37, rows=5,
                spitch=per16 * 40, dpitch=per16 * 38, misalign=0, threads=threads, seed=threads)
    assert width == max(per16, 1), (name, width)


@pytest.mark.parametrize("name", ["f32", "bf16", "i8", "f64"])
@pytest.mark.parametrize("case", ["odd count", "odd pitch", "misaligned", "odd count, one row"])
def test_layouts_that_rule_out_vectors_fall_back_to_elements(program, tmp_path, name, case):
  """A row length, pitch or address that is not a multiple of 16 bytes: one element per
  load, same results. (One row: its pitch does not matter.)"""
  itemsize = np.dtype(DTYPES[name]).itemsize
  per16 = 16 // itemsize
  count, spitch, dpitch, misalign, rows = per16 * 9, per16 * 10, per16 * 10, 0, 4
  if case == "odd count":
    count += 1
  elif case == "odd pitch":
    spitch += 1
  elif case == "misaligned":
    misalign = itemsize
  else:
    count, rows, spitch, dpitch = per16 * 9 + 1, 1, per16 * 9 + 3, per16 * 9 + 5
  width = run(program, tmp_path, name, "sum", n=2, count=count, rows=rows, spitch=spitch,
              dpitch=dpitch, misalign=misalign, threads=33)
  assert width == 1, (case, width)


def test_one_row_ignores_its_pitches(program, tmp_path):
  """With one row the pitches never move an address: vectors still apply."""
  width = run(program, tmp_path, "f32", "sum", n=5, count=4 * 100, rows=1, spitch=4 * 100 + 3,
              dpitch=4 * 100 + 1, misalign=0, threads=64)
  assert width == 4


@pytest.mark.parametrize("n", [1, 2, 5, 32])
def test_source_counts_around_the_unrolled_loop(program, tmp_path, n):
  """The sources' loop is unrolled by 4: counts below, at and past it, and the most one pass
  takes."""
  width = run(program, tmp_path, "f32", "sum", n=n, count=4 * 50, rows=3, spitch=4 * 52,
              dpitch=4 * 51, misalign=0, threads=100, seed=n)
  assert width == 4


@pytest.mark.parametrize("name", ["f32", "bf16", "i8"])
@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("rows", [1, 3])
def test_vectors_around_each_threads_unrolled_batch(program, tmp_path, name, extra, rows):
  """Each thread reduces several vectors at once (4; 2 for 16 int8 per vector): vector counts
  one short of, at and one past a whole batch per thread, in one row (no division) and several."""
  itemsize = np.dtype(DTYPES[name]).itemsize
  per16 = 16 // itemsize
  threads, unroll = 5, (4 if per16 <= 8 else 2)
  per_row = threads * unroll * 2 + extra  # a row alone spans two batches, give or take one
  width = run(program, tmp_path, name, "sum", n=3, count=per16 * per_row, rows=rows,
              spitch=per16 * (per_row + 2), dpitch=per16 * (per_row + 1), misalign=0,
              threads=threads, seed=extra + 10)
  assert width == per16


@pytest.mark.parametrize("name", ["f32", "bf16", "i32", "f64", "i8"])
@pytest.mark.parametrize("dests", [1, 2, 8])
@pytest.mark.parametrize("unroll", [1, 2])
def test_one_reduction_into_several_destinations(program, tmp_path, name, dests, unroll):
  """all_reduce in one round (LaunchReduceToEach): every destination holds the reduction;
  with twice the vectors per thread (4- and 8-byte elements; others as once), vector counts
  past a batch per thread, several rows, and a tail of single elements in the second case."""
  per16 = 16 // np.dtype(DTYPES[name]).itemsize
  for count, rows, threads in ((per16 * 83, 3, 7), (per16 * 83 + 1, 1, 64)):
    width = run(program, tmp_path, name, "sum", n=3, count=count, rows=rows,
                spitch=count + per16 * 2, dpitch=count + per16, misalign=0, threads=threads,
                seed=dests * 10 + unroll, dests=dests, unroll=unroll)
    assert width == (per16 if count % per16 == 0 else 1)


def copy(copier, tmp_path, width, rows, spitch, dpitch, src_misalign, dst_misalign, threads):
  rng = np.random.default_rng(width * 31 + rows)
  src = rng.integers(0, 256, size=(rows, spitch), dtype=np.uint8)
  before = rng.integers(0, 256, size=(rows, dpitch), dtype=np.uint8)
  (tmp_path / "in").write_bytes(src.tobytes())
  (tmp_path / "out").write_bytes(before.tobytes())
  run = subprocess.run([copier, *map(str, (width, rows, spitch, dpitch, src_misalign, dst_misalign,
                                            threads)), str(tmp_path / "in"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stdout + run.stderr
  got = np.frombuffer((tmp_path / "out").read_bytes(), np.uint8).reshape(rows, dpitch)
  want = before.copy()
  want[:, :width] = src[:, :width]
  np.testing.assert_array_equal(got, want)
  return int(run.stdout.split()[-1])


@pytest.mark.parametrize("threads", [1, 3, 512, 4096])
@pytest.mark.parametrize("width,rows,spitch,dpitch,src_mis,dst_mis,unit", [
    (16 * 100, 7, 16 * 104, 16 * 101, 0, 0, 16),   # aligned rows: 16-byte units
    (16 * 100 + 4, 3, 16 * 110, 16 * 110, 0, 0, 4),  # a row length of 4-byte multiples
    (1000, 5, 1016, 1008, 4, 8, 4),                  # 4-byte aligned addresses
    (999, 4, 1003, 1001, 0, 0, 1),                   # odd everything: bytes
    (1600, 2, 1600, 1600, 1, 0, 1),                  # a misaligned source
    (1600, 1, 1605, 1607, 0, 0, 16),                 # one row: its pitches do not matter
    (48, 1000, 64, 48, 0, 0, 16),                    # many short rows (units wrap rows)
])
def test_copy_units_and_unrolled_threads(copier, tmp_path, threads, width, rows, spitch, dpitch,
                                         src_mis, dst_mis, unit):
  """Every unit size the launcher picks, with fewer threads than units (each thread's
  four loads in flight, then their stores) and more; bytes past each row are left alone."""
  assert copy(copier, tmp_path, width, rows, spitch, dpitch, src_mis, dst_mis, threads) == unit
