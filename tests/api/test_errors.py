"""User-facing errors: at trace time, and the engine's deadline when a peer
never arrives (error on the others, no hang, no crash)."""

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from jax_smddp import _native
from helpers import mesh_1d, random_array, run


def test_outside_shard_map_names_the_fix():
  with pytest.raises(NameError, match=r"inside jax.shard_map"):
    jax.jit(lambda v: smddp.all_gather(v, "x"))(jnp.ones(4))


def test_unbound_axis_name():
  x = random_array((8 * 2,), np.float32)
  with pytest.raises(NameError, match=r"axis name 'y' is not bound"):
    run(lambda v: smddp.psum(v, "y"), x, mesh_1d(), P("x"), P())


def test_tiled_scatter_not_divisible():
  x = random_array((8 * 3,), np.float32)
  with pytest.raises(ValueError, match=r"not divisible by the 8 ranks.*pad"):
    run(lambda v: smddp.psum_scatter(v, "x", tiled=True), x, mesh_1d(), P("x"), P("x"))


def test_untiled_scatter_wrong_size():
  x = random_array((8 * 3,), np.float32)
  with pytest.raises(ValueError, match=r"must be equal"):
    run(lambda v: smddp.psum_scatter(v, "x"), x, mesh_1d(), P("x"), P("x"))


def test_reduction_of_bool_is_refused():
  x = random_array((8 * 8,), np.bool_)
  with pytest.raises(TypeError, match=r"cast to an integer"):
    run(lambda v: smddp.psum_scatter(v, "x", tiled=True), x, mesh_1d(), P("x"), P("x"))
  with pytest.raises(TypeError, match=r"cast to an integer"):
    run(lambda v: smddp.pmax(v, "x"), x, mesh_1d(), P("x"), P())


def test_bad_reduce_op_and_axis():
  x = random_array((8 * 8,), np.float32)
  with pytest.raises(ValueError, match=r"op must be one of"):
    run(lambda v: smddp.all_reduce(v, "x", op="prod"), x, mesh_1d(), P("x"), P())
  with pytest.raises(ValueError, match=r"out of range"):
    run(lambda v: smddp.all_gather(v, "x", axis=3), x, mesh_1d(), P("x"), P("x"))


def test_set_timeout_validates():
  with pytest.raises(ValueError):
    smddp.set_timeout(0)
  old = smddp.timeout()
  smddp.set_timeout(12.5)
  assert smddp.timeout() == 12.5
  # The CUDA module's engine copy (the GPU network proxy's deadline) follows.
  cuda = _native.cuda_engine()
  assert cuda is None or cuda.timeout() == 12.5
  smddp.set_timeout(old)
  assert cuda is None or cuda.timeout() == old


