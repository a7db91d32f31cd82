// The rendezvous of XLA devices of one process: ranks share the address space,
// so a call's buffers are exchanged as pointers through a rendezvous slot and
// data moves with memcpy (or is read in place by the algorithm).
//
// No rank waits: each rank's handler registers its buffers and returns. The
// last rank to arrive runs the bodies of every rank, with as many engine
// workers helping as there are spare cores (none for small calls), and the
// last body to finish completes every rank. A timer fails the call on every
// arrived rank if a peer has not arrived by the deadline.
#ifndef JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_
#define JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_

#include <memory>
#include <mutex>
#include <unordered_map>

#include "xla_ffi/engine/rendezvous.h"
#include "xla_ffi/engine/scheduler.h"

namespace smddp {

// Engine workers that run collective bodies beside the last arrival:
// JAX_SMDDP_CPU_HELPERS, else its computed default, the cores this process may
// use less one (the one place that default is worked out).
int CpuHelpers();

class InProcessRendezvous : public Rendezvous {
 public:
  struct Slot;

  // `helpers`: engine workers that run bodies beside the last arrival.
  explicit InProcessRendezvous(int helpers);

  void Start(const GroupInfo& group, int size, const CallKey& key, int rank, const void* send,
             void* recv, const CallInfo& info, Clock::time_point deadline, const Plan& plan,
             Done done) override;

 private:
  std::shared_ptr<Slot> GetOrCreate(const CallKey& key, int size, bool* created);
  void Forget(const CallKey& key, const Slot* slot);
  Task RunBodies(const std::shared_ptr<Slot>& slot, int mine);
  void Expire(const std::shared_ptr<Slot>& slot, Clock::time_point start);

  int helpers_;
  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<Slot>, CallKeyHash> slots_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_
