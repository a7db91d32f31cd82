"""One rank of tests/gpu/test_kernels.py, in a process of its own: allocates
its staging regions, trades CUDA IPC handles with the other ranks through the
parent, then runs the collectives it is sent with stream_run and returns the
outputs and its counters; for direct reads it first makes its send and receive
buffers and returns their handles, which the parent hands to every rank. No JAX or XLA is involved beyond importing the
extension."""

from __future__ import annotations


def serve(rank: int, conn, flag_memory: str = "device") -> None:
  import os
  os.environ["JAX_SMDDP_GPU_FLAG_MEMORY"] = flag_memory  # read when regions are prepared
  from jax_smddp import _native
  ext = _native.cuda_engine()
  try:
    groups = conn.recv()  # [(members, slot_bytes)]: one communicator per slot size
    ext.set_process(rank)
    conn.send([ext.prepare(members, slot, [(rank, 0)], len(members)) for members, slot in groups])
    for (members, _), remote in zip(groups, conn.recv()):
      ext.connect(members, remote)
    conn.send(("ready", None))
    while (job := conn.recv()) is not None:
      if isinstance(job, tuple):  # ("buffers", in_bytes, out_bytes): for direct reads
        conn.send(("ok", ext.stream_direct_buffers(0, job[1], job[2])))
        continue
      out = ext.stream_run(**job)
      conn.send(("ok", (out, dict(ext.counters()))))
  except Exception as e:  # the parent fails the test with it
    conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
  finally:
    ext.mark_closed()  # an orderly end, not a death, for the peers' watchdogs
