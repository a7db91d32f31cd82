"""Cost model of jax_smddp's collectives (and of NCCL's ring and tree, the baseline).

Pure Python: no jax, no files, no engine calls; what it knows of each collective (its size
relations, its passes, whether routes apply) is the engine's one description of it
(:mod:`jax_smddp._collectives`). Importing it as ``jax_smddp.cost_model`` runs the package's
``__init__``, which imports jax. It
predicts the time of one collective call from the bytes each process must copy,
reduce and send over each kind of link, counted by walking the same routes and
loops as the engine (``xla_ffi/algorithms/routes.cc``,
``process_algorithms.cc``, ``algorithms.cc``), and from a *machine*:
per-transport latency and bandwidth plus a few CPU figures. Used three ways:

* **prediction** beside measurement (``python -m jax_smddp.tools.bench --predict``) and
  validation on recorded benchmark data (``tests/tools/test_cost_model.py``);
* **tuning**: :mod:`jax_smddp.tuning` asks it which algorithm (flat or
  hierarchical) and chunk size is fastest for each (op, size, layout);
* **extrapolation** to clusters we cannot run here (presets ``p4d.24xlarge`` and
  ``p5.48xlarge``; :mod:`jax_smddp.tools.figures`).

Notation: H hosts, P processes per host, D devices (ranks) per process,
n = H*P*D ranks, S = input bytes of one rank, c = message chunk bytes
(``JAX_SMDDP_CHUNK_BYTES``). A *block* is what one rank contributes to one
other rank: b = S for all_gather, S/n for reduce_scatter, all_reduce (a shard)
and all_to_all.

Transports (``Transport``): latency alpha (one message, posted to completed),
wire bandwidth B per endpoint and direction, efficiency eta (fraction of B a
large transfer achieves), ``copies`` (CPU/engine copies per byte on the way:
1 on each side for shared-memory rings and libfabric bounce buffers, 0 in
process), per-message posting cost o and ``kernel_bw`` (CPU time the OS spends
per byte sent or received: TCP; infinite for shared memory and RDMA). Presets hold: ``in_process``
(memory), ``intra_host`` (shared memory between processes, or NVLink/IPC
between GPUs) and ``network`` (one NIC; ``nics_per_host`` of them).

Time of one call (every term is per process; the layout is symmetric, so
process 0 stands for all)::

    T = t_call + t_header + sum_hops (alpha_hop) + fill + max(R_thread, R_cores, R_nic, R_intra)

* t_call = call_overhead + call_overhead_per_device * D: dispatch of the jitted
  program and rendezvous of the process's devices.
* t_header (cross-process only): the 104-byte header sent to and received from
  each of the P*H - 1 peers: alpha of the slowest link + 2 (PH - 1) o.
* hops: links in sequence on the critical path. Flat routes: 1 (all_reduce: 2,
  contribution then result). Hierarchical: all_gather 2 (network, then shared
  memory relay), reduce_scatter 2 (shared-memory combine, network),
  all_reduce 4. A ring (one process on each of H > 2 hosts): H - 1 network
  hops (all_reduce 2 (H - 1)), with c the rounds' chunk (RING_CHUNK_BYTES).
* fill (not for a ring, whose hosts all send from the start: measured, 4x1x1
  all_reduce on 1 Gbit/s links from 512 KiB per rank, the time is R_nic's within
  3 %; the oversubscribed rounds below still add 4 ms there that the runs do not
  show): the first chunk crossing the hops after the first, sum over those hops
  of min(c, block) * (1/(eta B) + 2 copies/copy_bw + 2/kernel_bw).
* R_thread: the process's engine thread (one per process runs the whole
  cross-process part; in one process, min(cores, n) threads share the bodies
  when the call moves >= 256 KiB):
  copy_bytes / copy_bw(F) + reduce_bytes / reduce_bw(F) + chunks * o
  + (bytes out + in) / kernel_bw, where
  copy_bytes = local copies + sum over links (bytes sent + received) * copies,
  reduce_bytes = bytes read by reductions; copy_bw(F) blends cache and DRAM
  bandwidth by the footprint F of the call (a fraction min(1, cache/F) of the
  bytes at cache speed); outputs of >= fresh_output_bytes per rank (mapped
  afresh each call: glibc's largest mmap threshold, 32 MiB, or the one
  JAX_SMDDP_HEAP_REUSE_BYTES sets) add first-touch faults at fault_bw.
* R_cores = busy * (R_thread + t_call) / (cores * oversubscribed_efficiency) - t_call
  when the busy processes (of a host; of the machine when simulated hosts share
  its cores) outnumber the cores (CPU); each round that waits on a network peer
  (the header when there are network peers, each network hop) then also costs
  ``oversubscribed_round_s`` (the peer's progress needs it to be scheduled).
* contention (only when ``predict(..., other_load=E)`` is given, CPU machines):
  T is multiplied by max(1, (B+E)/C) / max(1, B/C), B the call's busy threads,
  C the cores, E the CPUs other work kept busy (measured by the benchmark). It
  explains only a small part of the gap between median and fastest call on a
  shared machine (docs/performance_model.md).
* R_nic = max(bytes out, bytes in) over the host's NICs / (eta B * usable NICs),
  usable NICs = min(nics, ranks_on_host * max(1, nics/gpus_per_host)) (ranks
  spread over the NICs); R_intra = max(bytes out, in) on the intra-host link /
  (eta B) (NVLink; shared memory has no wire: its cost is the copies). On GPUs this
  takes a rank's peer copies to run at once, as they do since they run on lanes
  (up to 8 streams per call, joined back with events: an 8-GPU all_gather has 7
  peer copies of a rank in flight on the mock node, docs/gpu.md); before, they ran
  one after another on XLA's stream, and the term was the copies' sum at one copy
  engine's rate. Never measured on a node of several GPUs.

Byte counts for uniform layouts (closed forms; the code counts by walking the
routes, and the tests check both agree). Per process, Pt = P*H processes,
nl = D, bytes over links (out = in by symmetry):

===============  ==================================  =====================================
op               flat (per process, to all peers)     hierarchical, network / shared memory
===============  ==================================  =====================================
all_gather       (Pt-1) D S                           net (H-1) D S;  shm (P-1) D S H
reduce_scatter   (Pt-1) D S/n  (= (n-D) S/n)          net (H-1) D S/n; shm (P-1) D H S/n
all_reduce       2 (Pt-1) D S/n                       net 2 (H-1) D S/n; shm 2 (P-1) D H S/n
all_to_all       (Pt-1) D^2 S/n                       (always flat)
===============  ==================================  =====================================

so hierarchical routes cut each host's network bytes by P (each byte crosses
the network once per host) at the price of relaying over shared memory.

NCCL baseline (GPU presets; NCCL's own tuner model, src/graph/tuning.cc, Simple
protocol): T = lat + bytes_on_busiest_link / bw, with
ring all_gather / reduce_scatter: lat = 8.4 + (n-N)*3.4 + (N-1)*14.0 us and
(n-1) S (all_gather; S/n per step for reduce_scatter) through each node's NICs;
ring all_reduce: twice the steps and 2 N network steps; tree all_reduce:
lat = 8.4 + 2 ((k-1)*4.0 + log2(N)*14.0) us, 2 S through each node's NICs
(double binary tree, both directions) at 0.92 of the ring's bandwidth (N nodes,
k ranks per node).

Calibration (``python -m jax_smddp.tools.calibrate --calibrate``): short numpy
microbenchmarks of this machine (copy and 3-way reduction, in cache and in
DRAM) and, with ``--from bench.json ...``, a least-squares fit (in log time) of
the parameters microbenchmarks cannot see (FIT_PARAMS: call overhead,
shared-memory and network latency, the network's kernel cost, cache size,
large-output rate, parallel efficiency, oversubscription) to benchmark
results. The result is cached in ``~/.cache/jax_smddp/calibration.json``
(``JAX_SMDDP_CALIBRATION`` overrides the path) and used by
:func:`jax_smddp.calibration.local_machine` (which reads and writes it, and adds
this process's heap policy: this module holds no files and reads no engine) and
the tuner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

from jax_smddp import _collectives
from jax_smddp._collectives import block_bytes, largest_bytes, output_bytes, reduces, spec

OPS = _collectives.MODELLED
ALGORITHMS = ("in_process", "flat", "hierarchical")
NCCL_ALGORITHMS = ("ring", "tree")
# The engine's defaults the model assumes, copied here so that the model needs no native module
# (tests/api/test_settings.py checks each equals the registry's).
DEFAULT_CHUNK_BYTES = 1 << 20     # JAX_SMDDP_CHUNK_BYTES
RING_CHUNK_BYTES = 128 << 10      # JAX_SMDDP_STAGGER_CHUNK_BYTES
HELPER_MIN_BYTES = 256 << 10      # JAX_SMDDP_CPU_HELPER_MIN_BYTES
MMAP_THRESHOLD_MAX = 32 << 20     # glibc DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
GB = 1e9


# --------------------------------------------------------------------------- machines

@dataclass(frozen=True)
class Transport:
  """One kind of link. bandwidth: bytes/s per endpoint and direction (math.inf:
  no wire, only the copies count); efficiency: fraction of it large transfers
  reach; copies: engine copies per byte on each side (1: into a ring or bounce
  buffer on the sender, out of it on the receiver); per_message_s: CPU cost to
  post and complete one message (chunk)."""
  name: str
  latency_s: float
  bandwidth: float = math.inf
  efficiency: float = 1.0
  copies: int = 0
  per_message_s: float = 0.0
  kernel_bw: float = math.inf   # bytes/s of CPU time the OS spends per byte out or in (TCP)

  @property
  def rate(self) -> float:
    return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class NcclConstants:
  """NCCL's tuner constants (us), Simple protocol (src/graph/tuning.cc)."""
  base_us: float = 8.4
  ring_intra_us: float = 3.4
  ring_inter_us: float = 14.0
  tree_intra_us: float = 4.0
  tree_inter_us: float = 14.0
  tree_bw_factor: float = 0.92


