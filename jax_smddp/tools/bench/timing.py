"""The benchmark's timing loops (:mod:`jax_smddp.tools.bench`, --timing): each call synced and
timed, the implementations interleaved or in blocks, with each call's CPU time and, between
simulated hosts, the bytes each interface sent."""

from __future__ import annotations

import time


def interface_tx() -> dict[str, int]:
  """Bytes sent so far by each network interface of this process's namespace (loopback left
  out), from the kernel's counters: what the simulated hosts' NICs carried."""
  from jax_smddp.tools import netns
  return {name: c["tx"] for name, c in netns.interface_bytes().items()}


def settled_interface_tx(quiet_s: float = 0.02, limit_s: float = 2.0) -> dict[str, int]:
  """interface_tx() once the counters stopped moving for `quiet_s` (at most `limit_s`): a call
  returns once its sends are in the kernel's socket buffers, which drain onto a capped link
  after it; read this way, a window of calls counts its own bytes, not the previous window's
  tail."""
  last = interface_tx()
  deadline = time.monotonic() + limit_s
  while time.monotonic() < deadline:
    time.sleep(quiet_s)
    now = interface_tx()
    if now == last:
      break
    last = now
  return last


class _Sent:
  """Adds what each interface sent during a window of calls into `into` (a dict per fn);
  the counters read settled, outside the calls' spans. `barrier`: every process meets before
  the window, so that its first call does not carry the skew the calls before it left between
  the processes, and around each reading, so that no process of the host sends its part of
  the window's first call before the window opens (eager sends need no receiver) or its last
  after it closed."""

  def __init__(self, into: dict | None, barrier=None):
    self.into = into
    self.barrier = barrier

  def __enter__(self):
    if self.barrier:
      self.barrier()
    self.before = settled_interface_tx() if self.into is not None else None
    if self.into is not None and self.barrier:
      self.barrier()  # no process starts before every host's counters are read
    return self

  def __exit__(self, *exc):
    if self.into is not None:
      if self.barrier:
        self.barrier()
      for name, tx in settled_interface_tx().items():
        self.into[name] = self.into.get(name, 0) + tx - self.before.get(name, tx)


def _timed_call(fn, x, samples: list, starts: list, cpu: list, sent: dict | None = None) -> None:
  """One synced call of fn(x): its wall time into `samples`, its start into `starts`
  (time.perf_counter(): CLOCK_MONOTONIC on Linux, one clock for every process of the
  machine), and the CPU time this process used meanwhile into `cpu` (time.process_time():
  every thread's, the kernel's work for them included; read outside the wall span). `sent`, if
  given, adds what each interface of this host sent meanwhile (_Sent: the host's other
  processes run the same calls, so this counts the host's traffic)."""
  with _Sent(sent):
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    t1 = time.perf_counter()
    cpu.append(time.process_time() - c0)
  samples.append(t1 - t0)
  starts.append(t0)


def _sent_for(sent, k):
  return sent[k] if sent is not None else None


def _lists(given, fns) -> list[list[float]]:
  return given if given is not None else [[] for _ in fns]


def _warm_up(fns, x, warmup: int, ready=None, first: int = 0) -> None:
  """`warmup` untimed calls of each fn(x), interleaved; then ready(j) for each, if given."""
  for _ in range(warmup):
    for fn in fns:
      fn(x).block_until_ready()
  if ready:
    for j in range(len(fns)):
      ready(first + j)


def time_alternating(fns, x, iters: int, warmup: int, barrier=None,
                     starts: list[list[float]] | None = None,
                     cpu: list[list[float]] | None = None,
                     sent: list[dict] | None = None, ready=None) -> list[list[float]]:
  """Seconds per call of each fn(x), calls interleaved (a, b, a, b, ...), each synced;
  `barrier()`, if given, runs before each timed call (outside its span). `starts` and
  `cpu`, if given (a list per fn), get each timed call's start and the process's CPU
  seconds during it; `sent` (a dict per fn) the bytes each interface sent (_timed_call).
  `ready(j)`, if given, runs once fns[j] is warmed up, before its first timed call."""
  _warm_up(fns, x, warmup, ready)
  samples = [[] for _ in fns]
  starts, cpu = _lists(starts, fns), _lists(cpu, fns)
  for _ in range(iters):
    for k, (fn, out, began, used) in enumerate(zip(fns, samples, starts, cpu)):
      if barrier:
        barrier()
      _timed_call(fn, x, out, began, used, _sent_for(sent, k))
  return samples


