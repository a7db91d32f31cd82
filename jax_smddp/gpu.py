"""Set-up of the GPU backend's communicators, outside any XLA execution.

When jax_smddp lowers a collective for local GPUs it makes sure every group
of devices the program uses has its staging regions (one per rank, in device
memory) and that each rank has mapped its peers' regions: peers in this
process by peer access, peers in other processes of the same host by CUDA IPC
handles exchanged over the jax.distributed key-value store. The handlers then
only look them up and enqueue work.

A group that spans hosts runs all_gather, reduce_scatter and all_to_all
hierarchically:
the ranks on each host form an intra-host communicator, and each rank gets a
network port that the process's proxy thread drives over the multi-process
world's links (libfabric between hosts; jax_smddp.initialize() sets them
up). With JAX_SMDDP_FABRIC_HMEM=auto or 1 the port's slots stay in device
memory, registered with a libfabric endpoint that moves it itself (FI_HMEM,
e.g. EFA with GPUDirect RDMA), instead of staging through host memory.
all_reduce there is the engine's one hierarchical body (a reduce-scatter
into the rank's shard, then an all-gather), on a count padded to equal shards.
"""

from __future__ import annotations

import atexit
import base64
import logging
import threading

import jax

from jax_smddp import _collectives
from jax_smddp import _native
from jax_smddp import config

log = logging.getLogger("jax_smddp")

# The collectives a group that spans hosts runs (collective_permute stays within a host).
ACROSS_HOSTS = _collectives.served_by("gpu_across_hosts")

_lock = threading.Lock()
_ready: set = set()  # groups (partition ids) set up in this process
_generation: dict[tuple, int] = {}  # times each group was set up (names its key-value entries)
_host_ids: list[str] | None = None
_exit_hook = False
_rail_published = False
_across_hosts: dict = {}  # groups across hosts set up here: what their set-up chose
_why_staged: dict = {}  # groups across hosts whose network slots stage: why


def slot_bytes() -> int:
  """Bytes per staging slot (JAX_SMDDP_GPU_SLOT_BYTES; its default is the
  registry's); each rank has two per group."""
  return config.value("JAX_SMDDP_GPU_SLOT_BYTES")


def fabric_hmem() -> str:
  """JAX_SMDDP_FABRIC_HMEM: "0" (default: network slots in host memory),
  "auto" (device memory where every process of a group can register it with
  its libfabric provider, else host memory) or "1" (device memory, or an
  error saying why not). Same value in every process."""
  return config.value("JAX_SMDDP_FABRIC_HMEM")


def available() -> bool:
  """Whether this install has the CUDA backend (built with nvcc)."""
  return _native.cuda_engine() is not None


def _hosts() -> list[str]:
  """Host id of every process (hostname + network namespace, as the CPU
  backend names hosts), exchanged once."""
  global _host_ids
  if _host_ids is None:
    from jax_smddp import distributed
    n = jax.process_count()
    if n == 1:
      _host_ids = [distributed._host_id()]
    else:
      client = distributed._client()
      if client is None:
        raise RuntimeError("jax_smddp (GPU): multi-process job without jax.distributed; call "
                           "jax.distributed.initialize(...) first.")
      client.key_value_set(f"jax_smddp/gpu/host/{jax.process_index()}", distributed._host_id())
      _host_ids = [client.blocking_key_value_get(f"jax_smddp/gpu/host/{p}", distributed.KV_TIMEOUT_MS)
                   for p in range(n)]
  return _host_ids


def unsupported(mesh, groups, op: str) -> str | None:
  """Why these groups cannot run `op` on the GPU backend (None when they can)."""
  if not available():
    return "this jax_smddp was built without CUDA (nvcc was not found at install)"
  devices = list(mesh.devices.flat)
  if any(d.platform != "gpu" for d in devices):
    return None  # lowering only (no GPU here): nothing to set up
  hosts = _hosts()
  for group in groups:
    per_host: dict = {}
    for i in group:
      host = hosts[devices[int(i)].process_index]
      per_host[host] = per_host.get(host, 0) + 1
    if len(per_host) > 1:
      if op not in ACROSS_HOSTS:
        return (f"{op} over a group that spans hosts (on GPUs {', '.join(ACROSS_HOSTS[:-1])} "
                f"and {ACROSS_HOSTS[-1]} cross hosts)")
      if len(set(per_host.values())) > 1:
        return "the group has different numbers of ranks on its hosts"
  return None


