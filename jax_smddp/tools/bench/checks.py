"""The benchmark's inputs and their checks (:mod:`jax_smddp.tools.bench`): each rank's data,
numpy's independent answer for each op, and the comparisons that count and name wrong
elements (nccl-tests' #wrong)."""

from __future__ import annotations

import numpy as np

from jax_smddp.tools.sizes import format_size


def to_dtype(dtype) -> np.dtype:
  """np.dtype, also for names numpy alone does not know ("bfloat16")."""
  import jax.numpy as jnp
  return jnp.dtype(dtype)


def is_float(dtype) -> bool:
  import jax.numpy as jnp
  return bool(jnp.issubdtype(to_dtype(dtype), jnp.floating))


def make_input(nbytes: int, n: int, dtype, mesh, seed: int = 0):
  """A global 1-D array of n x nbytes, sharded so each rank holds nbytes (every
  process builds the same host data and places its own shards)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  host = host_input(nbytes, n, dtype, seed)
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                     lambda index: host[index])


def host_input(nbytes: int, n: int, dtype, seed: int = 0) -> np.ndarray:
  """The host data of make_input: n blocks of nbytes, distinct values."""
  dtype = to_dtype(dtype)
  count = nbytes // dtype.itemsize
  if count * dtype.itemsize != nbytes:
    raise ValueError(f"{nbytes} bytes per rank is no whole number of {dtype.name} elements "
                     f"({dtype.itemsize} bytes each)")
  rng = np.random.default_rng(seed)
  if is_float(dtype):
    host = rng.standard_normal(n * count, dtype=np.float32).astype(dtype)
  elif dtype == np.bool_:
    host = rng.integers(0, 2, n * count).astype(dtype)
  else:
    host = rng.integers(-4 if np.issubdtype(dtype, np.signedinteger) else 0, 8,
                        n * count).astype(dtype)
  return host


def numpy_reference(op: str, host: np.ndarray, n: int) -> np.ndarray:
  """The global output (out_specs P("x")) of `op` on make_input's data,
  computed by numpy: the independent reference (jax.lax's answer is checked
  against it too: JAX's gloo path can be wrong, see the README)."""
  blocks = host.reshape(n, -1)
  wide = np.float64 if is_float(host.dtype) else np.int64
  if op == "all_gather":
    return np.tile(host, n)
  if op == "reduce_scatter":
    return blocks.astype(wide).sum(0).astype(host.dtype) if host.dtype != np.bool_ else blocks.any(0)
  if op == "all_reduce":
    total = blocks.astype(wide).sum(0).astype(host.dtype) if host.dtype != np.bool_ else blocks.any(0)
    return np.tile(total, n)
  if op == "all_to_all":
    if blocks.shape[1] % n:
      raise ValueError(f"all_to_all: {blocks.shape[1]} elements per rank do not split into "
                       f"{n} blocks (nccl-tests' sizes always do: nccl_tests.round_size)")
    parts = blocks.reshape(n, n, -1)  # [sender, receiver, :]
    return parts.transpose(1, 0, 2).reshape(-1)
  raise ValueError(op)


def wrong_shards(dtype, got, want: np.ndarray) -> list[str]:
  """Shards of jax array `got` (this process's) that differ from `want`."""
  bad = []
  for shard in got.addressable_shards:
    try:
      _check_arrays(dtype, np.asarray(shard.data), want[shard.index],
                    f"shard {shard.index} on device {shard.device.id}")
    except AssertionError as e:
      bad.append(str(e).strip().splitlines()[0] + " " + " ".join(str(e).split())[:300])
  return bad


def count_wrong(dtype, got, want: np.ndarray) -> int:
  """Elements of this process's shards of jax array `got` that differ from `want` (nccl-tests'
  #wrong; floats within the tolerance of _check_arrays count as right)."""
  wrong = 0
  for shard in got.addressable_shards:
    have, ref = np.asarray(shard.data), want[shard.index]
    if have.shape != ref.shape:
      wrong += ref.size
    elif is_float(dtype):
      rtol = 1e-5 if to_dtype(dtype).itemsize >= 4 else 1e-2
      wrong += int(np.count_nonzero(~np.isclose(have.astype(np.float64), ref.astype(np.float64),
                                                rtol=rtol, atol=rtol)))
    else:
      wrong += int(np.count_nonzero(have != ref))
  return wrong


def check_result(spec, dtype, got, want, nbytes: int) -> None:
  """Raises AssertionError unless jax_smddp's answer (`spec`: the op's core.OpSpec) matches jax.lax's: jax
  arrays are compared shard by shard on this process's devices (all of them in
  one process; its own in a multi-process job), anything else as a whole."""
  where = f"jax_smddp {spec.name} ({format_size(nbytes)}/rank, {to_dtype(dtype).name})"
  if hasattr(got, "addressable_shards") and hasattr(want, "addressable_shards"):
    if got.shape != want.shape:
      raise AssertionError(f"{where}: shape {got.shape} != jax.lax shape {want.shape}")
    wanted = {s.device: s for s in want.addressable_shards}
    for shard in got.addressable_shards:
      ref = wanted.get(shard.device)
      if ref is None:
        raise AssertionError(f"{where}: jax.lax has no shard on {shard.device}")
      _check_arrays(dtype, np.asarray(shard.data), np.asarray(ref.data),
                    f"{where}, shard {shard.index} on device {shard.device.id}")
    return
  _check_arrays(dtype, np.asarray(got), np.asarray(want), where)


def _check_arrays(dtype, got: np.ndarray, want: np.ndarray, where: str) -> None:
  if got.shape != want.shape:
    raise AssertionError(f"{where}: shape {got.shape} != jax.lax shape {want.shape}")
  if is_float(dtype):
    # float32/64: rtol 1e-5. Half-precision sums may round differently by order.
    rtol = 1e-5 if to_dtype(dtype).itemsize >= 4 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol, err_msg=where)
  else:
    np.testing.assert_array_equal(got, want, err_msg=where)
