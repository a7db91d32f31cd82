// The GPU kernel tests' driver (tests/gpu/test_kernels.py, through
// _smddp_cuda.stream_run and stream_direct_buffers), compiled into the CUDA
// module only with -DJAX_SMDDP_TESTING=ON (scripts/gpu_check.sh builds so): the
// installed module exposes no test probe.
//
// StreamRun runs `calls` calls of one collective as `rank` of the prepared and
// connected communicator of `members`, on a stream of its own, with
// CudaStreamOps, and leaves the output in `*output`. It checks the kernels,
// copy modes and flag operations on a GPU without JAX or XLA. Each rank must
// be in a process of its own (tests/gpu/test_kernels.py): ranks on streams of
// one CUDA context wait on each other through flags the CUDA scheduler does
// not see, and it may serialise a waiting stream ahead of the one that would
// release it (seen on an H100: each of 4 runs of the kernel tests as threads
// hung at a 4-rank case, in memops and flag-kernel modes alike).
// With `phases`, the last call runs through PhaseTimedOps on CUDA events, its
// times in `*totals`. With `graph_replays` (instead of `calls`), one
// replayable call (as the NCCL API front end enqueues a call captured into a
// CUDA graph) is captured into a graph, which is launched that many times,
// `input` holding one input per launch and `*output` every launch's output,
// one after the other. With `peers` (a CUDA IPC handle pair per rank, from
// StreamDirectBuffers), every rank's buffers are read in place.
// Errors: InvalidArgument for arguments that do not fit together, an error
// naming the failing call otherwise.
#ifndef JAX_SMDDP_CUDA_STREAM_DRIVER_H_
#define JAX_SMDDP_CUDA_STREAM_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_stream_ops.h"
#include "xla_ffi/algorithms/phase_timer.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/status.h"

namespace smddp {
namespace cuda {

// The kernel tests' buffers for direct reads (StreamRun's `peers`): this
// process's send and receive buffers, shared by legacy CUDA IPC, replaced
// when the next case asks for others (after every rank finished the last);
// their IPC handles in `*send_handle` and `*recv_handle`.
Status StreamDirectBuffers(int ordinal, size_t in_bytes, size_t out_bytes, std::string* send_handle,
                           std::string* recv_handle);

// `op_name` names the call in the call log's checks (CheckCall).
Status StreamRun(const std::vector<int64_t>& members, int rank, const Plan& plan,
                 const char* op_name, const char* input, size_t input_bytes, size_t out_bytes,
                 int calls, const GpuSettings& settings, bool phases, int graph_replays,
                 const std::vector<std::pair<std::string, std::string>>& peers, std::string* output,
                 PhaseTotals* totals);

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_STREAM_DRIVER_H_
