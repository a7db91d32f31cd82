"""The benchmark's layout and each row's references (:mod:`jax_smddp.tools.bench`): the bytes a
call must write (memcpy) and send between hosts (the link), and the tuner's choice and cost
model's prediction for the row (:func:`annotate`)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from jax_smddp import _collectives, calibration, cost_model
from jax_smddp.tools.bench.interval import speedup_interval

MEMCPY_BYTES = 64 << 20


@dataclass(frozen=True)
class Layout(cost_model.Layout):
  """The model's layout (hosts x processes per host x devices per process),
  with what the benchmark prints and records."""

  @property
  def devices(self) -> int:
    return self.ranks

  @property
  def multi_process(self) -> bool:
    return self.processes > 1

  def describe(self) -> str:
    p, d = self.processes_per_host, self.devices_per_process
    host = f"{self.hosts} simulated hosts x " if self.hosts > 1 else ""
    return f"{host}{p} process{'es' if p > 1 else ''} x {d} device{'s' if d > 1 else ''}"

  def as_dict(self) -> dict:
    return {"spec": self.spec, "hosts": self.hosts, "processes": self.processes,
            "processes_per_host": self.processes_per_host,
            "devices_per_process": self.devices_per_process, "devices": self.devices,
            "backend": "cpu"}


def output_bytes_per_process(op: str, nbytes: int, layout: "Layout") -> int:
  """Bytes one process must write for one call: its devices' outputs."""
  n = layout.devices
  return layout.devices_per_process * _collectives.output_bytes(op, nbytes, n)


def memcpy_us(op: str, nbytes: int, layout: "Layout", memcpy_gbs: float) -> float:
  """The memcpy reference of one call: the time the bytes each process must write take
  at this machine's measured single-thread np.copyto bandwidth (not a floor: streaming
  stores and several threads write faster)."""
  return output_bytes_per_process(op, nbytes, layout) / (memcpy_gbs * 1e9) * 1e6


def interhost_bytes_per_host(op: str, nbytes: int, layout: "Layout") -> int:
  """Bytes each host must receive from the other hosts for one call, at
  least, where every host combines its own ranks' data first (n ranks, H
  hosts, nbytes per rank's input): all_gather the other hosts' shards,
  reduce_scatter and all_to_all the other hosts' parts of its ranks' outputs,
  all_reduce a reduce_scatter and an all_gather of the host-summed vector."""
  n, hosts = layout.devices, layout.hosts
  local = n // hosts
  s = _collectives.spec(op)
  # A block from each rank of the other hosts, per pass: once per host where the host's ranks
  # share it (a gather relays it, a reduction combines it), once per rank where each rank's
  # differs (all_to_all).
  distinct = 1 if s.routed else local
  return s.passes * distinct * (n - local) * nbytes // n ** -s.block_power


def ring_bytes_per_host(op: str, nbytes: int, layout: "Layout") -> int | None:
  """Bytes the busiest host sends for one call of a ring over all n ranks in rank order (gloo's
  algorithm under jax.lax on CPU; a host's ranks are consecutive, so one ring edge leaves each
  host): all_gather n - 1 blocks of nbytes, reduce_scatter n - 1 of nbytes / n, all_reduce
  both. None where gloo's algorithm is not a ring (all_to_all) or one host holds every rank.
  Measured exceptions (docs/between_hosts.md, "Bytes on the wire"): gloo's reduce_scatter
  over 4 one-process hosts sends nbytes, not 3/4 of it, from two of the hosts."""
  n = layout.devices
  if layout.hosts < 2:
    return None
  s = _collectives.spec(op)
  if not s.routed:  # a block for each peer, relayed by none: gloo's all_to_all is no ring either
    return None
  return s.passes * (n - 1) * nbytes // n ** -s.block_power


def link_us(op: str, nbytes: int, layout: "Layout", link_gbs: float,
            burst_bytes: int = 0) -> float:
  """The link reference of one call between hosts: interhost_bytes_per_host at
  the link's measured rate each way (jax_smddp.tools.link_probe). With `burst_bytes` (what a
  capped link's full token buckets pass at the interface's own speed: netns.BURST_BYTES per
  NIC) the least time a call can take, less those bytes: a bucket refills while the link idles
  between calls, so a call of a few buckets' bytes may beat the plain reference by that much
  (calls back to back of 1 MiB and more per host ran at the plain reference, 0.98-1.03)."""
  sent = interhost_bytes_per_host(op, nbytes, layout)
  return max(sent - burst_bytes, 0) / (link_gbs * 1e9) * 1e6