SKIPPING_RANK = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, NamedSharding
    import jax_smddp as smddp
    smddp.set_timeout(1.0)
    mesh = jax.make_mesh((4,), ("x",))
    def body(v):
      i = jax.lax.axis_index("x")
      return jax.lax.cond(i == 2, lambda u: u * 1.0, lambda u: smddp.psum(u, "x") * 1.0, v)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    assert smddp.errors.last_failure() is None
    try:
      f(x).block_until_ready()
      print("NO ERROR")
    except Exception as e:
      print("ERROR:", e)
      err = smddp.errors.classify(e)
      last = smddp.errors.last_failure()
      print("TYPED " + json.dumps({
          "class": type(err).__name__, "is_collective_error": isinstance(err, smddp.errors.CollectiveError),
          "is_runtime_error": isinstance(err, RuntimeError), "original": err.original is e,
          "op": err.op, "devices": list(err.devices), "peer_ranks": list(err.peers.ranks),
          "peer_devices": list(err.peers.devices), "remedy": err.remedy,
          "last": {"code": last.code, "op": last.op, "message": last.message}}))
  """)


@pytest.mark.timeout(120)
def test_jax_program_with_a_rank_that_skips_the_collective_raises(tmp_path):
  # One device takes a branch without the collective: the others must raise
  # an error naming the missing rank within the deadline, not hang; it is a
  # PeerTimeoutError naming that rank, op and communicator.
  path = tmp_path / "skip.py"
  path.write_text(SKIPPING_RANK)
  start = time.monotonic()
  proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=100)
  elapsed = time.monotonic() - start
  out = proc.stdout + proc.stderr
  assert "ERROR:" in proc.stdout, out
  assert "timed out" in out and "rank(s) 2" in out, out
  assert elapsed < 60, elapsed
  assert "ERROR: DEADLINE_EXCEEDED: jax_smddp[timeout] all_reduce (op " in proc.stdout, out
  typed = json.loads(proc.stdout.split("TYPED ", 1)[1].splitlines()[0])
  assert typed["class"] == "PeerTimeoutError", typed
  assert typed["is_collective_error"] and typed["is_runtime_error"] and typed["original"], typed
  assert typed["op"] == "all_reduce" and typed["devices"] == [0, 1, 2, 3], typed
  assert typed["peer_ranks"] == [2] and typed["peer_devices"] == [2], typed
  assert "JAX_SMDDP_TIMEOUT_S" in typed["remedy"], typed
  assert typed["last"]["code"] == "timeout" and typed["last"]["op"] == "all_reduce", typed


def test_classify_leaves_other_errors_alone():
  for e in (ValueError("bad value"), KeyboardInterrupt(),
            RuntimeError("INTERNAL: some XLA failure"),
            RuntimeError("DEADLINE_EXCEEDED: jax_smddp timed out"),  # no tag: not the handlers'
            RuntimeError("jax_smddp[timeout] all_gather (op 0): x"),  # no status: not from XLA
            RuntimeError("INTERNAL: jax_smddp[bogus] all_gather (op 0): x")):  # no such kind
    assert smddp.errors.classify(e) is None, e


def test_classify_reads_the_text_when_the_record_is_gone():
  # An error text from another process (or a record pushed out): the kind,
  # op and communicator come from the text, the remedy from the engine.
  # As XLA rewraps a failure that surfaces while it dispatches a later computation
  # (seen with a peer killed mid-collective, jax 0.10.2).
  e = ValueError("INTERNAL: Error dispatching computation: Error dispatching computation: "
                 "jax_smddp[peer_failed] all_gather (op 3 of communicator devices "
                   "[0 1 2 3]): process 1 (devices [2 3]) failed (process 99 exited, over shared "
                   "memory); this collective cannot complete")
  err = smddp.errors.classify(e)
  assert isinstance(err, smddp.errors.PeerFailedError) and err.failure is None
  assert err.op == "all_gather" and err.devices == (0, 1, 2, 3) and err.original is e
  assert err.jax_status == "INTERNAL" and err.status == "UNAVAILABLE"
  assert err.message.startswith("jax_smddp[peer_failed] all_gather (op 3")
  assert err.remedy == _native.engine().failure_remedies()["peer_failed"] and "restart" in err.remedy
  assert err.peers == smddp.errors.Peers((), (2, 3), (1,))  # not process 99, which only exited
  assert smddp.errors.classify(err) is err


def test_classify_names_the_peers_of_the_gpu_front_ends_messages():
  # XLA's own NCCL calls served by libsmddp_nccl.so: its failures are not in
  # this process's engine record, so the peers come from the text (seen on an
  # H200: a killed peer's process named, the reporter not a peer).
  text = ("INTERNAL: Failed to complete all kernels launched on stream 0x1: NCCL operation "
          "ncclAllGather failed: remote process exited or there was a network error. Last NCCL "
          "error: jax_smddp[peer_failed] (GPU): ranks 2, 3 (process 1, pid 4242) of group "
          "[11 12 13 14] is gone (its process exited) (reported by rank 0 (process 0, pid 77))")
  err = smddp.errors.classify(RuntimeError(text))
  assert isinstance(err, smddp.errors.PeerFailedError), err
  assert err.peers == smddp.errors.Peers((2, 3), (), (1,)) and bool(err.peers)
  aborted = ("UNAVAILABLE: jax_smddp[peer_failed] jax_smddp NCCL front end: rank 1 (process 1) "
             "aborted the communicator (ncclCommAbort)")
  assert smddp.errors.classify(RuntimeError(aborted)).peers.processes == (1,)


def test_a_protocol_error_is_typed_apart_from_a_dead_peer():
  text = ("DATA_LOSS: jax_smddp[protocol] all_gather (op 0 of communicator devices [0 1]): process 1 "
          "(devices [1]) sent what this process cannot parse (libfabric (tcp;ofi_rxm): malformed chunk "
          "from process 1: magic 0x46444d73 instead of jax_smddp's 0x46444d53 ...)")
  err = smddp.errors.classify(RuntimeError(text))
  assert type(err) is smddp.errors.ProtocolError and err.status == "DATA_LOSS", err
  assert not isinstance(err, (smddp.errors.PeerFailedError, smddp.errors.PeerTimeoutError))
  assert err.op == "all_gather" and err.devices == (0, 1)
  assert err.remedy == _native.engine().failure_remedies()["protocol"] and "same jax_smddp" in err.remedy


def _announcement(host, pid, **build):
  from jax_smddp import distributed
  return {"host": host, "pid": pid, "build": {**distributed.build_id(), **build}}


def test_builds_that_differ_are_named_with_what_differs():
  from jax_smddp import distributed
  procs = [_announcement("h0", 10), _announcement("h0", 11),
           _announcement("h1", 12, jaxlib="0.9.9", version="0.0.1"), {"host": "h2", "pid": 13}]
  distributed.check_builds(0, procs[:2])  # equal builds: nothing to say
  with pytest.raises(smddp.errors.BuildMismatchError) as e:
    distributed.check_builds(0, procs)
  err = e.value
  assert isinstance(err, smddp.errors.CollectiveError) and err.status == "FAILED_PRECONDITION"
  assert err.process == 0 and err.peers.processes == (2, 3)
  mine = distributed.build_id()
  assert err.differences[2] == {"jaxlib": (mine["jaxlib"], "0.9.9"), "version": (mine["version"], "0.0.1")}
  assert err.differences[3] == {"build": (mine, None)}
  text = str(err)
  assert "process 2 (host h1, pid 12) runs another build than this one, process 0 (host h0, pid 10)" in text
  assert f"jaxlib it was built against '0.9.9' there, '{mine['jaxlib']}' here" in text
  assert f"jax_smddp version '0.0.1' there, '{mine['version']}' here" in text
  assert "process 3 (host h2, pid 13)" in text and "announces no build" in text
  assert "What to do: Install the same jax_smddp build" in text
