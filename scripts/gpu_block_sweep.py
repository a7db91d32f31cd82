"""What each thread block buys a reduction (issue #52 item 4): the bare f32 sum kernel of
2 and 4 sources, 64 MiB each, at SM budgets from 1 block to every SM, as launched (once per
thread's batch) and with twice the loads in flight per thread (`unroll` 2); the read rate and
its ratio to the device's copy rate (bytes copied per second, alone). Needs a GPU and the
CUDA module; prints a table and writes it as JSON to the path given (default none).

    python scripts/gpu_block_sweep.py [OUT.json]
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
  from jax_smddp import _native
  ext = _native.cuda_engine()
  if ext is None or ext.device_count() == 0:
    print("gpu_block_sweep: no GPU here")
    return 1
  info = ext.device_info(0)
  sms = int(info["multiprocessors"])
  size = 64 << 20
  copy = ext.copy_bandwidth(0, size)
  budgets = sorted({1, 2, 4, 8, 12, 16, 24, 32, 64, sms, 1024})
  rows = []
  print(f"{info['name']}: {sms} SMs, copy rate {copy / 1e9:.0f} GB/s ({size >> 20} MiB, alone)")
  print("sources blocks unroll   read GB/s  read/copy")
  for sources in (2, 4):
    for blocks in budgets:
      for unroll in (1, 2):
        s = ext.reduce_seconds(0, size, sources, blocks, 10, unroll)
        read = sources * size / s
        rows.append(dict(sources=sources, blocks=blocks, unroll=unroll, seconds=s,
                         read_bytes_per_s=read, read_per_copy=read / copy))
        print(f"{sources:>7} {blocks:>6} {unroll:>6} {read / 1e9:>11.0f} {read / copy:>10.2f}",
              flush=True)
  if argv:
    with open(argv[0], "w") as f:
      json.dump(dict(device=info["name"], sms=sms, copy_bytes_per_s=copy, bytes=size, rows=rows),
                f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
