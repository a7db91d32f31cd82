#include "xla_ffi/engine/process_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

#include "xla_ffi/algorithms/call_phases.h"
#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/algorithms/process_algorithms.h"
#include "xla_ffi/algorithms/process_call.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/engine/rendezvous_slot.h"
#include "xla_ffi/engine/scheduler.h"
#include "xla_ffi/transports/world.h"

namespace smddp {

struct ProcessRendezvous::Slot : RendezvousSlot {  // entries: per local rank
  using RendezvousSlot::RendezvousSlot;
  Clock::time_point start, deadline;
  Clock::time_point ready;  // the last local device arrived
  Timer timer;
  // The cross-process part, once every local device has arrived (Begin).
  CallPhases phases;
  ProcessCall call;
  std::shared_ptr<const World> world;  // whose links the call uses
  std::optional<ProcessRun> run;
  Status begun;  // why the call could not start, if it could not
};

namespace {

// JAX_SMDDP_HIERARCHICAL=0 sends every byte directly between processes
// (flat), even across hosts; for comparisons and tests.
bool HierarchyAllowed() { return TextSetting("JAX_SMDDP_HIERARCHICAL") != "0"; }
// The largest chunk of a call staggered between hosts (0: no rounds).
size_t StaggerChunk() {
  static const size_t bytes = size_t(IntSetting("JAX_SMDDP_STAGGER_CHUNK_BYTES"));
  return bytes;
}
bool Staggered() { return StaggerChunk() != 0; }

// Calls whose outputs in this process are smaller than `bytes` run on the
// thread of the last local device to arrive once the peers are in the call
// too, polling for them `wait` at most; within one host larger calls and a
// longer wait (peers there only copy in memory once they are in the call),
// unless the host's processes outnumber its cores and the one-host threshold
// is not set: there large calls handed to a worker were steadier (4x1 on 2
// cores: docs/cpu_steadiness.md), so such a host takes the policy between hosts.
struct InlinePolicy {
  uint64_t bytes;
  Clock::duration wait;
};
constexpr uint64_t kOneHostInlineBytes = uint64_t(64) << 20;  // the registry's default
InlinePolicy Inline(bool one_host, bool oversubscribed) {
  static const InlinePolicy across{
      uint64_t(IntSetting("JAX_SMDDP_INLINE_BYTES")),
      std::chrono::microseconds(IntSetting("JAX_SMDDP_INLINE_WAIT_US"))};
  static const int64_t one_host_bytes = [] {
    int64_t bytes = -1;  // unset: 64 MiB, or the policy between hosts where oversubscribed
    IntSettingIfSet("JAX_SMDDP_INLINE_ONE_HOST_BYTES", &bytes);
    return bytes;
  }();
  if (!one_host || (oversubscribed && one_host_bytes < 0)) return across;
  static const InlinePolicy within{
      one_host_bytes >= 0 ? uint64_t(one_host_bytes) : kOneHostInlineBytes,
      std::chrono::microseconds(IntSetting("JAX_SMDDP_INLINE_ONE_HOST_WAIT_US"))};
  return within;
}

}  // namespace

ProcessRendezvous::ProcessRendezvous(std::vector<int64_t> members, std::vector<int> process_of_rank,
                                     int process, const std::vector<std::string>& host_of_process)
    : members_(std::move(members)),
      process_of_rank_(std::move(process_of_rank)),
      process_(process) {
  routes_ =
      ComputeRoutes(process_of_rank_, process_, host_of_process, HierarchyAllowed(), Staggered());
  flat_routes_ = ComputeRoutes(process_of_rank_, process_, host_of_process, false, Staggered());
  one_host_ = std::all_of(process_of_rank_.begin(), process_of_rank_.end(), [&](int p) {
    return host_of_process[size_t(p)] == host_of_process[size_t(process_)];
  });
  const int n = int(process_of_rank_.size());
  local_index_.assign(n, -1);
  for (int r = 0; r < n; ++r) {
    const int p = process_of_rank_[r];
    if (p == process_) {
      local_index_[r] = int(local_.size());
      local_.push_back(r);
      continue;
    }
    auto it = std::lower_bound(peers_.begin(), peers_.end(), p);
    if (it == peers_.end() || *it != p) {
      const size_t at = size_t(it - peers_.begin());
      peers_.insert(it, p);
      peer_ranks_.insert(peer_ranks_.begin() + at, std::vector<int>());
    }
  }
  for (int r = 0; r < n; ++r) {
    const int p = process_of_rank_[r];
    if (p == process_) continue;
    const size_t at = size_t(std::lower_bound(peers_.begin(), peers_.end(), p) - peers_.begin());
    peer_ranks_[at].push_back(r);
  }
  uint64_t h = 0x6a09e667f3bcc908ull;
  for (int r = 0; r < n; ++r)
    h = MixTag(MixTag(h, uint64_t(members_[r])), uint64_t(process_of_rank_[r]));
  group_hash_ = h;
}

void ProcessRendezvous::Forget(const CallKey& key, const Slot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second.get() == slot) slots_.erase(it);
}

