"""Typed failures of jax_smddp's collectives.

A collective that fails at run time reaches Python as JAX's runtime error
(``jax.errors.JaxRuntimeError``; ``XlaRuntimeError`` in older jaxlibs), whose
text starts with a status that says what kind of failure it was::

    DEADLINE_EXCEEDED: jax_smddp[timeout] all_gather (op 0 of communicator devices [0 1]): ...
    UNAVAILABLE: jax_smddp[peer_failed] all_reduce (...): process 1 (devices [1]) failed (...)
    FAILED_PRECONDITION: jax_smddp[mismatch] all_gather (...): processes disagree on the call ...
    DATA_LOSS: jax_smddp[protocol] all_gather (...): process 1 (devices [1]) sent what this
      process cannot parse (...)

``classify`` turns such an error into one of the exception classes below,
with the op, the peers it concerns and what to do; other exceptions give
None::

    try:
      step(state, batch)
    except Exception as e:
      err = jax_smddp.errors.classify(e)
      if isinstance(err, jax_smddp.errors.PeerFailedError):
        save_checkpoint(state)   # a peer is gone: the job must restart
      raise

The engine also keeps the failures it saw in this process (``last_failure``):
the text JAX passes on carries no structure, the record does.

Processes that run different builds never get that far: ``jax_smddp.initialize()``
compares every process's wire protocol version and build and raises
:class:`BuildMismatchError`, naming them, before any link is used.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

__all__ = [
    "CollectiveError", "PeerTimeoutError", "PeerFailedError", "CallMismatchError",
    "UnsupportedCollectiveError", "InvalidCollectiveArgumentError", "ProtocolError",
    "InternalCollectiveError", "BuildMismatchError",
    "Failure", "Peers", "classify", "last_failure", "recent_failures",
]


@dataclasses.dataclass(frozen=True)
class Peers:
  """The peers a failure concerns: ranks of the communicator, their device ids
  and their processes (each empty where the engine did not know)."""
  ranks: Tuple[int, ...] = ()
  devices: Tuple[int, ...] = ()
  processes: Tuple[int, ...] = ()

  def __bool__(self) -> bool:
    return bool(self.ranks or self.processes)


@dataclasses.dataclass(frozen=True)
class Failure:
  """One failed collective call as the engine recorded it."""
  op: str                      # "all_gather", "reduce_scatter", "all_reduce", "all_to_all"
  code: str                    # "timeout", "peer_failed", "mismatch", "unsupported", ...
  devices: Tuple[int, ...]     # the communicator (its ranks' device ids); () if unknown
  rank: int                    # the rank whose call failed; -1 if unknown
  peers: Peers
  message: str
  remedy: str
  time: float                  # when, in seconds since the epoch
  sequence: int                # order of recording within one native module

  @classmethod
  def _from_native(cls, d: dict) -> "Failure":
    devices = tuple(int(x) for x in d["devices"])
    ranks = tuple(int(r) for r in d["peer_ranks"])
    peer_devices = tuple(devices[r] for r in ranks if 0 <= r < len(devices)) if devices else ()
    return cls(op=d["op"], code=d["code"], devices=devices, rank=int(d["rank"]),
               peers=Peers(ranks, peer_devices, tuple(int(p) for p in d["peer_processes"])),
               message=d["message"], remedy=d["remedy"], time=float(d["time"]),
               sequence=int(d["sequence"]))


class CollectiveError(RuntimeError):
  """A jax_smddp collective failed at run time.

  Attributes: ``code`` (the engine's kind of failure), ``status`` (the
  status XLA gives that kind), ``jax_status`` (the one JAX's text started
  with: ``status``, or INTERNAL where XLA rewrapped the failure), ``op``, ``devices`` (the
  communicator, when known), ``peers`` (:class:`Peers`), ``remedy`` (what
  to do), ``message`` (the engine's message), ``failure`` (the engine's
  record, when it was found) and ``original`` (the exception JAX raised).
  """
  code = "internal"
  status = "INTERNAL"

  def __init__(self, message: str, *, op: Optional[str] = None, devices: Tuple[int, ...] = (),
               peers: Peers = Peers(), remedy: str = "", failure: Optional[Failure] = None,
               original: Optional[BaseException] = None):
    super().__init__(message + (f"\nWhat to do: {remedy}" if remedy else ""))
    self.message = message
    self.op = op
    self.devices = tuple(devices)
    self.peers = peers
    self.remedy = remedy
    self.failure = failure
    self.original = original
    self.jax_status = self.status


class PeerTimeoutError(CollectiveError):
  """A peer did not reach the collective before the deadline
  (``JAX_SMDDP_TIMEOUT_S`` / ``jax_smddp.set_timeout``): it never arrived,
  stalled, or is much slower."""
  code = "timeout"
  status = "DEADLINE_EXCEEDED"


class PeerFailedError(CollectiveError):
  """A peer process died, closed its link, or failed an earlier collective."""
  code = "peer_failed"
  status = "UNAVAILABLE"


class CallMismatchError(CollectiveError):
  """Ranks or processes ran different calls (op, shape, dtype, reduction)."""
  code = "mismatch"
  status = "FAILED_PRECONDITION"


class UnsupportedCollectiveError(CollectiveError):
  """A case jax_smddp's engine does not take."""
  code = "unsupported"
  status = "UNIMPLEMENTED"


