"""ragged_all_to_all: each rank sends slices of its operand's rows to the others, which
write them into their output at offsets the sender names (jax.lax.ragged_all_to_all:
mixture-of-experts token dispatch).

Written as a composition of jax_smddp.all_to_all and jnp ops, so jit, grad and vmap come
from its parts: each rank packs its K = n * s slices (s to each of the n ranks) into slots
of a fixed size, B = min(operand rows, output rows) rows each (a slice longer than either
is outside what jax.lax defines), one engine all_to_all exchanges the slots, a second one
output_offsets, and each received slice is written into the output at its offset with its
receive size, later slices winning where they overlap (as jax.lax's pseudocode loop
writes). The wire carries the padded slots: every rank sends K * B rows whatever the sizes
(a native ragged transfer is future work). XLA:CPU has no ragged-all-to-all; this runs
there. Under the lax swap, jax.lax.ragged_all_to_all lowers as this composition on CPU and
on GPUs where the engine takes its all_to_all (elsewhere XLA's own).
"""

from __future__ import annotations

import functools

import numpy as np

import jax.numpy as jnp

from jax_smddp._jax_internals import mlir

from jax_smddp import _collective as c
from jax_smddp.all_to_all import all_to_all

_INDEX_ARGS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups=None):
  """Sends ``operand[input_offsets[i]:input_offsets[i] + send_sizes[i]]`` to rank
  ``i // (K / n)`` of `axis_name` (K the offsets' length, n the group's size), which writes
  it into its copy of `output` at the ``output_offsets[i]`` the sender names, over
  ``recv_sizes`` rows, like :func:`jax.lax.ragged_all_to_all`."""
  axes = c.axes_tuple(axis_name)
  c.check_bound("ragged_all_to_all", axes)
  groups = c.index_groups(axis_index_groups)
  _check(operand, output, (input_offsets, send_sizes, output_offsets, recv_sizes),
         c.group_size(axes, groups), axis_name)
  return _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                   axes=axes, axis_index_groups=groups)


def _check(operand, output, indices, n: int, axis_name) -> None:
  """Errors that name what is wrong, before anything is traced."""
  api = "jax_smddp.ragged_all_to_all"
  shapes = {"operand": np.shape(operand), "output": np.shape(output)}
  for name, shape in shapes.items():
    if len(shape) < 1:
      raise ValueError(f"{api}: {name} must have a leading axis of rows, got a scalar.")
  if shapes["operand"][1:] != shapes["output"][1:]:
    raise ValueError(f"{api}: operand rows {shapes['operand'][1:]} and output rows "
                     f"{shapes['output'][1:]} differ; a row must have one shape in both.")
  if jnp.result_type(operand) != jnp.result_type(output):
    raise TypeError(f"{api}: operand is {jnp.result_type(operand)} but output is "
                    f"{jnp.result_type(output)}; they must be of one element type.")
  lengths = {}
  for name, v in zip(_INDEX_ARGS, indices):
    if not jnp.issubdtype(jnp.result_type(v), jnp.integer):
      raise TypeError(f"{api}: {name} is {jnp.result_type(v)}; offsets and sizes must be "
                      f"integers (e.g. {name}.astype(jnp.int32)).")
    if np.ndim(v) != 1 or np.shape(v)[0] < 1:
      raise ValueError(f"{api}: {name} must be 1-D and not empty, got shape {np.shape(v)}.")
    lengths[name] = np.shape(v)[0]
  if len(set(lengths.values())) != 1:
    raise ValueError(f"{api}: input_offsets, send_sizes, output_offsets and recv_sizes must "
                     f"have one length, got {lengths}.")
  k = lengths["input_offsets"]
  if k % n:
    raise ValueError(f"{api}: the offsets' length {k} is not divisible by the {n} ranks of "
                     f"axis {axis_name!r}; give each rank the same number of slices.")


def _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axes,
              axis_index_groups):
  """The composition (see the module's docstring); arguments already checked."""
  rows, out_rows, k = operand.shape[0], output.shape[0], input_offsets.shape[0]
  block = min(rows, out_rows)  # rows of each slice's slot
  if block == 0:
    return output
  step = jnp.arange(block)
  # Pack: slot i holds operand[input_offsets[i]:][:send_sizes[i]], zeros after.
  at = input_offsets[:, None] + step[None, :]
  packed = jnp.take(operand, jnp.clip(at, 0, rows - 1), axis=0)
  sent = (step[None, :] < send_sizes[:, None]) & (at < rows)
  packed = jnp.where(_rows_mask(sent, packed.ndim), packed, jnp.zeros((), operand.dtype))
  # Slots [d*s, (d+1)*s) go to rank d; slot q*s + j arrives from rank q, as jax.lax numbers them.
  received = all_to_all(packed.reshape(k * block, *operand.shape[1:]), axes, 0, 0,
                        axis_index_groups=axis_index_groups, tiled=True)
  offsets = all_to_all(output_offsets, axes, 0, 0, axis_index_groups=axis_index_groups,
                       tiled=True)
  # Each output row's writer: the last received slice that covers it (a scatter of maxima,
  # exact whatever the order), and its row within that slice.
  dest = offsets[:, None] + step[None, :]
  writes = (step[None, :] < recv_sizes[:, None]) & (dest >= 0) & (dest < out_rows)
  slot = jnp.broadcast_to(jnp.arange(k)[:, None], dest.shape)
  writer = jnp.full((out_rows,), -1, slot.dtype).at[jnp.where(writes, dest, out_rows)].max(
      slot, mode="drop")
  src = jnp.maximum(writer, 0)
  row = src * block + jnp.clip(jnp.arange(out_rows) - offsets[src], 0, block - 1)
  values = jnp.take(received, row, axis=0)
  return jnp.where(_rows_mask(writer >= 0, values.ndim), values, output)


def _rows_mask(mask, ndim: int):
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _lower(ctx, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
           platform, axis_name, axis_index_groups):
  """jax.lax.ragged_all_to_all's lowering under the lax swap: the composition, or on GPUs,
  where the engine would not take its all_to_all, a string saying why (XLA's own then)."""
  axes = c.axes_tuple(axis_name)
  if platform == "cuda":
    why = c.engine_unsupported(ctx, ctx.avals_in[0].dtype, axes, axis_index_groups)
    if why or axis_index_groups is not None:
      return why or "axis_index_groups: the GPU backend takes whole mesh axes only"
  body = functools.partial(_exchange, axes=axes, axis_index_groups=axis_index_groups)
  return mlir.lower_fun(body, multiple_results=False)(ctx, operand, output, input_offsets,
                                                      send_sizes, output_offsets, recv_sizes)