void ProcessRendezvous::Expire(const std::shared_ptr<Slot>& slot) {
  Task inline_done;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (slot->started || slot->over) return;
    std::ostringstream missing;
    std::vector<int> missing_ranks;
    const char* op = "collective";
    bool first = true;
    for (size_t li = 0; li < slot->entries.size(); ++li) {
      if (slot->entries[li].present) {
        op = slot->entries[li].info.op;
        continue;
      }
      missing << (first ? "" : " ") << members_[local_[li]];
      missing_ranks.push_back(local_[li]);
      first = false;
    }
    slot->status = Status::Timeout(
        CallWhere(slot->group, slot->key, op) + ": timed out waiting for device(s) [" +
        missing.str() +
        "] of this process to reach this collective. A device that never arrives usually means the "
        "devices run different programs or one failed earlier; " +
        kIfOnlySlow);
    slot->status.SetPeers(std::move(missing_ranks), {process_});
    inline_done = CompleteArrived(*slot, kKeepLast);  // on the timer's worker
  }
  if (inline_done) inline_done();
}

void ProcessRendezvous::Start(const GroupInfo& group, int size, const CallKey& key, int rank,
                              const void* send, void* recv, const CallInfo& info,
                              Clock::time_point deadline, const Plan& plan, Done done) {
  // `kind`: the failure's code and peers (only its message is replaced).
  auto fail_now = [&](const Status& kind, const std::string& why) {
    done(kind.WithMessage(
        CallWhere(group, key, info.op) + ": device " +
        (rank >= 0 && rank < int(members_.size()) ? std::to_string(members_[rank]) : "?") + ": " +
        why));
  };
  if (size != int(process_of_rank_.size()) || rank < 0 || rank >= size || local_index_[rank] < 0)
    return fail_now(Status::Mismatch(""),
                    "rank or communicator size disagrees with this process's view of the group");
  std::shared_ptr<Slot> slot;
  bool created;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = slots_[key];
    created = !s;
    if (created) s = std::make_shared<Slot>(int(local_.size()), group, key);
    slot = s;
  }
  std::unique_lock<std::mutex> lock(slot->mu);
  if (created) {
    slot->start = Clock::now();
    slot->deadline = deadline;
    // Only other local devices can keep this one waiting here (with one
    // device per process the call starts at once: no timer to add per call).
    if (local_.size() > 1) {
      std::weak_ptr<Slot> weak = slot;
      slot->timer = PostAt(deadline, [this, weak] {
        if (auto s = weak.lock()) Expire(s);
      });
    }
  }
  if (slot->over) {
    // The first cause (a timeout, a dead peer, a mismatch) is this device's too.
    const Status cause = slot->status.ok() ? Status::Timeout("") : slot->status;
    lock.unlock();
    return fail_now(cause, "a device of this process already gave up on this collective");
  }
  auto& me = slot->entries[local_index_[rank]];
  if (me.present) {
    lock.unlock();
    return fail_now(Status::Error(""), "this device entered the same collective twice");
  }
  me = Slot::Entry{true, send, recv, info, std::move(done)};
  if (++slot->arrived < int(local_.size())) return;
  slot->started = true;
  slot->ready = Clock::now();
  Cancel(slot->timer);
  for (size_t li = 1; li < slot->entries.size() && slot->status.ok(); ++li) {
    if (!(slot->entries[li].info == slot->entries[0].info)) {
      slot->status = Status::Mismatch(
          CallWhere(group, key, info.op) +
          ": devices of this process disagree on the call (shapes or dtypes differ)");
      slot->status.SetPeers({local_[0], local_[li]}, {process_});
    }
  }
  const int mine = local_index_[rank];
  if (!slot->status.ok()) {
    Task t = CompleteArrived(*slot, mine);
    lock.unlock();
    Forget(key, slot.get());
    if (t) t();
    return;
  }
  slot->plan = plan;
  lock.unlock();
  // This thread starts the cross-process part (posts its messages, never
  // waits), so peers that came earlier get this process's data at once.
  Begin(*slot);
  const InlinePolicy inline_policy =
      Inline(one_host_, slot->world != nullptr && slot->world->oversubscribed());
  if (slot->begun.ok() &&
      (inline_policy.bytes == 0 || info.recv_bytes * local_.size() >= inline_policy.bytes ||
       !slot->run->PeersArrived(Clock::now() + inline_policy.wait))) {
    // The rest waits on peers: an engine worker runs it. A small call whose
    // peers are all in it does not hand off: the hand-off (a thread to wake,
    // on this process and on its peers) would cost as much as the call, and
    // once every peer has announced it what remains waits only on them, so
    // this XLA thread may run it without blocking on any other collective.
    Post([this, slot] { Finish(slot, kKeepLast); });
    return;
  }
  if (slot->begun.ok()) slot->phases.inline_calls = 1;
  Finish(slot, mine);
}

