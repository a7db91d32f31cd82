// The shared-memory link's single copy (shm_link.h): a message of
// SingleCopyMinBytes() or more is read in place from the writer's memory
// (process_vm_readv) and answered with an Ack, or a Nack when the kernel
// refuses, after which messages go through the ring.
#include <errno.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "xla_ffi/common/settings.h"
#include "xla_ffi/transports/shm_link_impl.h"

namespace smddp {

size_t SingleCopyMinBytes() {
  static const uint64_t bytes = uint64_t(IntSetting("JAX_SMDDP_SHM_SINGLE_COPY_BYTES"));
  return size_t(bytes);
}

namespace shm {

uint64_t ShmLink::SingleCopyBytes() const {
  return single_copy_bytes_.load(std::memory_order_relaxed);
}

std::string ShmLink::SingleCopy() const {
  std::lock_guard<std::mutex> lock(single_copy_mu_);
  return single_copy_off_.empty() ? "on" : "off: " + single_copy_off_;
}

// Queues an Ack or Nack for message `tag` of the peer, ahead of data.
// `req` (a receive) completes once the Ack is in the ring: a process never
// leaves a call with the peer still waiting for its Ack.
void ShmLink::QueueControlLocked(uint64_t tag, uint64_t flag, uint64_t value, Request* req) {
  PendingSend c{tag, nullptr, value, 0, req};
  c.control = flag;
  try {
    pending_.insert(pending_.begin(), c);
  } catch (...) {
    FailLocked("shared-memory link: out of memory");
  }
}

// If the Ack of the peer's message `tag` is still to be written, `req`
// completes when it is.
bool ShmLink::AttachToAckLocked(uint64_t tag, Request* req) {
  for (PendingSend& c : pending_) {
    if (c.control == kFlagAck && c.tag == tag && c.req == nullptr) {
      c.req = req;
      WritePassLocked();
      return true;
    }
  }
  return false;
}

void ShmLink::SetSingleCopyOff(const std::string& why) {
  std::lock_guard<std::mutex> lock(single_copy_mu_);
  if (single_copy_off_.empty()) single_copy_off_ = why;
}

// Under Yama's ptrace_scope 1 (Ubuntu's default) only an ancestor may read
// a process's memory; this lets the job's other processes (same user) do
// it, as without Yama. Elsewhere a no-op.
void ShmLink::AllowPeersToRead() {
  static std::once_flag once;
  std::call_once(once, [] { ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); });
}

int ShmLink::PeerPidLocked() {
  int pid = peer_pid_.load(std::memory_order_relaxed);
  return pid > 0 ? pid : peer_side_->pid.load(std::memory_order_acquire);
}

// A RemoteRef chunk. With a receive posted under its tag, the message is
// copied from the peer's memory straight into that receive's buffer now,
// then acknowledged. Without one, a message of kWaitForReceiveBytes or more
// is not read yet: the reference waits in the unexpected store for its
// receive (the first Progress after Recv reads it, with the one copy), and
// the writer's send completes when it is read. Reading it at once into the
// store meant two copies, and a reader that met a 16 MiB message while still
// waiting for the call's first small one spent the first copy's milliseconds
// before it could post the receive, while the writer waited for its data
// (docs/cpu_floor.md, "Calls that start together"). One that no
// receive claims within kUnclaimedReadAfter is read into the store after all
// (ReadInPlaceMessagesLocked), so a writer whose receive is posted only once
// its send is done is never stuck on this side. Smaller messages are read
// into the store at once, as their second copy costs less than the writer's
// wait for the receive.
bool ShmLink::DeliverRemoteLocked(const ChunkHeader& h, uint64_t at) {
  RemoteRef ref;
  CopyFromRing(reinterpret_cast<char*>(&ref), at, sizeof(ref));
  size_t r = 0;
  while (r < posted_.size() && posted_[r].tag != h.tag) ++r;
  if (r < posted_.size()) {
    const PostedRecv p = posted_[r];
    if (p.bytes != h.total) {
      posted_.erase(posted_.begin() + ptrdiff_t(r));
      RejectInPlaceLocked(h.tag, h.total, p.bytes, p.req);
      return true;
    }
    const InPlace read = ReadInPlaceLocked(h.tag, h.total, ref, p.dst, p.req);
    if (read == InPlace::kLinkFailed) return false;
    // Refused: the receive stays posted for the copy through the ring.
    if (read != InPlace::kRefused) posted_.erase(posted_.begin() + ptrdiff_t(r));
    return !failed_.load(std::memory_order_relaxed);
  }
  Unexpected* u = StoreUnexpectedLocked(h.tag, h.total, /*with_data=*/false);
  if (u == nullptr) return false;
  u->in_place = true;
  u->ref = ref;
  u->since = std::chrono::steady_clock::now();
  return true;
}

// A receive of `expected` bytes met the peer's message `tag` of `sent`,
// still in the peer's memory: the receive fails, and an Ack frees the
// writer's buffer.
void ShmLink::RejectInPlaceLocked(uint64_t tag, uint64_t sent, uint64_t expected, Request* req) {
  QueueControlLocked(tag, kFlagAck, 0);
  req->Complete(Status::Mismatch(MismatchMessage(sent, tag, expected)));
}

// Copies the peer's message `tag` (`total` bytes at `ref` in its memory)
// into `dst`. kRead: copied and its Ack queued (`req`, if any, completes once
// the Ack is written). kFailed: the peer cancelled the message or exited
// while it was read (`req`, if any, completes with that; no Ack, the writer
// gave it up). kRefused: the kernel does not let this process read the
// peer's memory; a Nack asks for the message again through the ring (and
// single copy is off from then on). kLinkFailed: the link failed.
ShmLink::InPlace ShmLink::ReadInPlaceLocked(uint64_t tag, uint64_t total, const RemoteRef& ref,
                                            char* dst, Request* req) {
  const int pid = PeerPidLocked();
  const std::string peer = "process " + std::to_string(pid);
  bool cancelled = false;
  const int err = ReadRemote(pid, ref, dst, total, &cancelled);
  if (err == EPERM || err == EACCES || err == ENOSYS) {
    SetSingleCopyOff("this process may not read " + peer +
                     "'s memory (process_vm_readv: " + std::strerror(err) +
                     "; ptrace rules: Yama's ptrace_scope, a "
                     "container without CAP_SYS_PTRACE or with a seccomp filter, another "
                     "user, or a process that is not dumpable); messages go through the ring "
                     "(two copies)");
    QueueControlLocked(tag, kFlagNack, uint64_t(err));
    return failed_.load(std::memory_order_relaxed) ? InPlace::kLinkFailed : InPlace::kRefused;
  }
  Status st = Status::Ok();
  if (cancelled) {
    st = Status::PeerFailed(peer + " cancelled the message under tag " + std::to_string(tag) +
                            " while it was being read");
  } else if (err == ESRCH) {
    st = Status::PeerFailed(peer + " exited while this process read a message from its memory");
  } else if (err != 0) {
    FailCorruptLocked("reading " + std::to_string(total) + " bytes at " +
                      std::to_string(ref.address) + " of its memory failed: " + std::strerror(err));
    return InPlace::kLinkFailed;
  }
  if (!st.ok()) {
    if (req != nullptr) req->Complete(std::move(st));
    return InPlace::kFailed;
  }
  single_copy_bytes_.fetch_add(total, std::memory_order_relaxed);
  QueueControlLocked(tag, kFlagAck, 0, req);
  return failed_.load(std::memory_order_relaxed) ? InPlace::kLinkFailed : InPlace::kRead;
}

// Reads the messages to be read in place that wait in the unexpected store:
// into their receives where Recv claimed them, else into the store, those
// under kWaitForReceiveBytes at once and larger ones once they have waited
// kUnclaimedReadAfter. In Progress rather than in Recv, so that a caller
// posts its sends before it copies. False if the link failed.
bool ShmLink::ReadInPlaceMessagesLocked() {
  std::chrono::steady_clock::time_point now{};  // read once, when a message may still wait
  for (size_t i = 0; i < unexpected_.size();) {
    Unexpected* u = unexpected_[i].get();
    bool wait = !u->in_place;
    if (!wait && u->claim == nullptr && u->total >= kWaitForReceiveBytes) {
      if (now == std::chrono::steady_clock::time_point{}) now = std::chrono::steady_clock::now();
      wait = now - u->since < kUnclaimedReadAfter;
    }
    if (wait) {
      ++i;
      continue;
    }
    if (u->claim != nullptr) {
      const PostedRecv p{u->tag, u->claim_dst, u->total, u->claim};
      const std::unique_ptr<Unexpected> done = std::move(unexpected_[i]);
      unexpected_.erase(unexpected_.begin() + ptrdiff_t(i));
      const InPlace read = ReadInPlaceLocked(p.tag, p.bytes, done->ref, p.dst, p.req);
      if (read == InPlace::kLinkFailed) {
        p.req->Complete(Status::WithCode(PeerFailureCode(), Failure()));
        return false;
      }
      if (read == InPlace::kRefused) {
        // Posted again, ahead of later receives under its tag, for the copy
        // through the ring.
        size_t r = 0;
        while (r < posted_.size() && posted_[r].tag != p.tag) ++r;
        try {
          posted_.insert(posted_.begin() + ptrdiff_t(r), p);
        } catch (...) {
          p.req->Complete(Status::Error("shared-memory link: out of memory"));
        }
      }
      continue;
    }
    if (!AllocateUnexpectedLocked(u)) return false;
    const InPlace read = ReadInPlaceLocked(u->tag, u->total, u->ref, u->data, nullptr);
    if (read == InPlace::kLinkFailed) return false;
    if (read == InPlace::kRead) {
      u->in_place = false;
      u->received = u->total;
      u->complete = true;
      ++i;
    } else {
      // Given up by the writer, or coming again through the ring.
      unexpected_.erase(unexpected_.begin() + ptrdiff_t(i));
    }
  }
  return true;
}

// Copies `bytes` at `ref.address` of process `pid` into `dst`. Returns 0
// or an errno; `cancelled`: the peer cancelled a message since it sent
// `ref` (perhaps this one, whose buffer may then be gone or reused: what
// was read is discarded).
int ShmLink::ReadRemote(int pid, const RemoteRef& ref, char* dst, uint64_t bytes, bool* cancelled) {
  const uint64_t address = ref.address;
  uint64_t done = 0;
  int err = pid > 0 ? 0 : ESRCH;
  while (err == 0 && done < bytes) {
    iovec local{dst + done, size_t(bytes - done)};
    iovec remote{reinterpret_cast<void*>(uintptr_t(address + done)), size_t(bytes - done)};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EFAULT;
      break;
    }
    done += uint64_t(n);
  }
  *cancelled = peer_cancels_->load(std::memory_order_seq_cst) != ref.cancels;
  return err;
}

// The peer's answer to a message it read in place (Ack: done; Nack: it may
// not, so the message goes again through the ring, as do all later ones).
bool ShmLink::AnswerLocked(const ChunkHeader& h) {
  for (size_t i = 0; i < awaiting_.size(); ++i) {
    if (awaiting_[i].tag != h.tag) continue;
    PendingSend s = awaiting_[i];
    awaiting_.erase(awaiting_.begin() + ptrdiff_t(i));
    if ((h.flags & kFlagAck) != 0) {
      s.req->Complete(Status::Ok());
      return true;
    }
    single_copy_refused_.store(true, std::memory_order_relaxed);
    SetSingleCopyOff(
        "process " + std::to_string(PeerPidLocked()) +
        " may not read this process's memory (process_vm_readv: " + std::strerror(int(h.total)) +
        "); messages go through the ring (two "
        "copies)");
    s.remote = false;
    s.started = false;
    s.sent = 0;
    try {
      pending_.push_back(s);
    } catch (...) {
      s.req->Complete(Status::Error("shared-memory link: out of memory"));
    }
    return true;
  }
  return true;  // a message this process cancelled
}

}  // namespace shm
}  // namespace smddp