def memcpy_bandwidth(nbytes: int = MEMCPY_BYTES, repeats: int = 5) -> float:
  """Median single-threaded numpy copy bandwidth in GB/s (bytes copied / time)."""
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # fault the pages in
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------- the model's annotation

def model_layout(layout: "Layout"):
  """The plain model layout (the tuner caches choices by it)."""
  return cost_model.Layout(layout.hosts, layout.processes_per_host, layout.devices_per_process)


def annotate(r: dict, layout: "Layout", predict: bool = False, machine=None,
             memcpy_gbs: float | None = None, link_gbs: float | None = None,
             burst_bytes: int = 0) -> dict:
  """Adds the tuner's choice for this call ("choice": what
  jax_smddp.tuning.choose answers for this op, size and layout), with
  `memcpy_gbs` the memcpy reference ("memcpy_us"; smddp "vs_memcpy" = memcpy_us /
  time), with `link_gbs` (layouts of several hosts) the link reference
  ("link_us"; "vs_link" = link_us / time, for jax_smddp and jax.lax), the
  bytes the busiest host sends by the model, for jax_smddp's algorithms and gloo's ring
  ("predicted_sent": {"smddp", "lax"}, layouts of several hosts), the speedup's
  bootstrap interval from the row's calls ("speedup_interval", interval.py) and, with
  `predict`, the cost model's prediction ("prediction"; smddp "predicted_us")."""
  from jax_smddp import tuning
  samples = r.get("samples_us") or {}
  if samples.get("smddp") and samples.get("lax"):
    r["speedup_interval"] = speedup_interval(samples["smddp"], samples["lax"])
  if memcpy_gbs:
    r["memcpy_us"] = memcpy_us(r["op"], r["bytes_per_rank"], layout, memcpy_gbs)
    r["smddp"]["vs_memcpy"] = r["memcpy_us"] / r["smddp"]["time_us"]
  if layout.hosts > 1:
    r["predicted_sent"] = {"smddp": interhost_bytes_per_host(r["op"], r["bytes_per_rank"], layout),
                           "lax": ring_bytes_per_host(r["op"], r["bytes_per_rank"], layout)}
  if link_gbs and layout.hosts > 1:
    r["link_us"] = link_us(r["op"], r["bytes_per_rank"], layout, link_gbs)
    if burst_bytes:
      r["link_floor_us"] = link_us(r["op"], r["bytes_per_rank"], layout, link_gbs, burst_bytes)
    r["smddp"]["vs_link"] = r["link_us"] / r["smddp"]["time_us"]
    r["lax"]["vs_link"] = r["link_us"] / r["lax"]["time_us"] if r["lax"]["time_us"] else None
  lay = model_layout(layout)
  choice = tuning.choose(r["op"], r["bytes_per_rank"], lay)
  r["choice"] = {"algorithm": choice.algorithm, "chunk_bytes": choice.chunk_bytes,
                 "reason": choice.reason}
  if predict:
    machine = machine or calibration.local_machine()
    algo = choice.algorithm if layout.multi_process else "in_process"
    other = float((r.get("other_load") or {}).get("cores", 0.0))
    p = cost_model.predict(r["op"], r["bytes_per_rank"], lay, machine, algo, choice.chunk_bytes,
                           other_load=other)
    r["prediction"] = {"time_us": p.time_us, "algorithm": p.algorithm,
                       "chunk_bytes": p.chunk_bytes, "bottleneck": p.bottleneck,
                       "machine": machine.name, "terms_us": {k: v * 1e6 for k, v in p.terms.items()}}
    r["smddp"]["predicted_us"] = p.time_us
  return r


def model_meta(machine=None) -> dict:
  machine = machine or calibration.local_machine()
  return {"machine": machine.name, "source": machine.source,
          "calibration": calibration.calibration_path(),
          "definition": "prediction = jax_smddp.cost_model.predict for the tuner's choice; "
                        "model/meas = predicted time / measured median"}
