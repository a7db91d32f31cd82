"""One process of a multi-process ``python -m jax_smddp.tools.bench`` run.

Started by :func:`jax_smddp.tools.launch.run_job` from :mod:`jax_smddp.tools.bench`::

    python -m jax_smddp.tools.bench_worker [bench options] PROCESS_ID NUM_PROCESSES COORDINATOR DEVICES

PROCESS_ID is "mpi" when Open MPI's mpirun started the job (``--mpi4jax``): the
index is then OMPI_COMM_WORLD_RANK. Each worker asks XLA for DEVICES CPU devices, selects JAX's default CPU
collectives across processes (gloo, the baseline), joins the jax.distributed
job and runs :func:`jax_smddp.tools.bench.core.run_benchmark` over a 1-D mesh of all global
devices: every process checks its shards of jax_smddp's result against
jax.lax's, then times the alternating calls. It prints one line ``RESULT
<json>``: ``{"ok": true, "topology": ..., "results": [...]}`` (results from
process 0 only) or ``{"ok": false, "error": ...}``.

gloo advertises the address its host name resolves to; in simulated hosts
(network namespaces on one machine) that is a loopback address the other
"host" cannot reach, so when the coordinator is not on loopback gloo is told to
use the local address that routes to the coordinator instead (the same one
jax_smddp binds its libfabric endpoint to).

A job started by the user's launcher (mpirun, srun) runs no bench_worker: every process of it
is ``python -m jax_smddp.tools.bench`` itself (:mod:`jax_smddp.tools.bench.in_job`), which
selects gloo here (:func:`use_gloo`) and runs the same :func:`run_benchmark`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback


def _result(**kw) -> None:
  print("RESULT " + json.dumps(kw), flush=True)


def _route_address(host: str) -> str | None:
  """The local IP this process uses to reach `host` (no packet is sent)."""
  try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect((host, 9))
      return s.getsockname()[0]
  except OSError:
    return None


def use_gloo(coordinator: str) -> str | None:
  """JAX's gloo CPU collectives; bound to the coordinator-facing address when
  the coordinator is not on loopback. Returns that address (None: gloo's own
  choice)."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  host = coordinator.rsplit(":", 1)[0].strip("[]")
  if host in ("localhost", "::1") or host.startswith("127."):
    return None
  address = _route_address(host)
  if not address:
    return None
  try:  # private API (jax 0.4.3x - 0.12): the CPU backend factory, gloo with a hostname
    from jax_smddp._jax_internals import jax_distributed as distributed
    from jax_smddp._jax_internals import jaxlib_jax, xla_bridge
    make_gloo = jaxlib_jax.make_gloo_tcp_collectives
  except ImportError:  # _jax_internals.JaxInternalMoved: no gloo with a hostname here
    return None

  def make_cpu_client():
    collectives = make_gloo(distributed_client=distributed.global_state.client, hostname=address)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
  return address


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if len(argv) < 4:
    print(__doc__, file=sys.stderr)
    return 2
  # Under mpirun (--mpi4jax) every process gets "mpi" and is told its index by Open MPI.
  rank = os.environ.get("OMPI_COMM_WORLD_RANK") if argv[-4] == "mpi" else argv[-4]
  pid, nprocs, coordinator, ndev = int(rank), int(argv[-3]), argv[-2], int(argv[-1])
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  from jax_smddp.tools.bench import core, options, output
  args = options.parse_args(argv[:-4])

  import jax
  gloo_address = use_gloo(coordinator)
  jax.distributed.initialize(coordinator, nprocs, pid)
  import jax_smddp as smddp

  try:
    devices = jax.devices()
    n = len(devices)
    if n != nprocs * ndev:
      raise RuntimeError(f"expected {nprocs} x {ndev} devices, jax has {n}")
    iters, warmup = options.iters_warmup(args)
    sizes = options.selected_sizes(args)

    def report(r):
      if pid == 0:
        print(output.table_row(r), flush=True)

    results = []
    for op in args.ops:
      if pid == 0:
        print(output.table_header(op, n, baseline=args.baseline), flush=True)
      results += core.run_benchmark([op], sizes, dtype=args.dtype, iters=iters,
                                    warmup=warmup, devices=devices, report=report,
                                    mpi4jax=args.mpi4jax, interfaces=args.interface_bytes,
                                    check=args.check > 0)
    topology = smddp.topology()
    if topology is not None:
      topology["gloo_address"] = gloo_address
    # Every process's rows: the driver reports process 0's, or with --slowest each call's
    # slowest process.
    _result(ok=True, process=pid, topology=topology, results=results)
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    _result(ok=False, process=pid, error=f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # peers waiting in a collective: do not wait for jax.distributed's shutdown
  smddp.shutdown()
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