void ProcessRendezvous::Begin(Slot& slot) {
  CallPhases& phases = slot.phases;
  phases.local_s = std::chrono::duration<double>(slot.ready - slot.start).count();
  phases.queue_s = std::chrono::duration<double>(Clock::now() - slot.ready).count();
  std::shared_ptr<const World> world = CurrentWorld();
  const CallKey& key = slot.key;
  const CallInfo& info = slot.entries[0].info;
  Status& st = slot.begun;
  if (!world) {
    st = Status::InvalidArgument(
        CallWhere(slot.group, key, info.op) +
        ": this communicator spans processes but jax_smddp is not initialized here: "
        "call jax.distributed.initialize() and then jax_smddp.initialize() in every "
        "process before running collectives.");
  } else if (world->process() != process_) {
    st = Status::InvalidArgument(
        CallWhere(slot.group, key, info.op) +
        ": the world changed since this program was compiled (jax_smddp.shutdown() "
        "and initialize() with another process index); recompile it.");
  } else {
    slot.world = world;
    ProcessCall& call = slot.call;
    call.world = world.get();
    call.size = int(process_of_rank_.size());
    call.members = &members_;
    call.process_of_rank = &process_of_rank_;
    call.local = &local_;
    for (auto& e : slot.entries) {
      call.send.push_back(e.send);
      call.recv.push_back(e.recv);
    }
    call.peers = &peers_;
    call.peer_ranks = &peer_ranks_;
    call.routes = slot.plan.routing == Plan::Routing::kFlat ? &flat_routes_ : &routes_;
    call.chunk_bytes = slot.plan.chunk_bytes;
    if (call.routes->ring || !call.routes->stagger_to.empty()) {
      // Rounds overlap chunk by chunk: whole messages in turn leave the links
      // idle between rounds (measured: below flat's all at once); a ring's
      // relays wait for a chunk, not a message, at each hop.
      const size_t chunk = call.chunk_bytes ? call.chunk_bytes : ChunkBytes();
      call.chunk_bytes = std::max<size_t>(4096, std::min(chunk, StaggerChunk()) / 64 * 64);
    }
    // Not the run id: it differs between different programs, and processes
    // that run different programs must meet to report it.
    call.tag = MixTag(MixTag(MixTag(group_hash_, key.site), key.sequence), 0x736d646470ull);
    call.start = slot.start;
    call.deadline = slot.deadline;
    call.where = [s = &slot] { return CallWhere(s->group, s->key, s->entries[0].info.op); };
    call.info = info;
    call.phases = &phases;
    slot.run.emplace(slot.plan, call);
  }
}

void ProcessRendezvous::Finish(const std::shared_ptr<Slot>& slot, int mine) {
  Status st = slot->begun;
  if (st.ok()) {
    st = slot->run->Finish();
    slot->run.reset();
    if (st.ok()) TallyCallPhases(slot->plan.kind, slot->phases);
  }
  Task inline_done;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->status = st;
    inline_done = CompleteArrived(*slot, mine);
  }
  Forget(slot->key, slot.get());
  if (inline_done) inline_done();
}

}  // namespace smddp
