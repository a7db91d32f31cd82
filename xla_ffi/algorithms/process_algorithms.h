// Collective algorithms for groups that span processes (and hosts), written
// once over links (shared memory, libfabric): what one process does, on
// behalf of all of its ranks, once they have all arrived.
//
// Hierarchical, in the SMDDP manner: every process exchanges with every other
// process directly (an all-to-all between processes rather than a ring: fewer
// hops, and suited to networks such as EFA that spread traffic over many
// paths), while the exchange among the process's own ranks runs in memory;
// messages are chunked so copies and reductions of what has arrived overlap
// with what is still in flight. Reductions are balanced: each output shard
// is reduced exactly once, by the process that owns it, from one partial per
// process (the process's own ranks are reduced locally first, so only one
// copy of each shard crosses each link).
#ifndef JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_
#define JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/algorithms/process_call.h"

namespace smddp {

// Runs `plan` for every rank of this process. Checks first that every
// process runs the same call (op, dtype, sizes): a mismatch fails every
// process with an error naming both calls.
Status RunProcessPlan(const Plan& plan, ProcessCall& call);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PROCESS_ALGORITHMS_H_
