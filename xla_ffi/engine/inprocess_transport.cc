#include "xla_ffi/engine/inprocess_transport.h"

#include <sys/mman.h>
#include <unistd.h>

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
  int finished = 0;
  int departed = 0;
  bool aborted = false;
};

namespace {

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
  os << i.op << " of " << DTypeName(i.dtype) << " (" << i.send_bytes
     << " bytes in, " << i.recv_bytes << " bytes out";
  if (std::strcmp(i.op, "all_gather") != 0 && std::strcmp(i.op, "all_to_all") != 0)
    os << ", " << ReduceOpName(i.reduce);
  os << ")";
  return os.str();
}

class InProcessExchange : public Exchange {
 public:
  InProcessExchange(InProcessTransport* transport, std::shared_ptr<InProcessTransport::Slot> slot,
                    CallKey key, int rank, Clock::time_point deadline,
                    std::string where)
      : transport_(transport), slot_(std::move(slot)), key_(key), rank_(rank),
        deadline_(deadline), where_(std::move(where)) {}

  ~InProcessExchange() override {
    if (!finished_) Finish();
  }

  int rank() const override { return rank_; }
  int size() const override { return int(slot_->entries.size()); }

  const void* PeerSend(int peer) override { return slot_->entries[peer].send; }

  Status Get(int peer, size_t offset, void* dst, size_t bytes) override {
    const auto& e = slot_->entries[peer];
    if (offset + bytes > e.info.send_bytes)
      return Status::Error(where_ + ": read past the end of rank " + std::to_string(peer) + "'s send buffer");
    if (bytes) std::memcpy(dst, static_cast<const char*>(e.send) + offset, bytes);
    return Status::Ok();
  }

  Status Put(int peer, size_t offset, const void* src, size_t bytes) override {
    const auto& e = slot_->entries[peer];
    if (offset + bytes > e.info.recv_bytes)
      return Status::Error(where_ + ": write past the end of rank " + std::to_string(peer) + "'s receive buffer");
    if (bytes) std::memcpy(static_cast<char*>(e.recv) + offset, src, bytes);
    return Status::Ok();
  }

  Status Finish() override {
    finished_ = true;
    Status status;
    bool last;
    {
      std::unique_lock<std::mutex> lock(slot_->mu);
      if (++slot_->finished == size()) {
        slot_->cv.notify_all();
      } else {
        const int n = size();
        // Peers are past the rendezvous and only copying; they cannot stall
        // for long, but the wait still has a deadline.
        if (!slot_->cv.wait_until(lock, deadline_, [&] { return slot_->finished == n; })) {
          slot_->aborted = true;
          slot_->cv.notify_all();
          status = Status::Error(where_ + ": timed out waiting for peers to finish copying");
        }
      }
      last = ++slot_->departed == size();
    }
    if (last) transport_->Release(key_, slot_.get());
    return status;
  }

 private:
  InProcessTransport* transport_;
  std::shared_ptr<InProcessTransport::Slot> slot_;
  CallKey key_;
  int rank_;
  Clock::time_point deadline_;
  std::string where_;
  bool finished_ = false;
};

}  // namespace

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

// Populates the page tables of a large buffer this rank is about to fill, in
// one system call, rather than taking one page fault per 4 KiB page: XLA often
// hands collectives freshly mapped output buffers.
void Prefault(void* buf, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  constexpr size_t kMinBytes = 1 << 20;
  if (bytes < kMinBytes) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  uintptr_t begin = (uintptr_t(buf) + page - 1) & ~(page - 1);
  uintptr_t end = (uintptr_t(buf) + bytes) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)buf; (void)bytes;
#endif
}

Status InProcessTransport::Open(const GroupInfo& group, int size, const CallKey& key,
                                int rank, const void* send, void* recv,
                                const CallInfo& info, Clock::time_point deadline,
                                std::unique_ptr<Exchange>* exchange) {
  const Clock::time_point start = Clock::now();
  std::string where = std::string("jax_smddp ") + info.op + " (op " +
                      std::to_string(key.op_id) + ", rank " + std::to_string(rank) +
                      " of communicator " + group.description + ")";
  Prefault(recv, info.recv_bytes);  // while peers are still arriving
  std::shared_ptr<Slot> slot = GetOrCreate(key, size);
  std::unique_lock<std::mutex> lock(slot->mu);
  if (int(slot->entries.size()) != size || rank < 0 || rank >= size)
    return Status::Error(where + ": rank or communicator size disagrees with its peers");
  auto leave = [&](Status st) {
    bool last = ++slot->departed == size;
    lock.unlock();
    if (last) Release(key, slot.get());
    return st;
  };
  if (slot->aborted) {
    return leave(Status::Error(where + ": a peer already gave up on this collective (missing rank(s): " +
                               MissingRanks(*slot) + "); this rank did not touch any peer buffer"));
  }
  Slot::Entry& me = slot->entries[rank];
  if (me.present)
    return leave(Status::Error(where + ": this rank entered the same collective twice"));
  me = Slot::Entry{true, send, recv, info};
  if (++slot->arrived == size) {
    slot->cv.notify_all();
  } else if (!slot->cv.wait_until(lock, deadline, [&] { return slot->arrived == size || slot->aborted; })) {
    slot->aborted = true;
    slot->cv.notify_all();
    return leave(Status::Error(
        where + ": timed out after " + Seconds(Clock::now() - start) +
        " waiting for rank(s) " + MissingRanks(*slot) +
        " to reach this collective. A rank that never arrives usually means the devices run "
        "different programs or one failed earlier; if it is only slow, raise JAX_SMDDP_TIMEOUT_S "
        "(or jax_smddp.set_timeout)."));
  }
  if (slot->aborted) {
    return leave(Status::Error(where + ": abandoned: rank(s) " + MissingRanks(*slot) +
                               " never arrived before the deadline"));
  }
  for (int r = 0; r < size; ++r) {
    if (!(slot->entries[r].info == slot->entries[0].info)) {
      return leave(Status::Error(where + ": ranks disagree on the call: rank 0 runs " +
                                 Describe(slot->entries[0].info) + " but rank " + std::to_string(r) +
                                 " runs " + Describe(slot->entries[r].info)));
    }
  }
  lock.unlock();
  *exchange = std::make_unique<InProcessExchange>(this, std::move(slot), key, rank, deadline, where);
  return Status::Ok();
}

}  // namespace smddp
