#include "xla_ffi/transports/shm_link.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/transports/process_liveness.h"
#include "xla_ffi/transports/shm_link_impl.h"

namespace smddp {
namespace shm {

ShmLink::ShmLink(std::shared_ptr<ShmSegment> segment, bool creator, int peer_pid)
    : segment_(std::move(segment)) {
  Layout* lay = segment_->layout();
  const int me = creator ? 0 : 1;
  const int peer = 1 - me;
  me_side_ = &lay->side[me];
  peer_side_ = &lay->side[peer];
  write_ring_ = segment_->ring(me);
  read_ring_ = segment_->ring(peer);
  write_head_ = &lay->head[me].value;
  write_tail_ = &lay->tail[me].value;
  read_head_ = &lay->head[peer].value;
  read_tail_ = &lay->tail[peer].value;
  my_cancels_ = &lay->cancels[me].value;
  peer_cancels_ = &lay->cancels[peer].value;
  my_bell_ = &lay->bell[me];
  peer_bell_ = &lay->bell[peer];
  cap_ = segment_->ring_bytes();
  // Chunks small enough that the reader starts copying out early (and
  // several fit the ring), large enough that per-chunk costs vanish.
  max_chunk_ = std::min<uint64_t>(256 << 10, cap_ / 8 / kLine * kLine);
  min_partial_ = std::min<uint64_t>(4096, max_chunk_);
  const int pid = peer_pid > 0 ? peer_pid : peer_side_->pid.load(std::memory_order_acquire);
  peer_pid_.store(pid, std::memory_order_relaxed);
  char state;
  if (pid > 0 && !ReadProcStat(pid, &state, &peer_start_)) peer_start_ = 0;
  single_copy_min_ = SingleCopyMinBytes();
  if (single_copy_min_ == 0) {
    SetSingleCopyOff("turned off (JAX_SMDDP_SHM_SINGLE_COPY_BYTES=0)");
  } else {
    AllowPeersToRead();
  }
  pending_.reserve(16);
  posted_.reserve(16);
  incoming_.reserve(16);
  if (creator != segment_->created_here()) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(std::string("MakeShmLink: creator=") + (creator ? "true" : "false") +
               " but this process " + (segment_->created_here() ? "created" : "opened") +
               " the segment");
  }
}

ShmLink::~ShmLink() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked("the shared-memory link was closed");
  }
  // After our last ring write: the peer drains what we wrote, then sees
  // the flag and reports an orderly exit.
  me_side_->closed.store(1, std::memory_order_release);
  Ring(peer_bell_);
}

void ShmLink::Send(uint64_t tag, const void* src, size_t bytes, Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) {
    req->Complete(Status::WithCode(failure_code_, Failure()));
    return;
  }
  try {
    PendingSend send{tag, static_cast<const char*>(src), bytes, 0, req};
    send.remote = single_copy_min_ > 0 && bytes >= single_copy_min_ &&
                  !single_copy_refused_.load(std::memory_order_relaxed);
    pending_.push_back(send);
  } catch (...) {
    req->Complete(Status::Error("shared-memory link: out of memory"));
    return;
  }
  WritePassLocked();
}

