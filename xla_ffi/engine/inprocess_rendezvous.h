// The rendezvous of XLA devices of one process: ranks share the address space,
// so a call's buffers are exchanged as pointers through a rendezvous slot and
// data moves with memcpy (or is read in place by the algorithm).
//
// No rank waits: each rank's handler registers its buffers and returns. The
// last rank to arrive runs the bodies of every rank, with engine workers
// helping as this process's share of the host's cores allows (CpuHelpers;
// none for small calls), and the last body to finish completes every rank. A
// timer fails the call on every arrived rank if a peer has not arrived by the
// deadline.
#ifndef JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_
#define JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "xla_ffi/engine/rendezvous.h"
#include "xla_ffi/engine/scheduler.h"

namespace smddp {

// The default of JAX_SMDDP_CPU_HELPERS (the one place it is worked out): the
// cores this process may use shared among the job's `local_processes` on its
// host (each runs its own XLA device threads and helpers on them), less the
// one the last arrival's XLA thread runs bodies on; at least 0. The ranks
// that arrived earlier have returned (no rank waits), so their XLA threads
// take no core meanwhile. Measured: docs/cpu_steadiness.md, "Helper threads".
int DefaultCpuHelpers(int cores, int local_processes);

// The job's processes on this process's host, itself included (World::local_processes);
// 1 with no world (before jax_smddp.initialize(), or in a one-process job).
int LocalProcesses();

// Engine workers that run collective bodies beside the last arrival:
// JAX_SMDDP_CPU_HELPERS, else DefaultCpuHelpers(CoresAvailable(), LocalProcesses()).
int CpuHelpers();

class InProcessRendezvous : public Rendezvous {
 public:
  struct Slot;

  // The helpers of each large call are CpuHelpers()'s: the setting and the cores are read
  // here, once; the processes sharing the host at each large call (the world may start after
  // the rendezvous is built).
  InProcessRendezvous();

  void Start(const GroupInfo& group, int size, const CallKey& key, int rank, const void* send,
             void* recv, const CallInfo& info, Clock::time_point deadline, const Plan& plan,
             Done done) override;

 private:
  std::shared_ptr<Slot> GetOrCreate(const CallKey& key, int size, bool* created);
  void Forget(const CallKey& key, const Slot* slot);
  Task RunBodies(const std::shared_ptr<Slot>& slot, int mine);
  void Expire(const std::shared_ptr<Slot>& slot, Clock::time_point start);

  const int64_t helpers_setting_;  // JAX_SMDDP_CPU_HELPERS, -1 when unset
  const int cores_;                // CoresAvailable()
  std::mutex mu_;
  std::unordered_map<CallKey, std::shared_ptr<Slot>, CallKeyHash> slots_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_INPROCESS_RENDEZVOUS_H_
