#include "cuda/gpu_call.h"

#include <string>

#include "xla_ffi/algorithms/stream_algorithms.h"

namespace smddp {
namespace gpu {

Status EnqueueCollective(const char* op, int64_t op_id, const CallRank& me, StreamOps& ops,
                         const void* send, void* recv, const Plan& plan, bool captured) {
  auto located = [&](const Status& st) {
    return st.WithMessage(std::string(op) + " (op " + std::to_string(op_id) + "): " + st.message());
  };
  if (captured) {
    if (me.port)
      return located(Status::Unsupported(
          "jax_smddp (GPU): a group across hosts cannot run inside a CUDA graph (its network "
          "steps are driven from the host call by call); run with "
          "XLA_FLAGS=--xla_gpu_enable_command_buffer=-COLLECTIVES"));
    // A replayable call's first steps reuse the slots at once: safe only where
    // every staged call drains (the group was prepared for capture).
    if (!me.rank->view.drain_each_call)
      return located(Status::Unsupported(
          "jax_smddp (GPU): this group's calls cannot be captured into a CUDA graph: set "
          "JAX_SMDDP_GPU_GRAPHS=1 alike in every process (or keep the graph from capturing them)"));
    if (const Status st = GroupFailure(*me.rank); !st.ok()) return located(st);
    // Staged: a graph keeps this call's addresses for its replays, so no peer buffers.
    const Status st = RunStreamPlan(plan, me.rank->view, ops, send, recv, /*replayable=*/true);
    return st.ok() ? st : located(st);
  }
  if (const Status st = CheckCall(*me.rank, op, plan); !st.ok()) return located(st);
  void* out = recv;  // where the body writes (staging memory, if recv cannot be shared)
  size_t copy_back = 0;
  if (!me.port) {
    const Status st = me.rank->device_exchange
                          ? PublishBuffers(*me.rank, plan, ops, &send, &out, &copy_back)
                          : ExchangeBuffers(*me.rank, plan, send, recv);
    if (!st.ok()) {
      // Peers may have seen this rank's buffers and enqueued reads of them.
      ReleaseEveryoneWaitingOn(me.rank->view, ops);
      return located(st);
    }
  }
  Status st;
  if (me.port) {
    if (!(SpecOf(plan.kind).substrates & kGpuAcrossHosts))
      return Status::Unsupported("jax_smddp (GPU): " + std::string(op) +
                                 " across hosts is not supported on GPUs (" +
                                 CollectivesServedBy(kGpuAcrossHosts) + " are)");
    st = RunStreamHierarchicalPlan(plan, me.rank->view, *me.port, *me.rank_of, ops, send, recv);
  } else {
    st = RunStreamPlan(plan, me.rank->view, ops, send, out);
    if (st.ok() && copy_back) st = ops.Copy(recv, out, copy_back);
  }
  if (!st.ok()) {
    // A failed network step (a process on another host gone) ends this host's group too: its
    // local peers' calls would go on, waiting on a rank that no longer joins them.
    if (me.port && me.rank->watch && !me.rank->watch->failed()) me.rank->watch->Fail(st);
    return located(st);
  }
  return Status::Ok();
}

}  // namespace gpu
}  // namespace smddp
