// The shared-memory link's single copy (shm_link.h): a message of
// SingleCopyMinBytes() or more is read in place from the writer's memory
// (process_vm_readv) and answered with an Ack, or a Nack when the kernel
// refuses, after which messages go through the ring.
#include <errno.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>

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

// A RemoteRef chunk: the message is copied from the peer's memory now,
// straight into its receive's buffer if one is posted, else into the
// unexpected store (so that sends complete without a posted receive, as
// through the ring), then acknowledged. If the kernel refuses (ptrace
// rules), the receive stays posted, a Nack asks the peer to send the message
// through the ring, and the link says why single copy is off.
bool ShmLink::DeliverRemoteLocked(const ChunkHeader& h, uint64_t at) {
  RemoteRef ref;
  CopyFromRing(reinterpret_cast<char*>(&ref), at, sizeof(ref));
  size_t r = 0;
  while (r < posted_.size() && posted_[r].tag != h.tag) ++r;
  if (r < posted_.size() && posted_[r].bytes != h.total) {
    const PostedRecv p = posted_[r];
    posted_.erase(posted_.begin() + ptrdiff_t(r));
    QueueControlLocked(h.tag, kFlagAck, 0);  // the writer's buffer is free
    p.req->Complete(Status::Mismatch(MismatchMessage(h.total, h.tag, p.bytes)));
    return true;
  }
  std::unique_ptr<Unexpected> u;
  char* dst = nullptr;
  if (r < posted_.size()) {
    dst = posted_[r].dst;
  } else {
    u.reset(new (std::nothrow) Unexpected());
    if (u != nullptr && h.total > 0) u->data = static_cast<char*>(std::malloc(h.total));
    if (u == nullptr || u->data == nullptr) {
      FailLocked("shared-memory link: cannot allocate " + std::to_string(h.total) +
                 " bytes for the early-arrived message under tag " + std::to_string(h.tag));
      return false;
    }
    u->tag = h.tag;
    u->total = h.total;
    dst = u->data;
  }
  const int pid = PeerPidLocked();
  const std::string peer = "process " + std::to_string(pid);
  bool cancelled = false;
  const int err = ReadRemote(pid, ref, dst, h.total, &cancelled);
  if (err == EPERM || err == EACCES || err == ENOSYS) {
    SetSingleCopyOff("this process may not read " + peer +
                     "'s memory (process_vm_readv: " + std::strerror(err) +
                     "; ptrace rules: Yama's ptrace_scope, a "
                     "container without CAP_SYS_PTRACE or with a seccomp filter, another "
                     "user, or a process that is not dumpable); messages go through the ring "
                     "(two copies)");
    QueueControlLocked(h.tag, kFlagNack, uint64_t(err));
    return !failed_.load(std::memory_order_relaxed);
  }
  Status st = Status::Ok();
  if (cancelled) {
    st = Status::PeerFailed(peer + " cancelled the message under tag " + std::to_string(h.tag) +
                            " while it was being read");
  } else if (err == ESRCH) {
    st = Status::PeerFailed(peer +
                            " exited while this process read a message from its "
                            "memory");
  } else if (err != 0) {
    FailCorruptLocked("reading " + std::to_string(h.total) + " bytes at " +
                      std::to_string(ref.address) + " of its memory failed: " + std::strerror(err));
    return false;
  } else {
    single_copy_bytes_.fetch_add(h.total, std::memory_order_relaxed);
  }
  if (u == nullptr) {
    const PostedRecv p = posted_[r];
    posted_.erase(posted_.begin() + ptrdiff_t(r));
    if (st.ok()) {
      QueueControlLocked(h.tag, kFlagAck, 0, p.req);  // completes p once written
    } else {
      p.req->Complete(std::move(st));
    }
  } else if (st.ok()) {
    QueueControlLocked(h.tag, kFlagAck, 0);
    u->received = u->total;
    u->complete = true;
    try {
      unexpected_.push_back(std::move(u));
    } catch (...) {
      FailLocked("shared-memory link: out of memory");
      return false;
    }
  }
  return !failed_.load(std::memory_order_relaxed);
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
