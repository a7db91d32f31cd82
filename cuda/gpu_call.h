// One collective call of a GPU rank, enqueued on its stream: the path every
// GPU caller shares (jax_smddp's custom calls, xla_ffi/ffi/gpu_handlers.cc,
// and the NCCL-API front end, cuda/ncclapi). The caller has found the rank
// and knows its stream's operations; this checks the call against the
// group's peers, exchanges buffers for direct reads, and enqueues the body
// (the intra-host protocol, or the hierarchical one when `port` is set).
#ifndef JAX_SMDDP_CUDA_GPU_CALL_H_
#define JAX_SMDDP_CUDA_GPU_CALL_H_

#include <vector>

#include "cuda/gpu_communicator.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/stream_ops.h"
#include "xla_ffi/common/status.h"

namespace smddp {
namespace gpu {

// The rank a call runs as: in a group inside one host, `port` and `rank_of`
// are null; in a group across hosts, `rank` is this host's rank of it.
struct CallRank {
  LocalRank* rank = nullptr;
  NetPort* port = nullptr;
  const std::vector<int>* rank_of = nullptr;
};

// Enqueues `plan` (dtype set) for `me` on `ops` and returns; a failure's
// message starts with "<op> (op <op_id>): ". Nothing is enqueued when the
// group failed before (a dead peer, a disagreement). `captured`: the stream
// is being captured into a CUDA graph: the call is enqueued as a replayable
// one (stream_algorithms.h: staged, by tokens; no buffer exchange), which
// every rank's graph runs alike, and is not logged against the peers (a rank
// may capture it again alone: GroupFailure); groups across hosts refuse it
// (their network proxy is driven from the host, call by call).
Status EnqueueCollective(const char* op, int64_t op_id, const CallRank& me, StreamOps& ops,
                         const void* send, void* recv, const Plan& plan, bool captured = false);

}  // namespace gpu
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_GPU_CALL_H_