def spans_hosts(mesh, groups) -> bool:
  """Whether any group has ranks on several hosts (False when lowering
  without GPUs)."""
  devices = list(mesh.devices.flat)
  if any(d.platform != "gpu" for d in devices):
    return False
  hosts = _hosts()
  return any(len({hosts[devices[int(i)].process_index] for i in group}) > 1 for group in groups)


def prepare(mesh, groups) -> None:
  """Sets up every group of `groups` (rows of partition ids) that has a rank
  in this process, once. Every process of a group must lower the program
  (they meet in the key-value store)."""
  ext = _native.cuda_engine()
  devices = list(mesh.devices.flat)
  if any(d.platform != "gpu" for d in devices):
    return
  me = jax.process_index()
  ext.set_process(me)
  global _exit_hook
  if not _exit_hook:  # peers must not mistake this process's normal exit for a crash
    atexit.register(_close_at_exit, ext)
    _exit_hook = True
  with _lock:
    for group in groups:
      members = tuple(int(i) for i in group)
      if members in _ready or not any(devices[i].process_index == me for i in members):
        continue
      hosts = _hosts()
      host_ids = [hosts[devices[i].process_index] for i in members]
      if len(set(host_ids)) == 1:
        _prepare_group(ext, members, devices, me)
      else:
        _prepare_hierarchy(ext, members, host_ids, devices, me)
      _ready.add(members)


def _close_at_exit(ext) -> None:
  """Tells the groups' peers this process ends (it did not die), and closes
  the libfabric endpoints of the groups across hosts. The world's links close
  when both this and jax_smddp.distributed's hook dropped them, in either
  order."""
  if not ext.close_at_exit():
    log.warning("jax_smddp (GPU): network steps still ran at exit; libfabric endpoints left open")


def _prepare_group(ext, members: tuple, devices, me: int) -> None:
  """Staging regions of a group inside one host, mapped by every rank."""
  if members in _ready:
    return
  local = [(r, devices[i].local_hardware_id) for r, i in enumerate(members)
           if devices[i].process_index == me]
  processes = len({devices[i].process_index for i in members})
  handles = ext.prepare(list(members), slot_bytes(), local, processes)
  remote = []
  if any(devices[i].process_index != me for i in members):
    from jax_smddp import distributed
    client = distributed._client()
    generation = _generation.get(members, 0)
    prefix = f"jax_smddp/gpu/{ext.group_key(list(members)):x}/{generation}"
    for rank, handle in handles:
      client.key_value_set(f"{prefix}/{rank}", base64.b64encode(handle).decode())
    for rank, i in enumerate(members):
      if devices[i].process_index != me:
        value = client.blocking_key_value_get(f"{prefix}/{rank}", distributed.KV_TIMEOUT_MS)
        remote.append((rank, base64.b64decode(value)))
  ext.connect(list(members), remote)
  _ready.add(members)
  _generation[members] = _generation.get(members, 0) + 1
  log.debug("jax_smddp (GPU): group %s ready (%d local ranks)", members, len(local))


