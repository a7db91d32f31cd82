// The host algorithms, written against the Exchange interface: each is the
// body of one rank (see exchange.h) over buffers in one address space.
// Across processes and on GPUs the same collectives have their own bodies
// (process_algorithms.h, stream_algorithms.h), all driven by the Plan
// (plan.h).
#ifndef JAX_SMDDP_ALGORITHMS_HOST_ALGORITHMS_H_
#define JAX_SMDDP_ALGORITHMS_HOST_ALGORITHMS_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/algorithms/exchange.h"
#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/dtype.h"

namespace smddp {

// Runs `plan` as the rank of `ex`.
Status RunHostPlan(const Plan& plan, Exchange& ex);

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

// recv = send_s where s = sources[rank] (zeros where it is -1); `bytes` each.
Status CollectivePermute(Exchange& ex, const int64_t* sources, size_t bytes);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_HOST_ALGORITHMS_H_
