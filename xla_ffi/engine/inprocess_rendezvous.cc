#include "xla_ffi/engine/inprocess_rendezvous.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "xla_ffi/algorithms/host_algorithms.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/streaming_copy.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/engine/rendezvous_slot.h"
#include "xla_ffi/engine/scheduler.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

struct InProcessRendezvous::Slot : RendezvousSlot {
  using RendezvousSlot::RendezvousSlot;
  Timer deadline;  // fails the call if a rank is missing by then
  std::atomic<int> next_body{0};
  int bodies_done = 0;
  bool stream = false;  // outputs are written with non-temporal stores (streaming_copy.h)
};

namespace {

std::vector<int> MissingRankList(const InProcessRendezvous::Slot& slot) {
  std::vector<int> missing;
  for (size_t r = 0; r < slot.entries.size(); ++r)
    if (!slot.entries[r].present) missing.push_back(int(r));
  return missing;
}

std::string MissingRanks(const InProcessRendezvous::Slot& slot) {
  std::ostringstream os;
  bool first = true;
  for (size_t r = 0; r < slot.entries.size(); ++r) {
    if (slot.entries[r].present) continue;
    os << (first ? "" : ", ") << r;
    first = false;
  }
  return os.str();
}

std::string Describe(const CallInfo& i) {
  std::ostringstream os;
  os << i.op << " of " << DTypeName(i.dtype) << " (" << i.send_bytes << " bytes in, "
     << i.recv_bytes << " bytes out";
  Collective kind;
  if (CollectiveNamed(i.op, &kind) && Reduces(kind)) os << ", " << ReduceOpName(i.reduce);
  os << ")";
  return os.str();
}

// One rank's view of a call whose ranks all live in this process.
class RankView : public Exchange {
 public:
  RankView(InProcessRendezvous::Slot& slot, int rank) : slot_(slot), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return int(slot_.entries.size()); }
  const void* PeerSend(int peer) override { return slot_.entries[peer].send; }
  void* Recv() override { return slot_.entries[rank_].recv; }

  Status Get(int peer, size_t offset, void* dst, size_t bytes) override {
    const auto& e = slot_.entries[peer];
    if (offset + bytes > e.info.send_bytes)
      return Status::Error(std::string("jax_smddp: read past the end of rank ") +
                           std::to_string(peer) + "'s send buffer");
    // Only what lands in this rank's output streams: staging is read at once.
    char* out = static_cast<char*>(slot_.entries[rank_].recv);
    const bool into_output =
        static_cast<char*>(dst) >= out &&
        static_cast<char*>(dst) + bytes <= out + slot_.entries[rank_].info.recv_bytes;
    CopyBytes(dst, static_cast<const char*>(e.send) + offset, bytes, slot_.stream && into_output);
    return Status::Ok();
  }

  Status Put(int peer, size_t offset, const void* src, size_t bytes) override {
    const auto& e = slot_.entries[peer];
    if (offset + bytes > e.info.recv_bytes)
      return Status::Error(std::string("jax_smddp: write past the end of rank ") +
                           std::to_string(peer) + "'s receive buffer");
    CopyBytes(static_cast<char*>(e.recv) + offset, src, bytes, slot_.stream);
    return Status::Ok();
  }

 private:
  InProcessRendezvous::Slot& slot_;
  int rank_;
};

// Calls that move fewer bytes than this (over all ranks) run on the last
// arrival alone (JAX_SMDDP_CPU_HELPER_MIN_BYTES).
uint64_t HelperMinBytes() {
  static const uint64_t min_bytes = uint64_t(IntSetting("JAX_SMDDP_CPU_HELPER_MIN_BYTES"));
  return min_bytes;
}

}  // namespace

int DefaultCpuHelpers(int cores, int local_processes) {
  return std::max(0, std::max(cores, 1) / std::max(local_processes, 1) - 1);
}

int LocalProcesses() {
  std::shared_ptr<const World> world = CurrentWorld();
  return world ? world->local_processes() : 1;
}

namespace {

// JAX_SMDDP_CPU_HELPERS, or -1 when unset.
int64_t HelpersSetting() {
  int64_t helpers = -1;
  IntSettingIfSet("JAX_SMDDP_CPU_HELPERS", &helpers);
  return helpers;
}

int Helpers(int64_t setting, int cores) {
  return setting >= 0 ? int(setting) : DefaultCpuHelpers(cores, LocalProcesses());
}

}  // namespace

int CpuHelpers() { return Helpers(HelpersSetting(), CoresAvailable()); }

InProcessRendezvous::InProcessRendezvous()
    : helpers_setting_(HelpersSetting()), cores_(CoresAvailable()) {}

std::shared_ptr<InProcessRendezvous::Slot> InProcessRendezvous::GetOrCreate(const CallKey& key,
                                                                            int size,
                                                                            bool* created) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = slots_[key];
  *created = !slot;
  if (!slot) slot = std::make_shared<Slot>(size, GroupInfo{}, key);
  return slot;
}

void InProcessRendezvous::Forget(const CallKey& key, const Slot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second.get() == slot) slots_.erase(it);
}

