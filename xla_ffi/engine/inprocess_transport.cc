#include "xla_ffi/engine/inprocess_transport.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace smddp {

struct InProcessTransport::Slot {
  struct Entry {
    bool present = false;
    const void* send = nullptr;
    void* recv = nullptr;
    CallInfo info;
  };
  explicit Slot(int n) : entries(n) {}

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Entry> entries;
  int arrived = 0;
  int departed = 0;
  bool aborted = false;        // a rank gave up before every rank arrived
  int helpers_wanted = 0;      // sleeping ranks asked to run bodies
  std::atomic<int> next_body{0};
  int bodies_done = 0;
  bool done = false;           // every body ran (or the call was refused)
  Status status;               // the call's outcome, the same for every rank
};

namespace {

std::string Where(const GroupInfo& group, const CallKey& key, const CallInfo& info, int rank) {
  return std::string("jax_smddp ") + info.op + " (op " + std::to_string(key.op_id) + ", rank " +
         std::to_string(rank) + " of communicator " + group.description + ")";
}

std::string Seconds(Clock::duration d) {
  std::ostringstream os;
  os.precision(3);
  os << std::chrono::duration<double>(d).count() << " s";
  return os.str();
}

std::string MissingRanks(const InProcessTransport::Slot& slot) {
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
  if (std::strcmp(i.op, "all_gather") != 0 && std::strcmp(i.op, "all_to_all") != 0)
    os << ", " << ReduceOpName(i.reduce);
  os << ")";
  return os.str();
}

// One rank's view of a call whose ranks all live in this process.
class RankView : public Exchange {
 public:
  RankView(InProcessTransport::Slot& slot, int rank) : slot_(slot), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return int(slot_.entries.size()); }
  const void* PeerSend(int peer) override { return slot_.entries[peer].send; }
  void* Recv() override { return slot_.entries[rank_].recv; }

  Status Get(int peer, size_t offset, void* dst, size_t bytes) override {
    const auto& e = slot_.entries[peer];
    if (offset + bytes > e.info.send_bytes)
      return Status::Error(std::string("jax_smddp: read past the end of rank ") +
                           std::to_string(peer) + "'s send buffer");
    if (bytes) std::memcpy(dst, static_cast<const char*>(e.send) + offset, bytes);
    return Status::Ok();
  }

  Status Put(int peer, size_t offset, const void* src, size_t bytes) override {
    const auto& e = slot_.entries[peer];
    if (offset + bytes > e.info.recv_bytes)
      return Status::Error(std::string("jax_smddp: write past the end of rank ") +
                           std::to_string(peer) + "'s receive buffer");
    if (bytes) std::memcpy(static_cast<char*>(e.recv) + offset, src, bytes);
    return Status::Ok();
  }

 private:
  InProcessTransport::Slot& slot_;
  int rank_;
};

// Claims and runs bodies until none is left; the last to finish marks the
// call done. Called without the slot's lock.
void RunBodies(InProcessTransport::Slot& slot, const Body& body) {
  const int n = int(slot.entries.size());
  for (int r; (r = slot.next_body.fetch_add(1)) < n;) {
    RankView view(slot, r);
    Status st = body(view);
    std::lock_guard<std::mutex> lock(slot.mu);
    if (!st.ok() && slot.status.ok()) slot.status = st;
    if (++slot.bodies_done == n) {
      slot.done = true;
      slot.cv.notify_all();
    }
  }
}

// Calls that move fewer bytes than this (over all ranks) run on the last
// arrival alone (JAX_SMDDP_CPU_HELPER_MIN_BYTES, default 256 KiB).
uint64_t HelperMinBytes() {
  static const uint64_t min_bytes = [] {
    const char* env = std::getenv("JAX_SMDDP_CPU_HELPER_MIN_BYTES");
    return env ? uint64_t(std::strtoull(env, nullptr, 10)) : uint64_t(256) << 10;
  }();
  return min_bytes;
}

}  // namespace

InProcessTransport::InProcessTransport(int helpers) : helpers_(std::max(0, helpers)) {}