def _prepare_hierarchy(ext, members: tuple, host_ids: list, devices, me: int) -> None:
  """A group across hosts: this host's ranks as an intra-host group, then the
  network ports of this process's ranks (over the world's links)."""
  from jax_smddp import distributed
  distributed.ensure_initialized()
  order = list(dict.fromkeys(host_ids))  # hosts by first appearance: alike everywhere
  host_of = [order.index(h) for h in host_ids]
  mine = host_ids[[devices[i].process_index for i in members].index(me)]
  intra = tuple(i for i, h in zip(members, host_ids) if h == mine)
  _prepare_group(ext, intra, devices, me)
  local = [(r, devices[i].local_hardware_id) for r, i in enumerate(members)
           if devices[i].process_index == me]
  rails = _rail_addresses(ext, members, devices, me, local[0][1])
  gdrcopy, rail = ext.prepare_hierarchy(list(members), host_of,
                                        [devices[i].process_index for i in members], local,
                                        list(intra), slot_bytes(), rails)
  _across_hosts[members] = {"hosts": len(order), "gdrcopy": bool(gdrcopy),
                            "device_slots": bool(rail),
                            "staged_because": "" if rail else _why_staged.get(members, "")}
  log.debug("jax_smddp (GPU): group %s across %d hosts ready (network signals: %s; slots: %s)",
            members, len(order), "GDRCopy" if gdrcopy else "mapped host memory",
            "device memory (FI_HMEM)" if rail else "host memory (staging)")


def groups_across_hosts() -> dict:
  """The GPU groups across hosts set up in this process (partition ids ->
  {"hosts", "gdrcopy": network signals in GDRCopy memory, "device_slots":
  network slots in device memory registered with libfabric (FI_HMEM), else
  staged through host memory, "staged_because": why they stage, "" if not})."""
  with _lock:
    return {k: dict(v) for k, v in _across_hosts.items()}


def _rail_addresses(ext, members: tuple, devices, me: int, ordinal: int) -> list:
  """Every process's FI_HMEM rail address (by process index) when the group's
  network slots can stay in device memory; [] to stage through host memory.
  Each process opens its rail once and publishes its address, or why it has
  none, in the key-value store; a group uses rails only if all its processes
  have one, so every process decides alike."""
  mode = fabric_hmem()
  if mode == "0":
    _why_staged[members] = "JAX_SMDDP_FABRIC_HMEM=0 (the default)"
    return []
  from jax_smddp import distributed
  client = distributed._client()
  global _rail_published
  if not _rail_published:
    address, why = ext.open_device_rail(ordinal)
    entry = base64.b64encode(address).decode() if address else "none:" + why
    client.key_value_set(f"jax_smddp/gpu/rail/{me}", entry)
    _rail_published = True
  processes = sorted({devices[i].process_index for i in members})
  entries = {p: client.blocking_key_value_get(f"jax_smddp/gpu/rail/{p}", distributed.KV_TIMEOUT_MS)
             for p in processes}
  missing = {p: e[len("none:"):] for p, e in entries.items() if e.startswith("none:")}
  if missing:
    why = "; ".join(f"process {p}: {w}" for p, w in sorted(missing.items()))
    if mode == "1":
      raise RuntimeError(f"jax_smddp (GPU): JAX_SMDDP_FABRIC_HMEM=1 but the network slots of "
                         f"group {members} cannot stay in device memory ({why}). Use "
                         "JAX_SMDDP_FABRIC_HMEM=auto to stage through host memory instead.")
    log.info("jax_smddp (GPU): group %s stages its network slots through host memory: %s",
             members, why)
    _why_staged[members] = why
    return []
  return [base64.b64decode(entries[p]) if p in entries else b""
          for p in range(jax.process_count())]


def release() -> None:
  """Frees every GPU communicator of this process (after its programs ran)."""
  ext = _native.cuda_engine()
  with _lock:
    if ext is not None:
      ext.release()
    _ready.clear()
    _across_hosts.clear()
    _why_staged.clear()


def direct_reads_staged_because() -> str:
  """Why the latest call of this process that asked for direct reads
  (JAX_SMDDP_GPU_DIRECT_READS=1, the default) staged through the slots instead: which rank
  could not share its buffers in place, and why. Empty if none did."""
  ext = _native.cuda_engine()
  return ext.direct_reads_staged_because() if ext is not None else ""


def counters() -> dict:
  """What the GPU backend enqueued so far in this process: data-movement
  kernels, copy-engine copies, reduction kernels, flag operations, and calls
  that read their peers' buffers in place (JAX_SMDDP_GPU_DIRECT_READS)."""
  ext = _native.cuda_engine()
  return dict(ext.counters()) if ext is not None else {}