class InvalidCollectiveArgumentError(CollectiveError):
  """A collective's arguments or set-up are invalid (replica groups,
  settings, jax_smddp not initialized in a multi-process job)."""
  code = "invalid_argument"
  status = "INVALID_ARGUMENT"


class ProtocolError(CollectiveError):
  """A peer sent what this process cannot parse: a chunk whose header is
  malformed (a wrong magic, another wire protocol version, a length past its
  end, a sender outside the job), dropped unread. The processes run different
  builds (where initialize() could not tell), or memory or the network
  corrupted the data; told apart from a dead peer (:class:`PeerFailedError`)
  and a slow one (:class:`PeerTimeoutError`)."""
  code = "protocol"
  status = "DATA_LOSS"


class InternalCollectiveError(CollectiveError):
  """Any other failure inside jax_smddp or the system (a bug, memory, CUDA)."""
  code = "internal"
  status = "INTERNAL"


class BuildMismatchError(CollectiveError):
  """Raised by ``jax_smddp.initialize()``: processes of the job run different
  jax_smddp builds (wire protocol version, jax_smddp version, native build or
  the jaxlib it was built against), so they would misread each other's
  messages. Nothing was connected.

  Attributes besides CollectiveError's: ``process`` (this process),
  ``peers.processes`` (those whose build differs from this one's) and
  ``differences``: {process: {field: (this process's value, that process's)}}.
  """
  code = "build_mismatch"
  status = "FAILED_PRECONDITION"

  def __init__(self, message: str, *, process: int, differences: dict, remedy: str = ""):
    super().__init__(message, peers=Peers(processes=tuple(sorted(differences))), remedy=remedy)
    self.process = process
    self.differences = differences


_CLASSES = {c.code: c for c in (PeerTimeoutError, PeerFailedError, CallMismatchError,
                                UnsupportedCollectiveError, InvalidCollectiveArgumentError,
                                ProtocolError, InternalCollectiveError)}

# "DEADLINE_EXCEEDED: jax_smddp[timeout] all_gather (op 0 of communicator devices [0 1]): ...":
# XLA's name of the handler's code, then the handlers' tag (xla_ffi/ffi/ffi_status.h). When
# the failure surfaces while XLA dispatches a later computation, XLA rewraps it
# ("INTERNAL: Error dispatching computation: jax_smddp[peer_failed] ..."): the tag decides.
_STATUSES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
             "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
             "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
             "UNAUTHENTICATED")