std::shared_ptr<InProcessTransport::Slot> InProcessTransport::GetOrCreate(const CallKey& key, int size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = slots_[key];
  if (!slot) slot = std::make_shared<Slot>(size);
  return slot;
}

void InProcessTransport::Release(const CallKey& key, const Slot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second.get() == slot) slots_.erase(it);
}

Status InProcessTransport::Run(const GroupInfo& group, int size, const CallKey& key, int rank,
                               const void* send, void* recv, const CallInfo& info,
                               Clock::time_point deadline, const Body& body) {
  const Clock::time_point start = Clock::now();
  std::shared_ptr<Slot> slot = GetOrCreate(key, size);
  std::unique_lock<std::mutex> lock(slot->mu);
  auto leave = [&](Status st) {
    const bool last = ++slot->departed == size;
    lock.unlock();
    if (last) Release(key, slot.get());
    return st;
  };
  if (int(slot->entries.size()) != size || rank < 0 || rank >= size)
    return Status::Error(Where(group, key, info, rank) + ": rank or communicator size disagrees with its peers");
  if (slot->aborted) {
    return leave(Status::Error(Where(group, key, info, rank) +
                               ": a peer already gave up on this collective (missing rank(s): " +
                               MissingRanks(*slot) + "); this rank did not touch any peer buffer"));
  }
  Slot::Entry& me = slot->entries[rank];
  if (me.present)
    return leave(Status::Error(Where(group, key, info, rank) + ": this rank entered the same collective twice"));
  me = Slot::Entry{true, send, recv, info};

  if (++slot->arrived == size) {
    // Last to arrive: check that every rank runs the same call, then run
    // bodies with as many helpers as there are spare cores.
    for (int r = 0; r < size && slot->status.ok(); ++r) {
      if (!(slot->entries[r].info == slot->entries[0].info)) {
        slot->status = Status::Error(Where(group, key, info, rank) + ": ranks disagree on the call: rank 0 runs " +
                                     Describe(slot->entries[0].info) + " but rank " + std::to_string(r) +
                                     " runs " + Describe(slot->entries[r].info));
      }
    }
    if (!slot->status.ok()) {
      slot->done = true;
      slot->cv.notify_all();
      return leave(slot->status);
    }
    // Waking a sleeping rank costs more than a small call's copies.
    const uint64_t moved = std::max(info.send_bytes, info.recv_bytes) * uint64_t(size);
    slot->helpers_wanted = moved >= HelperMinBytes() ? std::min(helpers_, size - 1) : 0;
    if (slot->helpers_wanted == size - 1) {
      slot->cv.notify_all();
    } else {
      for (int i = 0; i < slot->helpers_wanted; ++i) slot->cv.notify_one();
    }
    lock.unlock();
    RunBodies(*slot, body);
    lock.lock();
  } else {
    // Wait for the others; this is the only wait with a deadline, because
    // once every rank has arrived bodies may be touching this rank's buffers
    // and it must not leave before they are done (they are bounded copies).
    const bool arrived = slot->cv.wait_until(lock, deadline, [&] {
      return slot->aborted || slot->done || slot->helpers_wanted > 0;
    });
    if (slot->aborted || (!arrived && slot->arrived < size)) {
      slot->aborted = true;
      slot->cv.notify_all();
      return leave(Status::Error(
          Where(group, key, info, rank) + ": timed out after " + Seconds(Clock::now() - start) +
          " waiting for rank(s) " + MissingRanks(*slot) +
          " to reach this collective. A rank that never arrives usually means the devices run "
          "different programs or one failed earlier; if it is only slow, raise JAX_SMDDP_TIMEOUT_S "
          "(or jax_smddp.set_timeout)."));
    }
    if (!slot->done && slot->helpers_wanted > 0) {
      --slot->helpers_wanted;
      lock.unlock();
      RunBodies(*slot, body);
      lock.lock();
    }
  }
  slot->cv.wait(lock, [&] { return slot->done; });
  return leave(slot->status);
}

}  // namespace smddp
