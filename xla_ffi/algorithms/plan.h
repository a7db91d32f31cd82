// One collective call's algorithm and its parameters: what every family of
// bodies is driven by (host_algorithms.h over an Exchange in one process,
// process_algorithms.h over links across processes, stream_algorithms.h over
// StreamOps on GPUs). Layouts are described as [outer, ranks, inner] blocks
// so gathers and scatters along any dimension need no transposes.
#ifndef JAX_SMDDP_ALGORITHMS_PLAN_H_
#define JAX_SMDDP_ALGORITHMS_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/collective.h"
#include "xla_ffi/common/dtype.h"

namespace smddp {

// One collective call's algorithm and its parameters (equal on every rank):
// what the engine's rendezvous needs to run any rank's body, on any thread.
struct Plan {
  Collective kind = Collective::kAllGather;  // xla_ffi/common/collective.h
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  size_t outer = 1;
  size_t inner = 0;  // bytes for gathers, all_to_all and permutes, elements for reductions
  size_t count = 0;  // elements, for all_reduce
  // collective_permute: for each rank r of the group, the rank whose input r
  // receives (-1: none, r's output is zeros); `inner` bytes each. Memory that
  // outlives the call (the call site's).
  const int64_t* sources = nullptr;
  // Across processes (chosen per call by jax_smddp.tuning at lowering):
  enum class Routing : uint8_t { kAuto, kFlat, kHierarchical };
  Routing routing = Routing::kAuto;  // kAuto: hierarchical where the hosts allow
  size_t chunk_bytes = 0;            // message chunk; 0: JAX_SMDDP_CHUNK_BYTES
};

// One rank's input and output bytes of a call of `p` in a group of `ranks`:
// its plan's block (or buffer) and the collective's size relations.
inline void CallBytes(const Plan& p, int ranks, size_t* in, size_t* out) {
  const CollectiveSpec& s = SpecOf(p.kind);
  const size_t E = ElementSize(p.dtype), n = size_t(ranks);
  if (s.plan_size == PlanSize::kElements) {
    *in = p.count * E;
  } else {
    const size_t block = p.outer * p.inner * (s.plan_size == PlanSize::kElementBlocks ? E : 1);
    *in = ScaleByRanks(block, -s.block_power, n);
  }
  *out = ScaleByRanks(*in, s.out_power, n);
}

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PLAN_H_
