// Every custom call counted in the world's calls (World::CountCall; on CPU a
// one-process job's too, in CountingWorld's world of the process alone): what
// jax_smddp.distributed.traffic_by_op() reads to say which library ran each
// collective.
#ifndef JAX_SMDDP_FFI_CALL_COUNTS_H_
#define JAX_SMDDP_FFI_CALL_COUNTS_H_

#include <cstdint>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

// One device's call of `kind` delivering `out_bytes` into its output, in the
// world its call site was instantiated with (null: nothing to count). The call site holds it so
// that no call looks the world up: a world made anew later (shutdown, initialize) counts the
// programs instantiated after it.
inline void CountCustomCall(const World* world, Collective kind, uint64_t out_bytes) {
  if (world) world->CountCall(World::CustomCall(kind), out_bytes);
}

}  // namespace smddp

#endif  // JAX_SMDDP_FFI_CALL_COUNTS_H_
