"""Multi-process set-up: jax_smddp over the processes of a jax.distributed job.

Call ``jax_smddp.initialize()`` after ``jax.distributed.initialize()`` (or let
jax_smddp do it: it initializes itself when it lowers its first collective in
a multi-process job). Every process must call it, in the same order relative
to its other collectives, as with any collective.

What it does, over the jax.distributed key-value store (no other cluster
manager is involved):

1. Every process publishes its host, its pid and its build: the wire protocol
   version it speaks, jax_smddp's version, a hash of its native sources and
   the jaxlib it was built against (``capabilities.build()``). Every process
   compares each peer's with its own before any link exists: processes that
   differ (hosts with different images) raise ``errors.BuildMismatchError``
   naming both, instead of misreading each other's messages later. Processes
   are on the same host when their host ids match: the hostname plus the
   network namespace (so two network namespaces on one machine act as two
   hosts, as in the tests), or ``JAX_SMDDP_HOST_ID`` where set.
2. Each pair of processes on one host shares a POSIX shared-memory segment
   (mode 0600, an unguessable name). The lower-numbered process creates it and
   publishes its name; the other maps it and says so; the creator then unlinks
   the name at once, so nothing is left in /dev/shm even if a process crashes
   later.
3. When some peers are on other hosts, each process opens a libfabric RDM
   endpoint (provider: ``JAX_SMDDP_FABRIC_PROVIDER``, default ``efa`` when
   present, else ``net`` (libfabric 1.17's TCP provider) when present, else
   ``tcp;ofi_rxm``) bound to the address it uses to reach the jax.distributed
   coordinator, and publishes its address and provider; processes whose
   providers differ raise before connecting. Each such pair
   also keeps one idle TCP connection, so that a process that dies is noticed
   by its peers at once rather than at the deadline.

Settings (environment):

JAX_SMDDP_HOST_ID           overrides the host id (processes with equal ids use
                            shared memory between them).
JAX_SMDDP_FABRIC_PROVIDER   libfabric provider for peers on other hosts.
JAX_SMDDP_FABRIC_NODE       local address to bind the endpoint to.
JAX_SMDDP_SHM_RING_BYTES    bytes of each shared-memory ring.
JAX_SMDDP_CHUNK_BYTES       bytes per message chunk.

(Their defaults: docs/settings.md, generated from the registry.)
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading

import jax

from jax_smddp import _native
from jax_smddp import _startup
from jax_smddp import capabilities
from jax_smddp import config
from jax_smddp import errors
from jax_smddp import nics
from jax_smddp import requirements

log = logging.getLogger("jax_smddp")

_lock = threading.RLock()
_generation = 0          # initialize() calls so far: keys of one never meet another's
_initialized = False
_summary: dict | None = None
_hosts: list[str] | None = None  # host id of every process
_atexit_registered = False

KV_TIMEOUT_MS = 300_000  # bootstrap waits on the key-value store (gpu.py too)
_BUILDS_BARRIER_MS = 30_000  # processes of mismatched builds meet before they raise


def _client():
  from jax_smddp._jax_internals import jax_distributed
  return jax_distributed.global_state.client


def _job() -> tuple[int, int]:
  """(this process, processes) of the job, without creating JAX's backends
  (so the plugin can connect the world before JAX's CPU client exists)."""
  from jax_smddp._jax_internals import jax_distributed
  state = jax_distributed.global_state
  if state.client is not None and state.num_processes:
    return int(state.process_id), int(state.num_processes)
  return jax.process_index(), jax.process_count()


def _host_id() -> str:
  override = config.get("JAX_SMDDP_HOST_ID")
  if override:
    return override
  try:
    netns = os.readlink("/proc/self/ns/net")
  except OSError:
    netns = "?"
  return f"{socket.gethostname()}/{netns}"


def _machine_id() -> str:
  """This kernel's boot id: equal in every process of one machine, whatever its network
  namespace or JAX_SMDDP_HOST_ID ("" where it cannot be read)."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def oversubscribed(procs: list, me: int) -> bool:
  """Whether the job's processes on this machine (the announcements in `procs` with process
  `me`'s machine id) outnumber the cores this process may use: then a call that polls its
  links while it waits takes the core its peers need, and waits poll less (the defaults of
  JAX_SMDDP_SPIN and JAX_SMDDP_YIELD)."""
  machine = procs[me].get("machine")
  if not machine:
    return False
  sharing = sum(1 for info in procs if info.get("machine") == machine)
  return sharing > len(os.sched_getaffinity(0))


def _coordinator_host() -> str | None:
  from jax_smddp._jax_internals import jax_distributed
  address = jax_distributed.global_state.coordinator_address
  if not address:
    return None
  host = address.rsplit(":", 1)[0].strip("[]")
  return host or None


def _local_address() -> str:
  """The local IP this process uses to reach the coordinator: where peers on
  other hosts can reach it too."""
  node = config.get("JAX_SMDDP_FABRIC_NODE")
  if node:
    return node
  host = _coordinator_host()
  if not host:
    return ""
  try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect((host, 9))  # no packet is sent: this only picks the route
      return s.getsockname()[0]
  except OSError:
    return ""


# What processes of one job must share, as build() names it, and as messages say it.
_BUILD_FIELDS = {"protocol": "wire protocol version", "version": "jax_smddp version",
                 "source_hash": "native build (hash of its sources)",
                 "jaxlib": "jaxlib it was built against"}


def build_id() -> dict:
  """What this process announces at initialize(): the wire protocol version it
  speaks and the build it runs. Every process of a job must announce the same."""
  built = capabilities.build()
  return {field: built.get(field) for field in _BUILD_FIELDS}


def check_builds(me: int, procs: list) -> None:
  """Raises errors.BuildMismatchError if any process's announced build (its
  entry of `procs`: {"host", "pid", "build"}) differs from process `me`'s,
  naming both and what differs. Every process runs the same comparison on the
  same announcements, so every process of a mismatched pair raises."""
  mine = procs[me]["build"]
  differences = {}
  for q, info in enumerate(procs):
    theirs = info.get("build")
    if q == me or theirs == mine:
      continue
    if not isinstance(theirs, dict):  # a jax_smddp from before builds were announced
      differences[q] = {"build": (mine, None)}
      continue
    differences[q] = {f: (mine.get(f), theirs.get(f)) for f in sorted(set(mine) | set(theirs))
                      if mine.get(f) != theirs.get(f)}
  if not differences:
    return

  def where(q):
    return f"process {q} (host {procs[q].get('host')}, pid {procs[q].get('pid')})"

  lines = []
  for q, diff in sorted(differences.items()):
    if "build" in diff:
      said = "announces no build (a jax_smddp older than this one's)"
    else:
      said = "; ".join(f"{_BUILD_FIELDS.get(f, f)} {theirs!r} there, {ours!r} here"
                       for f, (ours, theirs) in diff.items())
    lines.append(f"{where(q)} runs another build than this one, {where(me)}: {said}")
  remedy = ("Install the same jax_smddp build, built against the same jaxlib, on every host "
            "(one image for all nodes; jax_smddp.distributed.build_id() shows what a process "
            "runs) and restart the job.")
  raise errors.BuildMismatchError(
      "jax_smddp.initialize(): the processes of this job run different jax_smddp builds, which "
      "would misread each other's messages; nothing was connected. " + ". ".join(lines) + ".",
      process=me, differences=differences, remedy=remedy)


def check_fabric_providers(me: int, mine: str, theirs: dict, hosts: list) -> None:
  """Raises RuntimeError, naming the processes and their providers, if a
  peer on another host (`theirs`: {process: provider}) opened another
  libfabric provider than this process's `mine`: endpoints of two providers
  cannot reach each other. Each process picks its own when
  JAX_SMDDP_FABRIC_PROVIDER is unset (hosts with and without efa, or with
  libfabric versions that name their providers differently)."""
  differ = {q: p for q, p in sorted(theirs.items()) if p != mine}
  if not differ:
    return
  named = "; ".join(f"process {q} (host {hosts[q]}) opened {p!r}" for q, p in differ.items())
  raise RuntimeError(
      f"jax_smddp.initialize(): process {me} (host {hosts[me]}) opened libfabric provider "
      f"{mine!r} but {named}: endpoints of different providers cannot reach each other. Set "
      "JAX_SMDDP_FABRIC_PROVIDER to a provider every host offers (`fi_info -l` lists a host's; "
      "\"tcp;ofi_rxm\" runs wherever libfabric does) and restart the job.")


def is_initialized() -> bool:
  return _initialized


def initialize() -> None:
  """Connects this process's engine to every other process of the job.

  Idempotent. A single-process job needs nothing (returns at once). Raises a
  RuntimeError saying what to do when jax.distributed is not initialized in a
  multi-process job, or when a peer's set-up fails; errors.BuildMismatchError
  (in every process concerned, before any link exists) when processes run
  different jax_smddp builds.
  """
  global _initialized, _generation, _summary, _atexit_registered, _hosts
  with _lock:
    if _initialized:
      return
    me, n = _job()
    if n == 1:
      return
    requirements.enforce()
    client = _client()
    if client is None:
      raise RuntimeError(
          "jax_smddp.initialize(): this is a multi-process job but jax.distributed is not "
          "initialized here; call jax.distributed.initialize(...) first.")
    _generation += 1
    prefix = f"jax_smddp/{_generation}"
    engine = _native.engine()

    def get(key: str) -> str:
      return client.blocking_key_value_get(f"{prefix}/{key}", KV_TIMEOUT_MS)

    def put(key: str, value: str) -> None:
      client.key_value_set(f"{prefix}/{key}", value)

    host = _host_id()
    announced = {"host": host, "pid": os.getpid(), "build": build_id(), "machine": _machine_id()}
    put(f"proc/{me}", json.dumps(announced))
    procs = [json.loads(get(f"proc/{q}")) if q != me else announced for q in range(n)]
    if any(info.get("build") != announced["build"] for info in procs):
      # Every process read the same announcements, so every one is here: each
      # waits until all have read them before it raises (a process that exits
      # takes the job's coordination service down; the others' errors would be
      # JAX's, not this one naming the builds).
      try:
        client.wait_at_barrier(f"{prefix}/builds", _BUILDS_BARRIER_MS)
      except Exception:  # noqa: BLE001  (a peer too old to come: raise anyway)
        pass
      check_builds(me, procs)
    # Settings that must be equal in every process are process 0's everywhere
    # (before any link opens or any call is lowered on them).
    if me == 0:
      put("settings", json.dumps(config.agreed_values()))
    config.adopt(json.loads(get("settings")) if me != 0 else config.agreed_values(),
                 "process 0")
    crowded = oversubscribed(procs, me)
    engine.world_begin(me, n)
    try:
      engine.world_set_oversubscribed(crowded)
      for q, info in enumerate(procs):
        engine.world_set_peer(q, int(info["pid"]), info["host"])
      same = [q for q in range(n) if q != me and procs[q]["host"] == host]
      remote = [q for q in range(n) if procs[q]["host"] != host]
      for q in same:
        if me < q:
          put(f"shm/{me}/{q}", engine.world_create_shm(q))
      for q in same:
        if q < me:
          engine.world_open_shm(q, get(f"shm/{q}/{me}"))
          put(f"shm_mapped/{q}/{me}", "1")
      for q in same:
        if me < q:
          get(f"shm_mapped/{me}/{q}")
          engine.world_unlink_shm(q)
      provider = ""
      my_nics, nics_how = [], None
      if remote:
        node = _local_address()
        requested = config.get("JAX_SMDDP_FABRIC_PROVIDER") or ""
        local = [q for q in range(n) if procs[q]["host"] == host]
        my_nics, nics_how = nics.choose(config.get("JAX_SMDDP_NICS"), local.index(me),
                                        len(local), node, provider=requested)
        addresses, provider = engine.world_open_fabric(requested,
                                                       [nic["node"] for nic in my_nics])
        if not requested and provider != "efa":
          requirements.warn_once(
              f"the network between hosts uses libfabric's {provider} provider",
              "no efa provider here (set JAX_SMDDP_FABRIC_PROVIDER to choose one, "
              "JAX_SMDDP_REQUIRE=efa to fail instead)")
        put(f"fabric/{me}", json.dumps({
            "provider": provider, "addresses": [a.hex() for a in addresses],
            "nics": [{"name": nic["name"], "network": nic["network"]} for nic in my_nics]}))
        put(f"watch/{me}", engine.world_watch_listen(node))
        endpoints = {q: json.loads(get(f"fabric/{q}")) for q in remote}
        check_fabric_providers(me, provider, {q: e["provider"] for q, e in endpoints.items()},
                               [info["host"] for info in procs])
        for q in remote:
          theirs = endpoints[q]
          engine.world_connect_fabric(
              q, [(i, bytes.fromhex(theirs["addresses"][j]))
                  for i, j in nics.pairs(my_nics, theirs["nics"], me, q)])
        for q in remote:
          if q < me:
            engine.world_watch_connect(q, get(f"watch/{q}"))
        engine.world_watch_accept([q for q in remote if q > me])
      engine.world_start()
    except BaseException:
      engine.world_shutdown()
      raise
    # The tuner decides from process 0's inputs in every process, so all
    # choose the same routes and chunks whatever their own calibration files
    # and settings (the engine fails calls on which processes disagree).
    from jax_smddp import tuning
    if me == 0:
      put("tuning", tuning.local_inputs())
    tuning.set_job_inputs(get("tuning") if me != 0 else tuning.local_inputs())
    # Nobody runs a collective until every process is connected.
    client.wait_at_barrier(f"{prefix}/ready", KV_TIMEOUT_MS)
    _initialized = True
    _hosts = [info["host"] for info in procs]
    _summary = {"process": me, "processes": n, "host": host,
                "shared_memory_peers": same, "network_peers": remote,
                "fabric_provider": provider or None,
                "nics": [{"name": nic["name"], "node": nic["node"]} for nic in my_nics],
                "nics_chosen_by": nics_how, "oversubscribed": crowded,
                "wait_polls": dict(zip(("spin", "yield"), engine.wait_polls(crowded)))}
    log.info("jax_smddp initialized: %s", _summary)
    if not _atexit_registered:
      atexit.register(_shutdown_at_exit)
      _atexit_registered = True


def shutdown() -> None:
  """Releases the links to other processes (idempotent). Collectives already
  running finish first; later multi-process collectives need initialize().

  Every process of the job calls it (at exit it runs by itself). Before it
  closes its links to other hosts, a process waits until each process there
  has called it too or exited, at most JAX_SMDDP_TIMEOUT_S: what it sent last
  may still be on its way to a peer finishing its collectives, and closing
  the links would drop it."""
  _shutdown(farewell=True)


def _shutdown_at_exit() -> None:
  # A program ending on an uncaught exception does not wait: its peers, maybe
  # waiting on it in a collective, learn at once that it is gone.
  _shutdown(farewell=not hasattr(sys, "last_value"))


def _shutdown(farewell: bool) -> None:
  global _initialized, _summary
  with _lock:
    if not _initialized:
      return
    engine = _native.engine()
    if farewell:
      silent = engine.world_farewell()
      if silent:
        log.warning("jax_smddp.shutdown: processes %s on other hosts neither shut down nor exited "
                    "within JAX_SMDDP_TIMEOUT_S (%g s); closing the links to them anyway",
                    silent, config.timeout())
    engine.world_shutdown()
    from jax_smddp import tuning
    tuning.set_job_inputs(None)
    _initialized = False
    _summary = None


def host_of_process() -> list[str] | None:
  """The host id of every process (None before initialize())."""
  return list(_hosts) if _hosts else None


def topology() -> dict | None:
  """What initialize() found: this process, its shared-memory and network
  peers, the libfabric provider, this process's NICs (``nics``: name and the node its endpoint
  opened on; ``nics_chosen_by``: JAX_SMDDP_NICS or the topology), whether the job's processes on
  this machine outnumber its cores (``oversubscribed``) and the polls a waiting call makes
  before it yields and before it sleeps (``wait_polls``: JAX_SMDDP_SPIN and JAX_SMDDP_YIELD, or
  their defaults for this machine). None before initialize()."""
  return dict(_summary) if _summary else None


def traffic() -> dict:
  """Bytes this process moved to and from each peer process since
  initialize(), by link: {peer: {"link": "shared memory", "sent": .., "received": ..}}.
  Shows the routes at work (e.g. between hosts, hierarchical routes send each
  byte once per host). Links with a path that skips intermediate copies add
  "single_copy" ("on", or "off: " and why) and "single_copy_received" (the
  received bytes that took it): shared-memory links read straight from the
  peer's memory; libfabric links receive large messages straight into the
  destination (JAX_SMDDP_FABRIC_DIRECT_BYTES)."""
  out = {}
  for p, kind, sent, received, single_bytes, single in _native.engine().world_traffic():
    out[p] = {"link": kind, "sent": sent, "received": received}
    if single:
      out[p].update(single_copy=single, single_copy_received=single_bytes)
  return out


# The function through which XLA's own collectives reach jax_smddp under the XLA-level swap,
# for each XLA collective. On CPU (jax_smddp.swap.xla), MPI: XLA's MPI communicator
# (xla/backends/cpu/collectives/mpi_communicator.cc) makes an all-to-all of MPI_Sendrecv
# calls and a collective-permute of MPI_Irecv/MPI_Isend; the world counts the receiving side.
# On GPUs (jax_smddp.swap.nccl), NCCL: the calls its front end serves.
_XLA_OP_OF_MPI = {"MPI_Allgather": "all-gather", "MPI_Reduce_scatter": "reduce-scatter",
                  "MPI_Allreduce": "all-reduce", "MPI_Sendrecv": "all-to-all",
                  "MPI_Irecv": "collective-permute"}
_XLA_OP_OF_NCCL = {"ncclAllGather": "all-gather", "ncclReduceScatter": "reduce-scatter",
                   "ncclAllReduce": "all-reduce", "ncclAlltoAll": "all-to-all",
                   "ncclSend/ncclRecv": "collective-permute"}


def traffic_by_op() -> dict:
  """The collectives this process's devices ran on jax_smddp's engine since initialize(),
  by the op as the compiled program names it: jax_smddp's custom calls
  (``smddp_all_gather``, ...) and, under the XLA-level swap (JAX_SMDDP_COLLECTIVES=xla),
  XLA's own collectives (``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``,
  ``collective-permute`` on CPU, through the MPI ABI library; ``all-gather``,
  ``reduce-scatter``, ``all-reduce``, ``all-to-all``, ``collective-permute`` on GPUs, the
  calls the NCCL API front end served):
  {op: {"calls": .., "bytes": ..}}, summed over the process's devices. ``bytes``: what the
  calls delivered into their outputs (for XLA's all-to-all and collective-permute, what the
  devices received from other devices: XLA copies a device's own block itself). Ops that
  never ran here are left out. A one-process job counts its calls too, from the engine's first
  call. Read it before and after a step for what the step's collectives moved and which
  library moved them: an op absent here ran on another library."""
  out = {}
  cuda = _native.cuda_engine()
  # The CUDA engine counts a one-process job's GPU calls apart (no world to share).
  alone = cuda.alone_calls() if cuda is not None else []
  for name, calls, nbytes in [*_native.engine().world_calls(), *alone]:
    op = _XLA_OP_OF_MPI.get(name) or _XLA_OP_OF_NCCL.get(name) or f"smddp_{name}"
    counted = out.setdefault(op, {"calls": 0, "bytes": 0})  # a process with both backends
    counted["calls"] += calls
    counted["bytes"] += nbytes
  return out


def call_phases() -> dict:
  """Where this process's calls across processes spent their time since it started, by
  collective: ``{op: {"calls": n, "local_s": .., "queue_s": .., "agree_s": .., "body_s": ..,
  "wait_s": .., "sleep_s": .., "sleeps": .., "inline_calls": ..}}`` (op ``all_gather``,
  ``reduce_scatter``, ``all_reduce`` or ``all_to_all``; seconds, sleeps and inline calls summed
  over the calls). A call's time from
  the first of this process's devices reaching it to its end is local + queue + agree + body:

  - ``local_s``: until the process's last device reached the call;
  - ``queue_s``: until the last device's XLA thread started it;
  - ``agree_s``: the check that every process runs the same call (an exchange with every peer
    process) outside the body: between the body's start on XLA's thread and its rest (the wait
    for the peers' views of a call that may stay on XLA's thread, and the hand-off to an
    engine worker of a call that does not: a larger one, or one whose peers are late) and the
    wait for views still in flight once the body is done; the ``inline_calls`` ran wholly on
    XLA's thread (calls smaller than JAX_SMDDP_INLINE_BYTES whose peers were in the call
    within JAX_SMDDP_INLINE_WAIT_US; JAX_SMDDP_INLINE_ONE_HOST_BYTES and _WAIT_US when every
    process of the group is on this host, unless its processes outnumber its cores);
  - ``body_s``: the collective's own transfers, copies and reductions, started at once (the
    views are compared as they arrive), so a peer that reaches the call late shows here;
  - ``wait_s``: the part of agree and body spent waiting for links to finish transfers, and
    ``sleep_s`` (``sleeps`` times) of that asleep rather than polling.

  Calls that completed are counted; calls of one process alone are not (they cross no process).
  Read it before and after a loop and divide the difference by the calls made in between (the
  benchmark's ``--phases`` does)."""
  return {op: {k: (int(v) if k in ("calls", "sleeps", "inline_calls") else v)
               for k, v in phases.items()}
          for op, phases in _native.engine().call_phases()}


def xla_collectives() -> str:
  """Which library runs XLA's own collectives (those jax.lax lowers to XLA, and those
  XLA's partitioner inserts into global-view jit programs) in this process:
  ``"jax_smddp"`` under the XLA-level swap (JAX_SMDDP_COLLECTIVES=xla), else JAX's CPU
  implementation across processes (``"gloo"``, ``"mpi"``), ``"in-process"`` in a
  one-process job on the CPU, and the platform's library elsewhere (``"nccl"`` on
  GPUs, ``"jax_smddp"`` there too when the NCCL API front end serves them:
  jax_smddp.swap.nccl). Creates JAX's backend if it does not exist yet."""
  backend = jax.default_backend()
  if backend == "gpu":
    from jax_smddp.swap import nccl as nccl_swap
    front_end = nccl_swap.front_end()
    return "jax_smddp" if front_end and front_end["active"] else "nccl"
  if backend != "cpu":
    return backend
  if jax.process_count() == 1:
    return "in-process"
  impl = str(jax.config.jax_cpu_collectives_implementation or "gloo")
  if impl == "mpi" and os.environ.get("MPITRAMPOLINE_LIB") == _startup.library_path():
    return "jax_smddp"
  return impl


def ensure_initialized() -> None:
  """Initializes on first use in a multi-process job (called at lowering)."""
  if not _initialized and _job()[1] > 1:
    initialize()
