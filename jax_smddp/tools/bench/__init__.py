"""nccl-tests-style benchmark of jax_smddp's collectives against jax.lax.

Usage::

    python -m jax_smddp.tools.bench                       # all_gather, reduce_scatter, all_reduce
    python -m jax_smddp.tools.bench --ops all_to_all --min-bytes 1K --max-bytes 1M
    python -m jax_smddp.tools.bench --quick --devices 4   # smoke run (same as --layout 4 / 1x4)
    python -m jax_smddp.tools.bench --layout 2x2 --compare-in-process
                                                    # 2 processes x 2 devices on this host
    python -m jax_smddp.tools.bench --layout 2x2x1        # 2 simulated hosts x 2 processes x 1
                                                    # device (network namespaces; root)
    python -m jax_smddp.tools.bench --layout 2x2 --predict
                                                    # the cost model's prediction beside each
                                                    # measurement (jax_smddp.cost_model)
    python -m jax_smddp.tools.bench --layout 2x1x1 --baseline self
                                                    # jax_smddp against a second copy of
                                                    # itself: the ratios noise alone gives
    python -m jax_smddp.tools.bench --compare A.json B.json
                                                    # runs nothing: B/A time ratios per op and
                                                    # size, and a comparison PNG

Under a launcher (``mpirun -n 2 python -m jax_smddp.tools.bench ...``, ``srun``, or
``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``: :mod:`jax_smddp.job`)
the benchmark runs across the job's processes instead (:mod:`~jax_smddp.tools.bench.in_job`): no
layout (``--layout`` is refused), every process a worker, process 0 reporting; on CPU each
process has ``--devices`` devices (default 1), on GPUs (``JAX_PLATFORMS=cuda``) the one its
launcher gave it.

Rows follow nccl-tests (:mod:`~jax_smddp.tools.bench.nccl_tests`, shared with
:mod:`jax_smddp.tools.gpu_bench`): ``-b/-e/-f/-i`` sweep nccl-tests' rows per op (its sizes and
counts, row for row, for any rank count), and each op's
table has nccl-tests' columns (size, count, type, redop, root, out-of-place time, algbw, busbw,
#wrong; in-place N/A: not run), then the baseline's and the speedup. ``--csv`` writes every
column; ``--nccl-tests LOG`` matches a saved nccl-tests output by op and S and prints busbw and
time ratios.

Layouts (``--layout``):

* ``N`` or ``1xN``: one process, N CPU devices (the default, N = ``--devices``).
* ``PxD``: P processes on this host, D devices each, one ``jax.distributed``
  job; jax_smddp links the processes through shared memory.
* ``HxPxD``: H simulated hosts (network namespaces: two joined by a veth pair,
  more on one bridge, :mod:`jax_smddp.tools.netns`) x P processes x D devices; jax_smddp uses shared
  memory within a host and libfabric (``JAX_SMDDP_FABRIC_PROVIDER``, else the
  library's default: ``net`` where libfabric 1.17 offers it) between hosts. Needs root and iproute2.

Multi-process layouts are run by :mod:`jax_smddp.tools.launch`: every worker
(:mod:`jax_smddp.tools.bench_worker`) benchmarks the same programs over a 1-D mesh of
all global devices, so the jax.lax baseline runs on JAX's default CPU
collectives across processes (gloo over TCP); process 0 reports the times: by default the mean
of the processes' medians, as nccl-tests' ``-a 1`` (``-a 0`` process 0's, ``2`` the least,
``3`` the greatest), or with ``--slowest`` each call counts as long as its slowest process took
(:func:`slowest_process`; each process's own median is kept in ``process_medians_us``).
``--compare-in-process`` also runs the same total device count in one process
(a subprocess) and adds the column ``vs 1p`` = multi-process jax_smddp time /
in-process jax_smddp time.

For every op and size two jitted ``jax.shard_map`` programs over a 1-D mesh
``"x"`` of all (CPU) devices are built: one calling the jax_smddp collective,
one calling its ``jax.lax`` equivalent::

    all_gather      smddp.all_gather(x, "x", tiled=True)      lax.all_gather(..., tiled=True)
    reduce_scatter  smddp.psum_scatter(x, "x", tiled=True)    lax.psum_scatter(..., tiled=True)
    all_reduce      smddp.psum(x, "x")                        lax.psum(x, "x")
    all_to_all      smddp.all_to_all(x, "x", 0, 0, tiled=True) lax.all_to_all(..., 0, 0, tiled=True)

The jax_smddp result is checked against the jax.lax one before timing (in
every process, on its addressable shards). Each timed sample is one whole
jitted call followed by ``block_until_ready`` (every call is synchronised: XLA's
CPU runtime can hang with many multi-device executions in flight; across
processes the collective itself keeps the processes in step); the two
implementations alternate call by call so that noise hits both alike, and the
median is reported (in multi-process layouts, the processes' medians combined as ``-a`` says).

Definitions (as in nccl-tests; n = number of ranks, t = median time):

* size S (``-b``/``-e``/``-f``, the nccl-tests tables' "size"), with ``bytes_per_rank`` one
  rank's input (the detail tables' "size"):
    - all_gather:     n x bytes_per_rank (the gathered output),  busbw = algbw x (n-1)/n
    - reduce_scatter: bytes_per_rank     (input of one rank),    busbw = algbw x (n-1)/n
    - all_reduce:     bytes_per_rank     (the buffer),           busbw = algbw x 2(n-1)/n
    - all_to_all:     bytes_per_rank     (buffer of one rank),   busbw = algbw x (n-1)/n
* algbw = S / t, in GB/s (1e9 bytes/s).
* speedup = lax time / smddp time (> 1: jax_smddp is faster).
* ``--baseline self``: the second program is not jax.lax's but a second, separately
  jitted copy of jax_smddp's (columns "again"; ``baseline_engine`` says whether a row's
  baseline called jax_smddp). Its true speedup is 1.0, so how far its rows stray from
  1.0, and its medians from their minimums, is what the machine's noise alone gives: the
  yardstick for a difference read in a run against jax.lax on the same machine.
* 90% range (``speedup_interval``): the speedup's 90 % bootstrap interval from the row's
  own calls (each implementation's resampled); one that contains 1.0 says those calls
  cannot tell the two apart. A line under each table counts the sizes above, below and
  containing 1.0.
* p90 (``p90_us``): the 90th percentile of each implementation's calls, beside its median
  (taken over the processes as the median is); ``!`` marks one above 1.5x the median
  (``interval.spread``): the calls' times spread, and the median moves more between runs.

Each implementation's fastest call is kept too (``min_us``: the least disturbed
by other load on a shared machine), and every call (``samples_us``). ``other_load``
is the number of CPUs other work (other users, the hypervisor) kept busy while a
point was timed, measured from /proc (machine CPU time minus this job's);
``--timing blocks`` times 5 calls of one implementation back to back instead of
alternating call by call (docs/performance_model.md: which statistic the model
predicts, and why), ``--timing solo`` all of one implementation's calls, then all
of the next's (each in its steady state: docs/cpu_floor.md, "Calls that
follow another library's call"), and ``--timing barrier`` alternates with every
process meeting at a barrier before each call. Every row records the tuner's choice for the
call (``choice``: :func:`jax_smddp.tuning.choose`, what the engine runs across
processes) and, with ``--predict``, the cost model's prediction for it
(``prediction``, ``smddp.predicted_us``; docs/performance_model.md).

A memcpy reference, single-threaded numpy copy bandwidth (``np.copyto`` of a
64 MiB buffer), is measured in the same run: ``memcpy_us`` is the time the bytes
one process must write (its devices' outputs) take at that bandwidth, and
``vs_memcpy`` = memcpy_us / jax_smddp's time. It is a reference, not a limit:
above 1, jax_smddp wrote its outputs faster than ``np.copyto`` copies, which
streaming (non-temporal) stores and several threads can do. Between simulated
hosts the link itself is measured raw in the same run too
(:mod:`jax_smddp.tools.link_probe`: TCP sockets sending both ways at once):
``link_us`` is the time the bytes each host must receive from the others take
at its rate each way (:func:`interhost_bytes_per_host`), and ``vs_link`` =
link_us / time, for jax_smddp and for jax.lax (1: the call ran at the link's
rate). In multi-process layouts every row also records where jax_smddp's calls
spent their time (``smddp_phases``: :func:`jax_smddp.distributed.call_phases` per call,
process 0's, over the timed calls: the hand-off to the engine, the agreement check,
the body, and of those the waits and sleeps on links), and ``--phases`` prints it as
a table after each op's, with "outside" = the mean call seen from Python minus those
phases (XLA's dispatch and the hand-backs). Every timed call's start is kept too
(``starts_us``, ``time.perf_counter``: one clock for every process of the machine), and
multi-process layouts time each call from the last process's start to the last process's
end (``after_arrival``, :func:`after_arrival`; printed as a table after each op's): the
call without the wait for a late peer, with ``skew_us``, how far apart the processes
started, and ``cpu_us``, the CPU time all processes used per call (``time.process_time``
around each call, kept per call as ``cpu_us``). Results go to a JSON file with
the run's metadata and, when matplotlib is importable, to a busbw-vs-size plot.

The benchmark functions are importable (:func:`run_benchmark`). The package's modules:
``core`` (sizes, layouts, programs, the driver), ``checks`` (inputs and numpy's answers),
``timing`` (the timing loops), ``model`` (the layout, the memcpy and link references, the
model's annotation), ``nccl_tests`` (nccl-tests' size,
count, busbw, table, CSV and log reader), ``in_job`` (the run across a launched job),
``interval`` (the speedup's
bootstrap interval), ``meter`` (the /proc meter of other load), ``output`` (table, JSON,
plot), ``compare`` (``--compare``), ``options`` (the command line's options), ``report`` (what
a run prints and writes) and ``cli`` (the one- and multi-process runs). This module
imports jax lazily; ``import jax_smddp`` imports jax but does not start its
backends, so ``--devices`` can still set ``XLA_FLAGS`` in :func:`main`.
"""

from jax_smddp.tools.bench.core import *  # noqa: F401,F403
from jax_smddp.tools.bench.interval import *  # noqa: F401,F403
from jax_smddp.tools.bench.meter import *  # noqa: F401,F403
from jax_smddp.tools.bench.output import *  # noqa: F401,F403
from jax_smddp.tools.bench.compare import *  # noqa: F401,F403
from jax_smddp.tools.bench.options import *  # noqa: F401,F403
from jax_smddp.tools.bench.report import *  # noqa: F401,F403
from jax_smddp.tools.bench.cli import *  # noqa: F401,F403
