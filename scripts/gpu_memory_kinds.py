"""What kind of device memory XLA's allocator hands out, as the CUDA driver
sees it: whether legacy CUDA IPC can share it (direct reads need that), and
which shareable handle types it allows. One subprocess per allocator setting.

    python scripts/gpu_memory_kinds.py            # default, bfc, platform, cuda_async
"""
from __future__ import annotations

import os
import subprocess
import sys

# CUpointer_attribute (cuda.h)
ATTRS = {"buffer_id": 7, "legacy_ipc_capable": 10, "range_start": 11, "range_size": 12,
         "mapped": 13, "allowed_handle_types": 14, "gpudirect_rdma_capable": 16, "mempool": 17}


def probe() -> dict:
  import ctypes
  import jax.numpy as jnp
  x = jnp.arange(1 << 22, dtype=jnp.float32) + 1  # 16 MiB, an XLA output buffer
  x.block_until_ready()
  p = x.unsafe_buffer_pointer()
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuInit(0)
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  cuda.cuDeviceGet(ctypes.byref(dev), 0)
  cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # the context JAX uses
  cuda.cuCtxSetCurrent(ctx)
  out = {"pointer": hex(p)}
  for name, attr in ATTRS.items():
    v = ctypes.c_uint64(0)
    r = cuda.cuPointerGetAttribute(ctypes.byref(v), attr, ctypes.c_uint64(p))
    out[name] = (hex(v.value) if name in ("range_start", "mempool") else v.value) if r == 0 else f"error {r}"
  h = (ctypes.c_char * 64)()
  cudart = ctypes.CDLL("libcudart.so.13") if os.path.exists("/usr/local/cuda/lib64/libcudart.so.13") else None
  if cudart is not None and isinstance(out["range_start"], str) is False:
    out["cudaIpcGetMemHandle"] = cudart.cudaIpcGetMemHandle(h, ctypes.c_void_p(int(out["range_start"], 16)))
  return out


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    print(probe())
    return
  for allocator in ("default", "bfc", "platform", "cuda_async"):
    for prealloc in ("true", "false"):
      env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE=prealloc, XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")
      if allocator != "default":
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator
      r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                         text=True, timeout=120)
      last = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
      print(f"allocator={allocator} preallocate={prealloc}: {last}", flush=True)


if __name__ == "__main__":
  main()