@dataclass(frozen=True)
class Machine:
  """A preset: one kind of host (CPU or GPU node) and its links."""
  name: str
  description: str
  kind: str                       # "cpu" or "gpu"
  cores: int                      # CPU threads that move data in parallel (cpu)
  gpus_per_host: int              # ranks a host holds at most (gpu); 0 for cpu
  copy_bw: float                  # one thread's copy bandwidth in cache (bytes/s)
  copy_bw_dram: float             # ... beyond the cache
  cache_bytes: float              # footprint that still copies at copy_bw
  fault_bw: float                 # first-touch writes of fresh mappings (bytes/s)
  reduce_bw: float                # bytes read per second by the n-way reduction (in cache)
  reduce_bw_dram: float           # ... beyond the cache
  call_overhead_s: float          # per call, plus ...
  call_overhead_per_device_s: float  # ... per device of the process
  in_process: Transport
  intra_host: Transport
  network: Transport
  nics_per_host: int = 1
  oversubscribed_round_s: float = 0.0     # per round over the network while oversubscribed
  oversubscribed_efficiency: float = 1.0  # share of the cores doing work while oversubscribed
  parallel_efficiency: float = 1.0   # in-process: threads' share of memory bandwidth
  hosts_share_cores: bool = False    # "hosts" simulated on one machine (network namespaces)
  fresh_output_bytes: float = MMAP_THRESHOLD_MAX  # outputs this large are mapped afresh per call
  nccl: NcclConstants = field(default_factory=NcclConstants)
  source: str = "preset"

  def copy_rate(self, footprint: float) -> float:
    """Effective copy bandwidth for a call touching `footprint` bytes."""
    if self.cache_bytes <= 0 or footprint <= 0:
      return self.copy_bw_dram if self.cache_bytes <= 0 else self.copy_bw
    hit = min(1.0, self.cache_bytes / footprint)
    return 1.0 / (hit / self.copy_bw + (1 - hit) / self.copy_bw_dram)

  def reduce_rate(self, footprint: float) -> float:
    """Effective bytes-read bandwidth of reductions for a call touching `footprint` bytes."""
    if self.cache_bytes <= 0 or footprint <= 0:
      return self.reduce_bw_dram if self.cache_bytes <= 0 else self.reduce_bw
    hit = min(1.0, self.cache_bytes / footprint)
    return 1.0 / (hit / self.reduce_bw + (1 - hit) / self.reduce_bw_dram)

  def usable_nics(self, ranks_on_host: int) -> float:
    if self.kind != "gpu" or self.gpus_per_host <= 0:
      return float(self.nics_per_host)
    per_gpu = max(1.0, self.nics_per_host / self.gpus_per_host)
    return float(min(self.nics_per_host, max(1, ranks_on_host) * per_gpu))

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @staticmethod
  def from_json(d: dict) -> "Machine":
    d = dict(d)
    for k in ("in_process", "intra_host", "network"):
      d[k] = Transport(**d[k])
    d["nccl"] = NcclConstants(**d.get("nccl", {}))
    fields = {f.name for f in dataclasses.fields(Machine)}
    return Machine(**{k: v for k, v in d.items() if k in fields})


