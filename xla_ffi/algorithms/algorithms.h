// The host algorithms, written against the Exchange interface: each is the
// body of one rank (see exchange.h) over buffers in one address space.
// Across processes and on GPUs the same collectives have their own bodies
// (process_algorithms.h, stream_algorithms.h), all driven by this Plan.
// Layouts are described as [outer, ranks, inner] blocks so gathers and
// scatters along any dimension need no transposes.
#ifndef JAX_SMDDP_ALGORITHMS_ALGORITHMS_H_
#define JAX_SMDDP_ALGORITHMS_ALGORITHMS_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/dtype.h"
#include "xla_ffi/algorithms/exchange.h"

namespace smddp {

// One collective call's algorithm and its parameters (equal on every rank):
// what a transport needs to run any rank's body, on any thread.
struct Plan {
  enum class Kind : uint8_t { kAllGather, kReduceScatter, kAllReduce, kAllToAll };
  Kind kind = Kind::kAllGather;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  size_t outer = 1;
  size_t inner = 0;  // bytes for gathers and all_to_all, elements for reductions
  size_t count = 0;  // elements, for all_reduce
  // Across processes (chosen per call by jax_smddp.tuning at lowering):
  enum class Routing : uint8_t { kAuto, kFlat, kHierarchical };
  Routing routing = Routing::kAuto;  // kAuto: hierarchical where the hosts allow
  size_t chunk_bytes = 0;            // message chunk; 0: JAX_SMDDP_CHUNK_BYTES
};

// Runs `plan` as the rank of `ex`.
Status RunPlan(const Plan& plan, Exchange& ex);

// recv[o, p, :] = send_p[o, :] for every rank p; blocks of `inner_bytes`.
Status AllGather(Exchange& ex, size_t outer, size_t inner_bytes);

// recv[o, :] = reduce_p send_p[o, rank, :]; blocks of `inner` elements.
Status ReduceScatter(Exchange& ex, DType dtype, ReduceOp op, size_t outer, size_t inner);

// recv = reduce_p send_p, balanced: rank r reduces the r-th of `size` equal
// shards and writes it to every rank, so each rank reads and writes 1/size of
// the total.
Status AllReduce(Exchange& ex, DType dtype, ReduceOp op, size_t count);

// recv[o, p, :] = send_p[o, rank, :]; blocks of `inner_bytes`.
Status AllToAll(Exchange& ex, size_t outer, size_t inner_bytes);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_ALGORITHMS_H_