// Claims and runs bodies until none is left; the last to finish completes
// every rank. Run by rank `mine` (the last arrival, on its own XLA thread:
// its completion is returned to run inline, so XLA continues that device
// without a thread switch) or by a helper (mine = kKeepNone).
Task InProcessRendezvous::RunBodies(const std::shared_ptr<Slot>& slot, int mine) {
  const int n = int(slot->entries.size());
  Task inline_done;
  for (int r; (r = slot->next_body.fetch_add(1)) < n;) {
    RankView view(*slot, r);
    Status st = RunHostPlan(slot->plan, view);
    std::lock_guard<std::mutex> lock(slot->mu);
    if (!st.ok() && slot->status.ok()) slot->status = st;
    if (++slot->bodies_done == n) {
      inline_done = CompleteArrived(*slot, mine);
      Forget(slot->key, slot.get());
    }
  }
  return inline_done;
}

// The deadline passed: if some rank never arrived, fail every arrived rank.
void InProcessRendezvous::Expire(const std::shared_ptr<Slot>& slot, Clock::time_point start) {
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->started || slot->over) return;
  const char* op = "collective";
  for (const auto& e : slot->entries)
    if (e.present) op = e.info.op;
  slot->status = Status::Timeout(
      CallWhere(slot->group, slot->key, op) + ": timed out after " + Seconds(Clock::now() - start) +
      " waiting for rank(s) " + MissingRanks(*slot) +
      " to reach this collective. A rank that never arrives usually means the devices run "
      "different programs or one failed earlier; " +
      kIfOnlySlow + " No rank touched a peer's buffers.");
  slot->status.SetPeers(MissingRankList(*slot), {});
  CompleteArrived(*slot, kKeepNone);
  // The slot stays in the table: a rank arriving late finds it over and fails at once.
}

void InProcessRendezvous::Start(const GroupInfo& group, int size, const CallKey& key, int rank,
                                const void* send, void* recv, const CallInfo& info,
                                Clock::time_point deadline, const Plan& plan, Done done) {
  bool created;
  std::shared_ptr<Slot> slot = GetOrCreate(key, size, &created);
  std::unique_lock<std::mutex> lock(slot->mu);
  if (created) {
    slot->group = group;
    std::weak_ptr<Slot> weak = slot;
    slot->deadline = PostAt(deadline, [this, weak, start = Clock::now()] {
      if (auto s = weak.lock()) Expire(s, start);
    });
  }
  // `kind`: the failure's code and peers (only its message is replaced).
  auto fail_now = [&](const Status& kind, const std::string& why) {
    lock.unlock();
    done(kind.WithMessage(CallWhere(group, key, info.op) + ": rank " + std::to_string(rank) + ": " +
                          why));
  };
  if (int(slot->entries.size()) != size || rank < 0 || rank >= size)
    return fail_now(Status::Mismatch(""), "rank or communicator size disagrees with its peers");
  if (slot->over) {
    // The first cause (the peers' timeout, a mismatch) is this rank's too.
    const Status cause = slot->status.ok() ? Status::Timeout("") : slot->status;
    return fail_now(cause, "a peer already gave up on this collective (missing rank(s): " +
                               MissingRanks(*slot) + "); this rank touched no peer buffer");
  }
  Slot::Entry& me = slot->entries[rank];
  if (me.present) return fail_now(Status::Error(""), "this rank entered the same collective twice");
  me = Slot::Entry{true, send, recv, info, std::move(done)};
  if (++slot->arrived < size) return;

  // Last to arrive: check that every rank runs the same call, then run the
  // bodies here, with helpers for large calls.
  slot->started = true;
  Cancel(slot->deadline);
  for (int r = 0; r < size && slot->status.ok(); ++r) {
    if (!(slot->entries[r].info == slot->entries[0].info)) {
      slot->status = Status::Mismatch(
          CallWhere(group, key, info.op) + ": ranks disagree on the call: rank 0 runs " +
          Describe(slot->entries[0].info) + " but rank " + std::to_string(r) + " runs " +
          Describe(slot->entries[r].info));
      slot->status.SetPeers({0, r}, {});
    }
  }
  if (!slot->status.ok()) {
    CompleteArrived(*slot, kKeepNone);
    lock.unlock();
    Forget(key, slot.get());
    return;
  }
  slot->plan = plan;
  slot->stream = StreamStores(info.recv_bytes * uint64_t(size));
  const uint64_t moved = std::max(info.send_bytes, info.recv_bytes) * uint64_t(size);
  const int helpers =
      moved >= HelperMinBytes() ? std::clamp(Helpers(helpers_setting_, cores_), 0, size - 1) : 0;
  lock.unlock();
  // A helper the kernel wakes on this thread's core (as this 2-core VM's did,
  // the other core idle) would share it with this thread's bodies: it moves
  // off once it runs (OffCpu), and this thread yields once so that it runs
  // now, not when this thread's time slice ends (1-5 ms later, in 1 of 5
  // calls of a 1x8 all_gather without the yield).
  if (helpers > 0) {
    const int cpu = sched_getcpu();
    for (int i = 0; i < helpers; ++i)
      Post([this, slot, cpu] {
        OffCpu away(cpu);
        RunBodies(slot, kKeepNone);
      });
    sched_yield();
  }
  if (Task mine = RunBodies(slot, rank)) mine();
}

}  // namespace smddp
