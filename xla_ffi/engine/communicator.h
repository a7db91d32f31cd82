// A communicator: an ordered group of ranks (the XLA devices of one replica
// group, named by their global device ids) and the rendezvous that joins them.
#ifndef JAX_SMDDP_ENGINE_COMMUNICATOR_H_
#define JAX_SMDDP_ENGINE_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/timeout.h"  // SetTimeoutSeconds, TimeoutSeconds: part of its interface
#include "xla_ffi/engine/rendezvous.h"

namespace smddp {

class Communicator {
 public:
  Communicator(uint64_t id, std::vector<int64_t> members, Rendezvous* rendezvous,
               std::unique_ptr<Rendezvous> owned = nullptr);

  int size() const { return int(members_.size()); }
  const std::vector<int64_t>& members() const { return members_; }
  const GroupInfo& info() const { return info_; }

  // Starts one collective call for `rank` (see Rendezvous::Start); `done`
  // reports its end. Peers that have not arrived by the engine's timeout
  // fail the call. `instance` identifies the instruction and `invocation`
  // how many times it already ran in execution `run_id` (both equal on every
  // rank); `site` names the instruction alike in every process and
  // `sequence` counts its earlier calls over all runs (together they name the
  // call across processes); `op_id` is its position in the program, for
  // messages.
  void Start(int64_t run_id, int64_t instance, uint64_t site, uint64_t sequence,
             uint64_t invocation, int64_t op_id, int rank, const void* send, void* recv,
             const CallInfo& call, const Plan& plan, Done done);

 private:
  std::vector<int64_t> members_;
  GroupInfo info_;
  std::unique_ptr<Rendezvous> owned_;
  Rendezvous* rendezvous_;
};

// The engine's communicators, created on first use and kept for the process.
// `processes` (null: all in this process) gives each member's process; a
// group that spans processes needs the world (jax_smddp.initialize()).
Communicator* FindOrCreateCommunicator(const int64_t* members, const int64_t* processes, int size,
                                       Status* error);

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_COMMUNICATOR_H_