void ShmLink::Recv(uint64_t tag, void* dst, size_t bytes, Request* req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) {
    req->Complete(Status::WithCode(failure_code_, Failure()));
    return;
  }
  for (size_t ui = 0; ui < unexpected_.size(); ++ui) {
    Unexpected* u = unexpected_[ui].get();
    if (u->tag != tag) continue;
    if (u->in_place && u->claim == nullptr) {
      // Still in the peer's memory: the next Progress reads it straight into
      // `dst` (ReadInPlaceMessagesLocked).
      if (u->total != bytes) {
        const uint64_t sent = u->total;
        unexpected_.erase(unexpected_.begin() + ptrdiff_t(ui));
        RejectInPlaceLocked(tag, sent, bytes, req);
        WritePassLocked();
      } else {
        u->claim = req;
        u->claim_dst = static_cast<char*>(dst);
      }
      return;
    }
    if (u->in_place) continue;  // claimed by an earlier receive
    // The oldest message under `tag` arrived (or is arriving) unexpected.
    Incoming* in = nullptr;
    for (Incoming& i : incoming_) {
      if (i.u == u) in = &i;
    }
    if (u->total != bytes) {
      Status mismatch = Status::Mismatch(MismatchMessage(u->total, tag, bytes));
      if (in != nullptr) in->u = nullptr;  // discard the rest
      unexpected_.erase(unexpected_.begin() + ptrdiff_t(ui));
      req->Complete(std::move(mismatch));
      return;
    }

    if (u->received > 0) std::memcpy(dst, u->data, u->received);
    if (u->complete || in == nullptr) {
      // (in == nullptr with !complete cannot happen; never wait forever.)
      const bool ok = u->complete;
      unexpected_.erase(unexpected_.begin() + ptrdiff_t(ui));
      if (ok && AttachToAckLocked(tag, req)) return;
      req->Complete(ok ? Status::Ok()
                       : Status::Error("shared-memory link: lost track of message "
                                       "under tag " +
                                       std::to_string(tag)));
      return;
    }
    // Partly arrived: the rest goes straight into `dst`.
    in->u = nullptr;
    in->req = req;
    in->dst = static_cast<char*>(dst);
    unexpected_.erase(unexpected_.begin() + ptrdiff_t(ui));
    return;
  }
  try {
    posted_.push_back(PostedRecv{tag, static_cast<char*>(dst), bytes, req});
  } catch (...) {
    req->Complete(Status::Error("shared-memory link: out of memory"));
  }
}

void ShmLink::Progress() {
  if (failed_.load(std::memory_order_acquire)) return;
  std::unique_lock<std::mutex> progress(progress_mu_, std::try_to_lock);
  if (!progress.owns_lock()) return;
  uint64_t total = 0;
  for (int round = 0; round < 16; ++round) {
    uint64_t moved = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_.load(std::memory_order_relaxed)) return;
      moved += WritePassLocked();
      moved += ReadPassLocked();
      if (!unexpected_.empty() && !ReadInPlaceMessagesLocked()) return;
      // While we read, the peer may have freed room in our ring (and the
      // reads in place queued their Acks).
      if (!pending_.empty()) moved += WritePassLocked();
    }
    total += moved;
    if (moved == 0 || total >= 4 * cap_) break;
  }
  // Requests of this process's other threads may have completed.
  if (total > 0 && my_bell_->sleepers.load(std::memory_order_seq_cst) != 0) Ring(my_bell_);
}

uint32_t ShmLink::Activity() const { return my_bell_->count.load(std::memory_order_seq_cst); }