_STATUS = re.compile(r"^(%s): " % "|".join(_STATUSES))
_TAG = re.compile(r"jax_smddp\[([a-z_]+)\]")
# The peers a message names, where the engine's record is gone or was made by
# another native module (the GPU front end's): "rank 1 (process 1, pid 42)",
# "ranks 2, 3 (process 1, ...)" (the GPU groups' watch), "process 1 (devices
# [2 3])" (the CPU engine); a reporter, " (reported by ...)", is not a peer.
_RANKS_OF = re.compile(r"\branks? (\d+(?:, \d+)*) \(process (\d+)[,)]")
_DEVICES_OF = re.compile(r"\bprocess (\d+) \(devices \[([-\d ]*)\]\)")


def _peers_named(message: str) -> Peers:
  text = message.split(" (reported by ")[0]
  ranks, devices, processes = [], [], []
  for m in _RANKS_OF.finditer(text):
    ranks += [int(r) for r in m.group(1).split(", ")]
    processes.append(int(m.group(2)))
  for m in _DEVICES_OF.finditer(text):
    processes.append(int(m.group(1)))
    devices += [int(d) for d in m.group(2).split()]
  unique = lambda xs: tuple(dict.fromkeys(xs))
  return Peers(unique(ranks), unique(devices), unique(processes))


_WHERE = re.compile(r"^jax_smddp\[[a-z_]+\](?: \(GPU\))?:? (?:(\w+) \(op \d+(?: of communicator "
                    r"devices \[([-\d ]*)\])?\))?")


def recent_failures() -> list:
  """The collective failures the engine recorded lately in this process
  (at most 32 per native module), oldest first."""
  from jax_smddp import _native
  records = [Failure._from_native(d) for d in _native.engine().recent_failures()]
  cuda = _native.cuda_engine()
  if cuda is not None and hasattr(cuda, "recent_failures"):
    records += [Failure._from_native(d) for d in cuda.recent_failures()]
  return sorted(records, key=lambda f: (f.time, f.sequence))


def last_failure() -> Optional[Failure]:
  """The last collective failure the engine recorded in this process, or None."""
  records = recent_failures()
  return records[-1] if records else None


def _untagged(text: str, code: str) -> Tuple[str, str]:
  tag = f"jax_smddp[{code}]"
  return text.replace(tag + " ", "", 1), text.replace(tag, "jax_smddp", 1)


def classify(exc: BaseException) -> Optional[CollectiveError]:
  """The typed error for `exc` if it is a jax_smddp collective's failure
  (JAX's runtime error, or a CollectiveError already), else None.

  The error's text must start with a status (``DEADLINE_EXCEEDED: ``...) and
  carry jax_smddp's tag, which gives the kind (whatever exception class JAX
  used: JaxRuntimeError, or ValueError as seen with one device per process); op,
  communicator, peers and remedy from the engine's record of the same
  failure, or, where that record is gone, what the text says.
  """
  if isinstance(exc, CollectiveError):
    return exc
  if not isinstance(exc, Exception):
    return None
  text = str(exc).strip()
  status, tag = _STATUS.match(text), _TAG.search(text)
  if status is None or tag is None or tag.group(1) not in _CLASSES:
    return None  # not a runtime error from jax_smddp's handlers
  code, message = tag.group(1), text[tag.start():]
  cls = _CLASSES[code]
  failure = None
  for f in reversed(recent_failures()):
    if f.code == code and f.message and any(f.message in t for t in _untagged(message, code)):
      failure = f
      break
  if failure is not None:
    err = cls(message, op=failure.op, devices=failure.devices, peers=failure.peers,
              remedy=failure.remedy, failure=failure, original=exc)
  else:
    where = _WHERE.match(message)
    op = where.group(1) if where else None
    devices = tuple(int(d) for d in where.group(2).split()) if where and where.group(2) else ()
    err = cls(message, op=op, devices=devices, peers=_peers_named(message), remedy=_remedy(code),
              original=exc)
  err.jax_status = status.group(1)
  return err


def _remedy(code: str) -> str:
  # The engine's remedy for a kind of failure (one text: xla_ffi/engine/last_failure.h).
  from jax_smddp import _native
  return _native.engine().failure_remedies().get(code, "")