# The GPU engine's phases, measured on an H200 (2026-11-26, scripts/gpu_check.sh: gpu_bench's
# bare reduction kernel, and tests/gpu/test_kernels.py's phase timing of a 64 MiB
# reduce_scatter of 2 processes sharing the GPU; docs/gpu_measurements.md "Where a reduction's time goes").
# Bytes read per second by one f32 reduction kernel of 2-4 sources within the default SM
# budget (16 blocks, twice the loads in flight per thread; scripts/gpu_block_sweep.py on an
# H200, 2026-11-28): 995-1228 GB/s; 8 blocks 529-653 GB/s, 32 blocks 1.69-2.09 TB/s,
# unbudgeted 2.5-3.2 TB/s.
GPU_REDUCE_READ_DEFAULT_BLOCKS = 1100 * GB
# One step's hand-off between ranks (a stream wait on a peer's flag, then a flag write),
# processes sharing one GPU under MPS: 6 us + 5 us; without MPS the wait is ~95 us (the
# processes' contexts time-slice the GPU).
GPU_HANDOFF_MPS_S = 11e-6
GPU_HANDOFF_TIME_SLICED_S = 100e-6

P4D = Machine(
    name="p4d.24xlarge",
    description="8 x A100 40 GB, NVSwitch (NVLink3, 600 GB/s per GPU both directions), "
                "4 x 100 Gbps EFA (two GPUs per NIC)",
    kind="gpu", cores=96, gpus_per_host=8,
    copy_bw=700 * GB, copy_bw_dram=700 * GB, cache_bytes=0, fault_bw=math.inf,
    # Reductions run within the SM budget (JAX_SMDDP_GPU_MAX_BLOCKS's default): as measured on an
    # H200 (GPU_REDUCE_READ_DEFAULT_BLOCKS), assumed here, not measured on an A100.
    reduce_bw=GPU_REDUCE_READ_DEFAULT_BLOCKS, reduce_bw_dram=GPU_REDUCE_READ_DEFAULT_BLOCKS,
    call_overhead_s=10e-6, call_overhead_per_device_s=0.0,
    in_process=Transport("device memory", 2e-6),
    intra_host=Transport("NVLink/IPC", 3e-6, bandwidth=300 * GB, efficiency=0.8,
                         copies=0, per_message_s=0.3e-6),
    network=Transport("EFA 100 Gbps", 15e-6, bandwidth=12.5 * GB, efficiency=0.95,
                      copies=0, per_message_s=0.5e-6),
    nics_per_host=4,
)

