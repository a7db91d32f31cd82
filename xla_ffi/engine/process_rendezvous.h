// The rendezvous of a communicator whose ranks live in several processes. The
// ranks of this process meet in memory (as in-process ranks do); once all of
// them have arrived, the last arrival's XLA thread starts the cross-process
// algorithm for all of them (process_algorithms.h) over the links of the
// current world, without waiting, and one thread runs the rest and completes
// every local rank: an engine worker, or for a small call whose peers are all
// in it already (their agreement headers arrived within
// JAX_SMDDP_INLINE_WAIT_US; within one host with a core per process,
// JAX_SMDDP_INLINE_ONE_HOST_BYTES and _WAIT_US) that XLA thread. No XLA
// thread waits for a peer that is not in the call.
#ifndef JAX_SMDDP_ENGINE_PROCESS_RENDEZVOUS_H_
#define JAX_SMDDP_ENGINE_PROCESS_RENDEZVOUS_H_

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "xla_ffi/algorithms/process_call.h"
#include "xla_ffi/engine/rendezvous.h"

namespace smddp {

class ProcessRendezvous : public Rendezvous {
 public:
  struct Slot;

  // `process_of_rank`: the process of each rank of the communicator;
  // `members`: their device ids (for messages); `process`: this process;
  // `host_of_process`: each process's host (routes between hosts).
  ProcessRendezvous(std::vector<int64_t> members, std::vector<int> process_of_rank, int process,
                    const std::vector<std::string>& host_of_process);

  void Start(const GroupInfo& group, int size, const CallKey& key, int rank, const void* send,
             void* recv, const CallInfo& info, Clock::time_point deadline, const Plan& plan,
             Done done) override;

 private:
  // The cross-process part: Begin sets up the call, posts its agreement
  // check and starts the body (never waits); Finish runs the rest and
  // completes the local ranks, keeping local rank `mine`'s completion for
  // the calling thread (kKeepLast on a worker).
  void Begin(Slot& slot);
  void Finish(const std::shared_ptr<Slot>& slot, int mine);
  void Expire(const std::shared_ptr<Slot>& slot);
  void Forget(const CallKey& key, const Slot* slot);

  std::vector<int64_t> members_;
  std::vector<int> process_of_rank_;
  int process_;
  std::vector<int> local_;                    // this process's ranks
  std::vector<int> local_index_;              // rank -> index in local_, or -1
  std::vector<int> peers_;                    // other processes, ascending
  std::vector<std::vector<int>> peer_ranks_;  // per peer, its ranks
  uint64_t group_hash_ = 0;                   // equal on every process
  Routes routes_;  // hierarchical where the hosts allow (and the env does)
  Routes flat_routes_;
  bool one_host_ = false;  // every process of the group on this one's host
  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<Slot>, CallKeyHash> slots_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_PROCESS_RENDEZVOUS_H_
