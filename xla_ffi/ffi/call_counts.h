// Every custom call of a multi-process job counted in the world's calls
// (World::CountCall), CPU and GPU handlers alike: what
// jax_smddp.distributed.traffic_by_op() reads to say which library ran each
// collective.
#ifndef JAX_SMDDP_FFI_CALL_COUNTS_H_
#define JAX_SMDDP_FFI_CALL_COUNTS_H_

#include <cstdint>
#include <memory>

#include "xla_ffi/algorithms/algorithms.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

// One device's call of `kind` delivering `out_bytes` into its output; nothing
// before jax_smddp connected the processes (one process: no world).
inline void CountCustomCall(Plan::Kind kind, uint64_t out_bytes) {
  std::shared_ptr<const World> world = CurrentWorld();
  if (!world) return;
  World::Caller caller = World::Caller::kAllGather;
  switch (kind) {
    case Plan::Kind::kAllGather: caller = World::Caller::kAllGather; break;
    case Plan::Kind::kReduceScatter: caller = World::Caller::kReduceScatter; break;
    case Plan::Kind::kAllReduce: caller = World::Caller::kAllReduce; break;
    case Plan::Kind::kAllToAll: caller = World::Caller::kAllToAll; break;
  }
  world->CountCall(caller, out_bytes);
}

}  // namespace smddp

#endif  // JAX_SMDDP_FFI_CALL_COUNTS_H_