P5 = Machine(
    name="p5.48xlarge",
    description="8 x H100 80 GB, NVSwitch (NVLink4, 900 GB/s per GPU both directions), "
                "32 x 100 Gbps EFA (four NICs per GPU)",
    kind="gpu", cores=192, gpus_per_host=8,
    copy_bw=1500 * GB, copy_bw_dram=1500 * GB, cache_bytes=0, fault_bw=math.inf,
    # Within the default budget (16 blocks), as measured on an H200 (same SMs as the H100).
    reduce_bw=GPU_REDUCE_READ_DEFAULT_BLOCKS, reduce_bw_dram=GPU_REDUCE_READ_DEFAULT_BLOCKS,
    call_overhead_s=8e-6, call_overhead_per_device_s=0.0,
    in_process=Transport("device memory", 2e-6),
    intra_host=Transport("NVLink/IPC", 3e-6, bandwidth=450 * GB, efficiency=0.8,
                         copies=0, per_message_s=0.3e-6),
    network=Transport("EFA 100 Gbps", 12e-6, bandwidth=12.5 * GB, efficiency=0.95,
                      copies=0, per_message_s=0.5e-6),
    nics_per_host=32,
)

# The machine these defaults were fitted on: a 2-core VM (AMD EPYC), the
# development machine of this project. Copy and reduction bandwidths from
# microbenchmarks(); the other ten numbers fitted by fit() to
# tests/data/bench_*.json (see docs/performance_model.md).
CPU_REFERENCE = Machine(
    name="cpu-reference",
    description="2-core VM (AMD EPYC), jax CPU devices; shared memory between processes, "
                "libfabric tcp;ofi_rxm over a veth pair between simulated hosts",
    kind="cpu", cores=2, gpus_per_host=0,
    copy_bw=42 * GB, copy_bw_dram=10.4 * GB, reduce_bw=44 * GB, reduce_bw_dram=16 * GB,
    cache_bytes=275e3,                                   # fitted
    fault_bw=2.48 * GB,                                  # fitted
    call_overhead_s=2.74e-6,                             # fitted
    call_overhead_per_device_s=27.5e-6,                  # fitted
    in_process=Transport("memory", 2e-6),
    intra_host=Transport("shared memory", 59.3e-6,       # latency fitted
                         copies=1, per_message_s=3e-6),
    network=Transport("libfabric tcp (veth)", 11e-6,     # latency fitted
                      bandwidth=math.inf, copies=1, per_message_s=20e-6,
                      kernel_bw=3.36 * GB),              # fitted
    nics_per_host=1,
    oversubscribed_round_s=565e-6,                       # fitted
    oversubscribed_efficiency=0.738,                     # fitted
    parallel_efficiency=0.881,                           # fitted
    hosts_share_cores=True,
)

PRESETS = {m.name: m for m in (P4D, P5, CPU_REFERENCE)}


# --------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout:
  """Where a group's ranks live (uniform: every host and process alike)."""
  hosts: int
  processes_per_host: int   # processes of the group per host (max if uneven)
  devices_per_process: int  # devices of the group per process (max if uneven)

  @property
  def processes(self) -> int:
    return self.hosts * self.processes_per_host

  @property
  def ranks(self) -> int:
    return self.processes * self.devices_per_process

  @property
  def spec(self) -> str:
    base = f"{self.processes_per_host}x{self.devices_per_process}"
    return f"{self.hosts}x{base}" if self.hosts > 1 else base


def hierarchical_valid(layout: Layout) -> bool:
  """The engine takes rail routes only across >= 2 hosts with >= 2 processes each."""
  return layout.hosts >= 2 and layout.processes_per_host >= 2


def default_algorithm(layout: Layout, op: str | None = None) -> str:
  """What the engine runs without tuning: in memory within one process, else
  rail routes when valid (JAX_SMDDP_HIERARCHICAL=1, the default), else flat
  (all_to_all: always a direct exchange)."""
  if layout.processes == 1:
    return "in_process"
  always_direct = op in _collectives.SPECS and not spec(op).routed  # no op: any routed one
  return "hierarchical" if hierarchical_valid(layout) and not always_direct else "flat"