void ShmLink::AwaitActivity(uint32_t seen, unsigned max_us) {
  my_bell_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  // The futex sleeps only while the count still equals `seen`: a ring
  // between the caller's last look and now returns at once.
  if (!failed_.load(std::memory_order_acquire)) FutexWait(&my_bell_->count, seen, max_us);
  my_bell_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmLink::Cancel(Request* req) {
  if (req == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < pending_.size(); ++i) {
    PendingSend& s = pending_[i];
    if (s.abort || s.req != req) continue;
    if (s.control != 0) {
      s.req = nullptr;  // a receive waiting for its Ack: the Ack still goes
      return;
    }
    if (s.started) {
      // Part of it is in the ring: tell the reader to drop the message.
      s.abort = true;
      s.req = nullptr;
      s.src = nullptr;
    } else {
      pending_.erase(pending_.begin() + ptrdiff_t(i));
    }
    return;
  }
  for (size_t i = 0; i < awaiting_.size(); ++i) {
    if (awaiting_[i].req != req) continue;
    // The peer may be reading the buffer now or later: count the cancel
    // before the caller may reuse it (the reader compares the count after
    // copying with the one sent with the reference), and tell the reader to
    // drop the message if it has not taken it yet.
    my_cancels_->fetch_add(1, std::memory_order_seq_cst);
    PendingSend abort = awaiting_[i];
    abort.abort = true;
    abort.remote = false;
    abort.req = nullptr;
    abort.src = nullptr;
    awaiting_.erase(awaiting_.begin() + ptrdiff_t(i));
    pending_.insert(pending_.begin(), abort);
    WritePassLocked();
    return;
  }
  for (size_t i = 0; i < posted_.size(); ++i) {
    if (posted_[i].req == req) {
      posted_.erase(posted_.begin() + ptrdiff_t(i));
      return;
    }
  }
  for (auto& u : unexpected_) {
    if (u->claim == req) {
      u->claim = nullptr;  // the message waits for another receive
      u->claim_dst = nullptr;
      return;
    }
  }
  for (Incoming& in : incoming_) {
    if (in.req == req) {
      in.req = nullptr;  // the rest of the message is discarded
      in.dst = nullptr;
      return;
    }
  }
}

std::string ShmLink::PeerFailure() {
  if (failed_.load(std::memory_order_acquire)) return Failure();
  std::unique_lock<std::mutex> live(live_mu_, std::try_to_lock);
  if (!live.owns_lock()) return "";  // another thread is checking
  std::string reason;
  int pid = peer_pid_.load(std::memory_order_relaxed);
  if (pid <= 0) {
    // The opener records its pid when it maps the segment.
    pid = peer_side_->pid.load(std::memory_order_acquire);
    if (pid > 0) {
      char state;
      if (!ReadProcStat(pid, &state, &peer_start_)) peer_start_ = 0;
      peer_pid_.store(pid, std::memory_order_relaxed);
    }
  }
  if (peer_side_->closed.load(std::memory_order_acquire) != 0) {
    reason = "process " + std::to_string(pid) + " exited (it closed the link)";
  } else {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check_ || pid <= 0) return "";
    next_check_ = now + std::chrono::milliseconds(20);
    reason = CheckProcess(pid, peer_start_);
    if (reason.empty()) return "";
  }
  {
    // The peer writes no more: take in what it wrote before it went, so
    // that requests it satisfied complete, then fail the rest.
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load(std::memory_order_relaxed)) {
      for (int i = 0; i < 4 && ReadPassLocked() > 0; ++i) {
      }
      FailLocked(reason);
    }
  }
  return Failure();
}

StatusCode ShmLink::PeerFailureCode() {
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failure_code_;
}

std::string ShmLink::Kind() const { return "shared memory"; }

std::string ShmLink::Failure() {
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failure_;
}

std::string ShmLink::Corrupt(const std::string& what) const {
  return "shared-memory link to process " + std::to_string(peer_pid_.load()) +
         ": corrupt data from the peer (" + what + ")";
}

// The peer wrote what this process cannot parse: the link fails with a
// protocol error naming it.
void ShmLink::FailCorruptLocked(const std::string& what) {
  FailLocked(Corrupt(what), StatusCode::kProtocol);
}

std::string ShmLink::MismatchMessage(uint64_t sent, uint64_t tag, uint64_t expected) {
  return "peer sent " + std::to_string(sent) + " bytes under tag " + std::to_string(tag) +
         ", expected " + std::to_string(expected);
}

// Fails every request; the link does nothing more. kPeerFailed: the link
// is gone with its peer; kProtocol: the peer wrote what cannot be parsed.
void ShmLink::FailLocked(std::string reason, StatusCode code) {
  if (failed_.load(std::memory_order_relaxed)) return;
  {
    std::lock_guard<std::mutex> lock(fail_mu_);
    failure_ = std::move(reason);
    failure_code_ = code;
  }
  failed_.store(true, std::memory_order_release);
  const Status st = Status::WithCode(code, Failure());
  for (PendingSend& s : pending_) {
    if (!s.abort && s.req != nullptr) s.req->Complete(st);
  }
  for (PendingSend& s : awaiting_) s.req->Complete(st);
  awaiting_.clear();
  for (PostedRecv& r : posted_) r.req->Complete(st);
  for (auto& u : unexpected_) {
    if (u->claim != nullptr) u->claim->Complete(st);
  }
  for (Incoming& in : incoming_) {
    if (in.req != nullptr) in.req->Complete(st);
  }
  pending_.clear();
  posted_.clear();
  incoming_.clear();
  unexpected_.clear();
}

}  // namespace shm

std::unique_ptr<Link> MakeShmLink(std::shared_ptr<ShmSegment> segment, bool creator, int peer_pid) {
  return std::make_unique<shm::ShmLink>(std::move(segment), creator, peer_pid);
}

}  // namespace smddp
