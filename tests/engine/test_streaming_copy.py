"""Copies with non-temporal stores (xla_ffi/common/streaming_copy.h), which
collectives that write JAX_SMDDP_STREAMING_STORE_BYTES or more use for their
outputs: byte-exact at every alignment and length (through _smddp_testing),
and every collective and dtype equal to jax.lax with every call streaming, in
one process and across processes."""

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import engine_probes

_testing = engine_probes()


@pytest.mark.parametrize("stream", [True, False])
def test_copy_is_exact_at_every_alignment_and_length(stream):
  rng = np.random.default_rng(0)
  lengths = [0, 1, 63, 64, 65, 4095, 4096, 4097, 4096 + 64 * 3 + 17, 1 << 16, (1 << 20) + 5]
  for n in lengths:
    src = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    for src_offset in (0, 1, 8, 33):
      for dst_offset in (0, 3, 16, 63):
        size = dst_offset + n + 70
        out = _testing.copy_bytes(src, src_offset, size, dst_offset, stream)
        want = b"\xab" * dst_offset + src + b"\xab" * (size - dst_offset - n)
        assert out == want, (n, src_offset, dst_offset)


def test_calls_stream_from_the_threshold():
  # The default threshold, 16 MiB (this process does not set the setting).
  if "JAX_SMDDP_STREAMING_STORE_BYTES" in os.environ:
    pytest.skip("JAX_SMDDP_STREAMING_STORE_BYTES is set")
  assert not _testing.stream_stores((16 << 20) - 1)
  assert _testing.stream_stores(16 << 20) == (platform.machine() in ("x86_64", "AMD64"))


SCRIPT = textwrap.dedent("""
  import os, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import numpy as np
  import jax, jax.numpy as jnp
  from jax.sharding import PartitionSpec as P, NamedSharding
  import jax_smddp as smddp
  mesh = jax.make_mesh((8,), ("x",))

  def run(f, x):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    return np.asarray(g(jax.device_put(x, NamedSharding(mesh, P("x")))))

  # Odd sizes: blocks that are no multiple of 64 bytes land at unaligned offsets.
  for dtype in (np.float32, jnp.bfloat16, np.int32, np.int8, np.float16):
    for per_rank in (8 * 131, 8 * 4099):
      x = (np.arange(8 * per_rank) % 251 - 120).astype(dtype)
      pairs = [
        (lambda v: smddp.all_gather(v, "x", tiled=True), lambda v: jax.lax.all_gather(v, "x", tiled=True)),
        (lambda v: smddp.all_gather(v.reshape(8, -1), "x", axis=1, tiled=True).reshape(-1),
         lambda v: jax.lax.all_gather(v.reshape(8, -1), "x", axis=1, tiled=True).reshape(-1)),
        (lambda v: smddp.reduce_scatter(v, "x", tiled=True), lambda v: jax.lax.psum_scatter(v, "x", tiled=True)),
        (lambda v: smddp.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x")),
        (lambda v: smddp.all_to_all(v, "x", 0, 0, tiled=True), lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True)),
      ]
      for k, (ours, theirs) in enumerate(pairs):
        got, want = run(ours, x), run(theirs, x)
        assert got.dtype == want.dtype and got.shape == want.shape, (dtype, per_rank, k)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64),
                                      err_msg=f"{np.dtype(dtype).name} {per_rank} op {k}")
  print("OK")
""")


@pytest.mark.timeout(300)
def test_every_op_and_dtype_with_every_call_streaming(tmp_path):
  path = tmp_path / "streaming.py"
  path.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_SMDDP_STREAMING_STORE_BYTES"] = "1"
  proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                        timeout=280)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