# --------------------------------------------------------------------------- traffic

@dataclass
class Traffic:
  """What one process does in one call (process 0 of a uniform layout).
  Message sizes are kept (not chunk counts), so one walk serves every chunk."""
  out: dict = field(default_factory=lambda: {"intra": 0, "net": 0})    # bytes sent, per link kind
  inn: dict = field(default_factory=lambda: {"intra": 0, "net": 0})    # bytes received
  sizes: dict = field(default_factory=lambda: {"intra": {}, "net": {}})  # message bytes -> count
  local_copy: int = 0        # bytes memcpy'd by the engine outside links
  reduce_read: int = 0       # bytes read by reductions
  hops: tuple = ()           # link kinds on the critical path, in order
  first_block: int = 0       # bytes of one block (fill uses min(chunk, block))
  footprint: int = 0         # bytes of this process's inputs and outputs
  output_per_rank: int = 0
  host_net_out: int = 0      # bytes leaving the host over the network
  host_net_in: int = 0
  ring: bool = False         # Routes::ring: chunks of at most RING_CHUNK_BYTES, every op

  def messages(self, kind: str, chunk_bytes: int) -> int:
    """Chunks posted on links of `kind` (sends and receives) with this chunk size."""
    return sum(count * _chunks(nbytes, chunk_bytes) for nbytes, count in self.sizes[kind].items())

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _chunks(nbytes: int, chunk: int) -> int:
  return 0 if nbytes <= 0 else -(-nbytes // chunk)


class _Routes:
  """A port of ComputeRoutes (routes.cc) for a uniform layout; processes are
  numbered host-major (process = host * P + rail), ranks process-major."""

  def __init__(self, layout: Layout, hierarchical: bool, rounds: bool = True):
    self.H, self.P, self.D = layout.hosts, layout.processes_per_host, layout.devices_per_process
    self.Pt = self.H * self.P
    self.n = self.Pt * self.D
    self.hier = hierarchical and hierarchical_valid(layout)
    # Routes::ring: one process on each of more than two hosts, rounds allowed
    # (JAX_SMDDP_STAGGER_CHUNK_BYTES != 0). Processes are hosts here, in ring order.
    self.ring = rounds and self.H > 2 and self.P == 1

  def next(self, p):
    return (p + 1) % self.Pt

  def prev(self, p):
    return (p - 1) % self.Pt

  def host(self, q):
    return q // self.P

  def rail(self, q):
    return q % self.P

  def proc(self, rank):
    return rank // self.D

  def kind(self, p, q):
    return "intra" if self.host(p) == self.host(q) else "net"

  def near(self, p, q):
    return self.host(p) == self.host(q) or self.rail(p) == self.rail(q)

  def on_host(self, h, rail):
    return h * self.P + rail

  def host_mates(self, p):
    h = self.host(p)
    return [self.on_host(h, i) for i in range(self.P) if self.on_host(h, i) != p]

  def gather_targets(self, p):
    if self.ring:
      return [self.next(p)]
    return [q for q in range(self.Pt) if q != p and (not self.hier or self.near(p, q))]

  def gather_source(self, p, s):
    q = self.proc(s)
    if q == p:
      return -1
    if self.ring:
      return self.prev(p)
    return q if (not self.hier or self.near(p, q)) else self.on_host(self.host(p), self.rail(q))

  def gather_relay(self, p, s):
    q = self.proc(s)
    if self.ring:
      return [] if q == p or self.next(p) == q else [self.next(p)]
    if self.hier and self.host(q) != self.host(p) and self.rail(q) == self.rail(p):
      return self.host_mates(p)
    return []

  def reduce_sources(self, p, t):
    q = self.proc(t)
    if self.ring:  # starts at the process after the owner, each hop adding its own
      return [] if self.prev(p) == q else [self.prev(p)]
    if not self.hier:
      return [r for r in range(self.Pt) if r != p] if q == p else []
    if q == p:
      return [r for r in range(self.Pt) if r != p and self.near(p, r)]
    if self.host(q) != self.host(p) and self.rail(q) == self.rail(p):
      return self.host_mates(p)
    return []

  def reduce_dest(self, p, t):
    q = self.proc(t)
    if q == p:
      return -1
    if self.ring:
      return self.next(p)
    if not self.hier or self.host(q) == self.host(p) or self.rail(q) == self.rail(p):
      return q
    return self.on_host(self.host(p), self.rail(q))


@functools.lru_cache(maxsize=4096)
def traffic(op: str, bytes_per_rank: int, layout: Layout, algorithm: str) -> Traffic:
  """Bytes, messages and copies of process 0 in one call, counted along the
  engine's loops (process_algorithms.cc for "flat"/"hierarchical",
  host_algorithms.cc for "in_process", where the figures are for the whole process).
  Blocks are taken as contiguous (outer == 1: the benchmark's 1-D layout)."""
  if op not in OPS:
    raise ValueError(f"unknown op {op!r}; one of {OPS}")
  S, D, n = int(bytes_per_rank), layout.devices_per_process, layout.ranks
  t = Traffic()
  block, out_per_rank = block_bytes(op, S, n), output_bytes(op, S, n)
  passes = spec(op).passes
  t.first_block, t.output_per_rank = block, out_per_rank
  t.footprint = D * (S + out_per_rank)
  if algorithm == "in_process":
    if layout.processes != 1:
      raise ValueError("in_process needs a layout of one process")
    if reduces(op):  # each rank reduces its shard of every rank's input; all_reduce's second
      t.reduce_read = n * S  # pass copies each reduced shard to the n - 1 other ranks
      t.local_copy = (passes - 1) * (n - 1) * S
    else:  # each rank's output copied once from the peers' inputs
      t.local_copy = n * out_per_rank
    return t
  if algorithm not in ("flat", "hierarchical"):
    raise ValueError(f"unknown algorithm {algorithm!r}")
  rt = _Routes(layout, algorithm == "hierarchical")
  p = 0
  nl = D

  def move(direction, q, nbytes, count=1):
    if nbytes <= 0 or count <= 0:
      return
    k = rt.kind(p, q)
    direction[k] += nbytes * count
    t.sizes[k][nbytes] = t.sizes[k].get(nbytes, 0) + count

  send = lambda q, nbytes, count=1: move(t.out, q, nbytes, count)
  recv = lambda q, nbytes, count=1: move(t.inn, q, nbytes, count)

  if spec(op).routed and not reduces(op):  # all_gather: blocks relayed along the routes
    for s in range(n):
      src = rt.gather_source(p, s)
      if src >= 0:
        recv(src, block)
        for tgt in rt.gather_relay(p, s):
          send(tgt, block)
        t.local_copy += (nl - 1) * block
    for q in rt.gather_targets(p):
      send(q, block, nl)
    t.local_copy += nl * nl * block
    t.hops = ("net", "intra") if rt.hier else ("net" if rt.H > 1 else "intra",)
  elif reduces(op):
    targets = rt.gather_targets(p)
    for r in range(n):
      srcs = rt.reduce_sources(p, r)
      dest = rt.reduce_dest(p, r)
      for q in srcs:
        recv(q, block)
      if dest < 0 or srcs or nl > 1:
        t.reduce_read += (nl + len(srcs)) * block
      if dest >= 0:
        send(dest, block)
      elif passes > 1:  # all_reduce: its shard's result to every process
        for q in targets:
          send(q, block)
        t.local_copy += (nl - 1) * block
      if passes > 1 and rt.gather_source(p, r) >= 0:
        recv(rt.gather_source(p, r), block)
        for tgt in rt.gather_relay(p, r):
          send(tgt, block)
        t.local_copy += (nl - 1) * block
    if rt.hier:
      t.hops = ("intra", "net") + ("net", "intra") * (passes - 1)
    else:
      t.hops = ("net" if rt.H > 1 else "intra",) * passes
  else:  # not routed (all_to_all): always direct between processes
    for q in range(rt.Pt):
      if q != p:
        send(q, block, nl * rt.D)
        recv(q, block, nl * rt.D)
    t.local_copy += nl * nl * block
    t.hops = ("net" if rt.H > 1 else "intra",)
  t.ring = rt.ring
  if rt.ring and spec(op).routed:  # each block or partial goes round, a hop per host, per pass
    t.hops = ("net",) * ((rt.H - 1) * passes)
  # Host totals: every process of a host alike.
  t.host_net_out = t.out["net"] * layout.processes_per_host
  t.host_net_in = t.inn["net"] * layout.processes_per_host
  return t


# --------------------------------------------------------------------------- prediction

@dataclass
class Prediction:
  op: str
  bytes_per_rank: int
  layout: Layout
  algorithm: str
  chunk_bytes: int
  time_s: float
  terms: dict          # the named terms of T (seconds)
  bottleneck: str
  host_net_bytes: int  # bytes leaving one host over its NICs
  machine: str

  @property
  def time_us(self) -> float:
    return self.time_s * 1e6

  def network_utilisation(self, machine: Machine) -> float:
    """Average use of the host's NICs (all of them, line rate) during the call."""
    line = machine.network.bandwidth * machine.nics_per_host
    return self.host_net_bytes / self.time_s / line if self.time_s > 0 else 0.0


def _transport(machine: Machine, kind: str) -> Transport:
  return machine.intra_host if kind == "intra" else machine.network


def busy_threads(op: str, bytes_per_rank: int, layout: Layout, machine: Machine) -> int:
  """Threads of one call that want a core at once on one machine: the helper
  threads of one process (min(cores, n) when the call moves >= 256 KiB, else 1),
  or one engine thread per process of the host (of the machine, when simulated
  hosts share its cores)."""
  if layout.processes == 1:
    n = layout.ranks
    moved = n * largest_bytes(op, bytes_per_rank, n)
    return min(machine.cores, n) if moved >= HELPER_MIN_BYTES else 1
  return layout.processes if machine.hosts_share_cores else layout.processes_per_host


def contention_factor(busy: int, other_cores: float, cores: int) -> float:
  """How much slower a CPU-bound call runs when other work keeps `other_cores`
  CPUs busy on average: the scheduler shares the `cores` among the call's `busy`
  threads and the others, so the call gets cores / (busy + other) of them instead
  of cores / busy (no more than one core per thread in either case)."""
  if other_cores <= 0 or cores <= 0:
    return 1.0
  return max(1.0, (busy + other_cores) / cores) / max(1.0, busy / cores)


def predict(op: str, bytes_per_rank: int, layout: Layout, machine: Machine,
            algorithm: str | None = None, chunk_bytes: int | None = None,
            other_load: float = 0.0) -> Prediction:
  """Predicted time of one call of jax_smddp's `algorithm` (default: what the
  engine runs untuned) for `op` on `layout` of `machine`; `other_load`: CPUs
  kept busy by other work during the call (measured; CPU machines only), which
  multiplies the time by contention_factor (term "contention")."""
  p = _predict(op, bytes_per_rank, layout, machine, algorithm, chunk_bytes)
  if other_load > 0 and machine.kind == "cpu":
    f = contention_factor(busy_threads(op, bytes_per_rank, layout, machine), other_load,
                          machine.cores)
    if f > 1:
      p.terms["contention"] = p.time_s * (f - 1)
      p.time_s *= f
  return p


def _predict(op: str, bytes_per_rank: int, layout: Layout, machine: Machine,
             algorithm: str | None = None, chunk_bytes: int | None = None) -> Prediction:
  algorithm = algorithm or default_algorithm(layout, op)
  if algorithm == "hierarchical" and (not hierarchical_valid(layout) or not spec(op).routed):
    algorithm = "flat"
  if layout.processes == 1:
    algorithm = "in_process"
  tr = traffic(op, int(bytes_per_rank), layout, algorithm)
  chunk = int(chunk_bytes or DEFAULT_CHUNK_BYTES)
  if tr.ring:  # process_rendezvous.cc: a ring's relays wait for a chunk at each hop
    chunk = min(chunk, RING_CHUNK_BYTES)
  m = machine
  D = layout.devices_per_process
  terms = {"call": m.call_overhead_s + m.call_overhead_per_device_s * D}
  rate = m.copy_rate(tr.footprint)
  red = m.reduce_rate(tr.footprint)
  faults = 0.0
  if tr.output_per_rank >= m.fresh_output_bytes and math.isfinite(m.fault_bw):
    faults = D * tr.output_per_rank / m.fault_bw
  if algorithm == "in_process":
    n = layout.ranks
    moved = n * max(bytes_per_rank, tr.output_per_rank)
    threads = min(m.cores, n) if moved >= HELPER_MIN_BYTES else 1
    par = threads * (m.parallel_efficiency if threads > 1 else 1.0)
    work = tr.local_copy / rate + tr.reduce_read / red
    terms["latency"] = m.in_process.latency_s
    terms["work"] = work / par + faults / par
    bottleneck = "memory"
    time_s = sum(terms.values())
    return Prediction(op, int(bytes_per_rank), layout, algorithm, chunk, time_s, terms,
                      bottleneck, 0, m.name)

  Pt = layout.processes
  busy = layout.processes if m.hosts_share_cores else layout.processes_per_host
  oversubscribed = m.kind == "cpu" and busy > m.cores
  peers_kinds = {"intra"} if layout.hosts == 1 else (
      {"net"} if layout.processes_per_host == 1 else {"intra", "net"})
  alpha_header = max(_transport(m, k).latency_s for k in peers_kinds)
  o_header = max(_transport(m, k).per_message_s for k in peers_kinds)
  terms["header"] = alpha_header + 2 * (Pt - 1) * o_header
  terms["hops"] = sum(_transport(m, k).latency_s for k in tr.hops)
  if oversubscribed:
    # Rounds that wait on a network peer (header, network hops) while processes
    # outnumber cores: the peer's progress needs it to be scheduled.
    net_rounds = ("net" in peers_kinds) + sum(k == "net" for k in tr.hops)
    terms["oversubscribed"] = net_rounds * m.oversubscribed_round_s
  first = min(chunk, tr.first_block)
  fill = 0.0
  # A ring has no fill: every host sends from the call's start (its own block, or the
  # reduction it starts), and each hop's chunk comes in while it sends the one before.
  for k in () if tr.ring else tr.hops[1:]:
    tp = _transport(m, k)
    fill += first / tp.rate + first * 2 * tp.copies / rate + first * 2 / tp.kernel_bw
  terms["fill"] = fill
  copy_bytes = tr.local_copy
  msg_time = kernel = 0.0
  for k in ("intra", "net"):
    tp = _transport(m, k)
    copy_bytes += (tr.out[k] + tr.inn[k]) * tp.copies
    msg_time += tr.messages(k, chunk) * tp.per_message_s
    kernel += (tr.out[k] + tr.inn[k]) / tp.kernel_bw
  thread = copy_bytes / rate + tr.reduce_read / red + msg_time + faults + kernel
  resources = {"engine thread": thread}
  if oversubscribed:
    # The busy processes' work, their calls' dispatch included, shares the cores.
    resources["cores"] = (busy * (thread + terms["call"]) / (m.cores * m.oversubscribed_efficiency)
                          - terms["call"])
  if tr.host_net_out or tr.host_net_in:
    usable = m.usable_nics(layout.processes_per_host * D)
    resources["network"] = max(tr.host_net_out, tr.host_net_in) / (m.network.rate * usable)
  if math.isfinite(m.intra_host.bandwidth) and (tr.out["intra"] or tr.inn["intra"]):
    resources["intra-host link"] = max(tr.out["intra"], tr.inn["intra"]) / m.intra_host.rate
  bottleneck = max(resources, key=resources.get)
  terms["data"] = resources[bottleneck]
  time_s = sum(terms.values())
  return Prediction(op, int(bytes_per_rank), layout, algorithm, chunk, time_s, terms,
                    bottleneck, tr.host_net_out, m.name)


CHUNK_CANDIDATES = tuple(1 << k for k in range(16, 23))   # 64 KiB .. 4 MiB (<= half a ring)


def best(op: str, bytes_per_rank: int, layout: Layout, machine: Machine,
         algorithms: Sequence[str] | None = None) -> tuple[Prediction, list[Prediction]]:
  """The fastest (algorithm, chunk) by the model, and every candidate evaluated.
  A candidate must beat the default (untuned) choice by 3% to be taken."""
  if layout.processes == 1:
    p = predict(op, bytes_per_rank, layout, machine, "in_process")
    return p, [p]
  algos = list(algorithms or ("flat", "hierarchical"))
  if not hierarchical_valid(layout) or not spec(op).routed:   # all_to_all is always direct
    algos = [a for a in algos if a != "hierarchical"] or ["flat"]
  cands = [predict(op, bytes_per_rank, layout, machine, a, c) for a in algos
           for c in CHUNK_CANDIDATES]
  default_algo = default_algorithm(layout, op)
  default = predict(op, bytes_per_rank, layout, machine,
                    default_algo if default_algo in algos else algos[0], DEFAULT_CHUNK_BYTES)
  top = min(cands, key=lambda p: p.time_s)
  return (top if top.time_s < 0.97 * default.time_s else default), cands


# --------------------------------------------------------------------------- NCCL baseline

def nccl_predict(op: str, bytes_per_rank: int, nodes: int, ranks_per_node: int,
                 machine: Machine, algorithm: str = "ring") -> Prediction:
  """NCCL's ring (all ops) or tree (all_reduce) on `nodes` x `ranks_per_node`
  GPUs, with NCCL's tuner latencies and the machine's links (see the module
  docstring)."""
  N, k = nodes, ranks_per_node
  n = N * k
  S = float(bytes_per_rank)
  c = machine.nccl
  net_rate = machine.network.rate * machine.usable_nics(k)
  nvl_rate = machine.intra_host.rate
  if algorithm == "ring":
    steps, per_step = spec(op).passes * (n - 1), S / n ** -spec(op).block_power
    # tuning.cc's inter-node steps: all_reduce's ring crosses 2N node edges, not 2 (N - 1)
    inter = (2 * N if N > 1 else 0) if op == "all_reduce" else N - 1
    lat = (c.base_us + (steps - inter) * c.ring_intra_us + inter * c.ring_inter_us) * 1e-6
    node_bytes = steps * per_step if N > 1 else 0.0    # one ring edge leaves each node per step
    gpu_bytes = steps * per_step                       # each GPU forwards every step
    data = max(node_bytes / net_rate if N > 1 else 0.0, gpu_bytes / nvl_rate)
  elif algorithm == "tree":
    if op != "all_reduce":
      raise ValueError("NCCL's tree runs all_reduce only")
    lat = (c.base_us + 2 * ((k - 1) * c.tree_intra_us + math.log2(max(N, 1)) * c.tree_inter_us)) * 1e-6
    node_bytes = 2 * S if N > 1 else 0.0
    data = max(node_bytes / (net_rate * c.tree_bw_factor) if N > 1 else 0.0,
               2 * S / (nvl_rate * c.tree_bw_factor))
  else:
    raise ValueError(f"unknown NCCL algorithm {algorithm!r}")
  terms = {"call": machine.call_overhead_s, "latency": lat, "data": data}
  layout = Layout(N, k, 1)
  return Prediction(op, int(S), layout, f"nccl_{algorithm}", 0, sum(terms.values()), terms,
                    "network" if N > 1 else "intra-host link", int(node_bytes), machine.name)
