"""What writing fresh memory costs on this machine, with 4 KiB pages and with transparent huge
pages (issue 69: a collective whose output lands on fresh memory is the slow call).

Each round maps --mib MiB of anonymous memory in a fresh mapping, advises it onto huge pages or
off them (madvise, as JAX_SMDDP_HUGE_PAGE_BYTES advises large outputs), and times a first write
(page faults: the kernel finds and zeroes pages) and a second (the copy alone), after --idle
seconds without touching memory. On a virtual machine whose host takes back the guest's free
memory (virtio-balloon free page reporting, which reports free 2 MiB blocks), a first write after
idle waits for the host too, and huge pages, which come from exactly such blocks, wait most:

    python scripts/first_touch.py --rounds 3
"""
from __future__ import annotations

import argparse
import mmap
import os
import time

import numpy as np


def first_and_second_write(nbytes: int, huge: bool) -> tuple[float, float]:
  """Seconds of a first and of a second write of a fresh `nbytes` mapping."""
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    t0 = time.perf_counter()
    a.fill(1)
    t1 = time.perf_counter()
    a.fill(2)
    t2 = time.perf_counter()
    del a
    return t1 - t0, t2 - t1
  finally:
    m.close()


def reported_kib() -> int | None:
  """KiB of free memory this guest has reported to its host so far (None: no page reporting)."""
  try:
    with open("/sys/module/page_reporting/parameters/reported_kib") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mib", type=int, default=256, help="MiB written per round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--idle", type=float, default=4.0,
                      help="seconds without touching memory before each write")
  args = parser.parse_args()
  nbytes = args.mib << 20
  reported = reported_kib()
  print(f"free page reporting: {'none' if reported is None else f'{reported} KiB so far'}; "
        f"THP: {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}; "
        f"pid {os.getpid()}")
  for _ in range(args.rounds):
    for huge in (False, True):
      time.sleep(args.idle)
      first, second = first_and_second_write(nbytes, huge)
      print(f"{'2 MiB pages' if huge else '4 KiB pages'}: first write {nbytes / first / 1e9:5.2f} "
            f"GB/s ({first * 1e3:6.1f} ms), second {nbytes / second / 1e9:5.2f} GB/s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
