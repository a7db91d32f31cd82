// What both rendezvous (inprocess_rendezvous.cc, process_rendezvous.cc) keep
// for one call while its ranks arrive: each arrived rank's buffers, call
// description and completion, and the call's progress and outcome. Each
// rendezvous extends it with its own timer and bookkeeping.
#ifndef JAX_SMDDP_ENGINE_RENDEZVOUS_SLOT_H_
#define JAX_SMDDP_ENGINE_RENDEZVOUS_SLOT_H_

#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/engine/rendezvous.h"
#include "xla_ffi/engine/scheduler.h"

namespace smddp {

struct RendezvousSlot {
  // One rank's part of the call.
  struct Entry {
    bool present = false;
    const void* send = nullptr;
    void* recv = nullptr;
    CallInfo info;
    Done done;
  };
  RendezvousSlot(int n, const GroupInfo& g, const CallKey& k) : entries(n), group(g), key(k) {}

  std::mutex mu;
  std::vector<Entry> entries;  // per rank the rendezvous gathers
  GroupInfo group;
  CallKey key;
  Plan plan;
  int arrived = 0;
  bool started = false;  // every rank arrived: the call runs
  bool over = false;     // every arrived rank has been (or is being) completed
  Status status;         // the call's outcome, the same for every rank
};

// Marks the call over and completes every arrived entry with the call's
// status, each on an engine worker (XLA continues that device's program on
// the completing thread, so devices continue in parallel), except one whose
// completion is returned for the caller to run once it has released the lock:
// entry `keep`, or the last arrived one (kKeepLast: a caller that is an engine
// worker continues that device itself), or none (kKeepNone). A caller on a
// device's XLA thread keeps its own entry only: that future is not awaited
// yet, where another device's completion would continue its program on this
// thread's stack. Called with the slot's lock held.
constexpr int kKeepNone = -1, kKeepLast = -2;
inline Task CompleteArrived(RendezvousSlot& slot, int keep) {
  slot.over = true;
  Task kept;
  for (int i = 0; i < int(slot.entries.size()); ++i) {
    auto& e = slot.entries[i];
    if (!e.present || !e.done) continue;
    Task t = [done = std::move(e.done), status = slot.status] { done(status); };
    e.done = nullptr;
    if (i != keep && keep != kKeepLast) {
      Post(std::move(t));
      continue;
    }
    if (kept) Post(std::move(kept));  // kKeepLast: a later entry takes its place
    kept = std::move(t);
  }
  return kept;
}

// "jax_smddp all_gather (op 3 of communicator devices [0 1 2 3])": where a
// call's messages say they come from.
inline std::string CallWhere(const GroupInfo& group, const CallKey& key, const char* op) {
  return std::string("jax_smddp ") + op + " (op " + std::to_string(key.op_id) +
         " of communicator " + group.description + ")";
}

}  // namespace smddp

#endif  // JAX_SMDDP_ENGINE_RENDEZVOUS_SLOT_H_