def time_blocks(fns, x, iters: int, warmup: int, block: int = 5,
                starts: list[list[float]] | None = None,
                cpu: list[list[float]] | None = None,
                sent: list[dict] | None = None, ready=None) -> list[list[float]]:
  """Seconds per call of each fn(x), each synced, in blocks of `block` calls of one
  fn back to back (a x5, b x5, a x5, ...): a block is the steady state of one
  collective (every process in step), and the blocks' alternation spreads slow
  periods of the machine over both. Every process meets before each block
  (process_barrier, outside the calls' spans), so that a block's first call does not
  carry the skew the previous block's calls left between the processes.
  `starts`, `cpu`, `sent`, `ready`: as time_alternating's."""
  _warm_up(fns, x, warmup, ready)
  samples = [[] for _ in fns]
  starts, cpu = _lists(starts, fns), _lists(cpu, fns)
  while len(samples[0]) < iters:
    k = min(block, iters - len(samples[0]))
    for j, fn in enumerate(fns):
      _time_block(fn, x, k, samples[j], starts[j], cpu[j], _sent_for(sent, j))
  return samples


def _time_block(fn, x, k: int, out: list, began: list, used: list, sent: dict | None) -> None:
  """k timed calls of fn(x) back to back, every process meeting before them (process_barrier,
  outside the calls' spans) and the interfaces' bytes counted around them (_Sent)."""
  with _Sent(sent, barrier=process_barrier):
    for _ in range(k):
      _timed_call(fn, x, out, began, used)


_barriers = 0


def process_barrier() -> None:
  """Every process of the jax.distributed job meets here (its key-value store's barrier, not a
  collective of any library under test); nothing in a single process."""
  global _barriers
  from jax_smddp._jax_internals import jax_distributed as distributed
  client = distributed.global_state.client
  if client is None:
    return
  _barriers += 1
  client.wait_at_barrier(f"jax_smddp_bench_{_barriers}", 60_000)


def time_barrier(fns, x, iters: int, warmup: int, barrier=process_barrier,
                 starts: list[list[float]] | None = None,
                 cpu: list[list[float]] | None = None,
                 sent: list[dict] | None = None, ready=None) -> list[list[float]]:
  """As time_alternating, with every process meeting at a barrier before each timed call
  (outside its span): every call starts together, as a harness that synchronises its
  processes before each call times it; a call then waits for no late peer."""
  return time_alternating(fns, x, iters, warmup, barrier=barrier, starts=starts, cpu=cpu,
                          sent=sent, ready=ready)


def time_solo(fns, x, iters: int, warmup: int,
              starts: list[list[float]] | None = None,
              cpu: list[list[float]] | None = None,
              sent: list[dict] | None = None, ready=None) -> list[list[float]]:
  """All of one fn's calls back to back, then all of the next's, each block right after its
  own warm-up: each library alone in its steady state, its threads still awake from its
  previous call and its heap grown by its own calls, not the other's (the other timings
  measure calls that follow another library's: docs/cpu_floor.md, cold and back-to-back
  calls). Every process meets before each block, as in time_blocks. `starts`, `cpu`, `sent`,
  `ready`: as time_alternating's."""
  samples = [[] for _ in fns]
  starts, cpu = _lists(starts, fns), _lists(cpu, fns)
  for j, fn in enumerate(fns):
    _warm_up([fn], x, warmup, ready, first=j)
    _time_block(fn, x, iters, samples[j], starts[j], cpu[j], _sent_for(sent, j))
  return samples


TIMINGS = {"blocks": time_blocks, "alternating": time_alternating, "barrier": time_barrier,
           "solo": time_solo}
