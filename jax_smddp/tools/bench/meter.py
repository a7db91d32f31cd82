"""The benchmark's /proc meter: how many CPUs other work kept busy while a
point was timed (the machine's CPU time minus this benchmark job's)."""

from __future__ import annotations

import os
import time


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _job_root() -> int:
  """The pid of this benchmark job: the ``python -m jax_smddp.tools.bench`` process
  that started this worker (an ancestor), else this process."""
  pid = os.getpid()
  try:
    while pid > 1:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
      if b"jax_smddp.tools.bench" in argv:
        return pid
      with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
  except (OSError, ValueError, IndexError):
    pass
  return os.getpid()


def _descendants(root: int) -> list[int]:
  out, todo = [], [root]
  while todo:
    pid = todo.pop()
    out.append(pid)
    try:
      for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
          todo += [int(c) for c in f.read().split()]
    except OSError:
      pass
  return out


class CpuMeter:
  """CPU time of the whole machine and of this benchmark job (the bench process
  and all its descendants: every worker of a multi-process layout) from /proc,
  in seconds (clock ticks). other_cores(a, b) = CPUs busy with anything else
  (other users' jobs, the hypervisor's steal) on average between two readings."""

  def __init__(self):
    self.root = _job_root()
    self.ok = os.path.exists("/proc/stat")

  def read(self) -> tuple[float, float, float]:
    if not self.ok:
      return time.perf_counter(), 0.0, 0.0
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / _TICK          # all but idle and iowait (steal counts)
    job = 0
    for pid in _descendants(self.root):
      try:
        with open(f"/proc/{pid}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
        job += int(fields[11]) + int(fields[12])
      except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), busy, job / _TICK

  @staticmethod
  def other_cores(a, b) -> float:
    wall = b[0] - a[0]
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall) if wall > 0 else 0.0
