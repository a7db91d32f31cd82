// The shared-memory link's ring protocol (shm_link.h): chunks written into
// this side's ring and read from the peer's, each checked before use, and
// delivered to a posted receive or the unexpected store.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "xla_ffi/transports/shm_link_impl.h"

namespace smddp {
namespace shm {

// Free bytes in the write ring, from the peer's read position. False (the
// link failed) if that position is impossible.
bool ShmLink::WriteSpaceLocked(uint64_t* free_bytes) {
  const uint64_t tail = write_tail_->load(std::memory_order_acquire);
  const uint64_t used = write_head_local_ - tail;
  if (tail % kLine != 0 || tail < seen_tail_ || used > cap_) {
    FailCorruptLocked("read position " + std::to_string(tail) + ", write position " +
                      std::to_string(write_head_local_));
    return false;
  }
  seen_tail_ = tail;
  *free_bytes = cap_ - used;
  return true;
}

void ShmLink::WriteChunkLocked(uint64_t tag, uint64_t total, uint64_t offset, uint64_t len,
                               uint64_t flags, const char* src) {
  ChunkHeader h{};
  h.tag = tag;
  h.total = total;
  h.offset = offset;
  h.len = len;
  h.flags = flags;
  h.check = ChunkCheck(h);
  const uint64_t pos = write_head_local_ % cap_;  // 64-aligned: the header never wraps
  std::memcpy(write_ring_ + pos, &h, sizeof(h));
  if (len > 0) {
    const uint64_t at = (pos + kLine) % cap_;
    const uint64_t first = std::min(len, cap_ - at);
    std::memcpy(write_ring_ + at, src, first);
    if (len > first) std::memcpy(write_ring_, src + first, len - first);
  }
  write_head_local_ += kLine + RoundUp(len, kLine);
  write_head_->store(write_head_local_, std::memory_order_release);
  Ring(peer_bell_);
}

// Whether pending_[i] may write: no earlier send under its tag is pending
// (the reader tells messages apart by tag, so those never interleave).
bool ShmLink::EligibleLocked(size_t i) const {
  if (pending_[i].control != 0) return true;
  for (size_t j = 0; j < i; ++j) {
    if (pending_[j].control == 0 && pending_[j].tag == pending_[i].tag) return false;
  }
  return true;
}

// Writes chunks of pending sends, one per send in turn, while they fit.
// Returns the ring bytes written.
uint64_t ShmLink::WritePassLocked() {
  if (pending_.empty()) return 0;
  uint64_t free_bytes = 0;
  if (!WriteSpaceLocked(&free_bytes)) return 0;
  uint64_t written = 0;
  bool progressed = true;
  while (progressed && !pending_.empty()) {
    progressed = false;
    for (size_t i = 0; i < pending_.size();) {
      if (free_bytes < kLine) {
        if (!WriteSpaceLocked(&free_bytes)) return written;
        if (free_bytes < kLine) return written;
      }
      if (!EligibleLocked(i)) {
        ++i;
        continue;
      }
      PendingSend& s = pending_[i];
      if (s.control != 0) {
        // An Ack or Nack; a Nack carries the reader's errno as the size.
        WriteChunkLocked(s.tag, s.bytes, 0, 0, s.control, /*src=*/nullptr);
        free_bytes -= kLine;
        written += kLine;
        Request* req = s.req;
        pending_.erase(pending_.begin() + ptrdiff_t(i));
        if (req != nullptr) req->Complete(Status::Ok());
        progressed = true;
        continue;
      }
      if (s.remote && !s.abort) {
        if (free_bytes < 2 * kLine) {
          if (!WriteSpaceLocked(&free_bytes)) return written;
          if (free_bytes < 2 * kLine) {
            ++i;
            continue;
          }
        }
        const RemoteRef ref{uint64_t(reinterpret_cast<uintptr_t>(s.src)),
                            my_cancels_->load(std::memory_order_seq_cst)};
        WriteChunkLocked(s.tag, s.bytes, 0, sizeof(ref), kFlagRemote,
                         reinterpret_cast<const char*>(&ref));
        free_bytes -= 2 * kLine;
        written += 2 * kLine;
        s.started = true;
        try {
          awaiting_.push_back(s);
        } catch (...) {
          FailLocked("shared-memory link: out of memory");
          return written;
        }
        pending_.erase(pending_.begin() + ptrdiff_t(i));
        progressed = true;
        continue;
      }
      if (s.abort) {
        WriteChunkLocked(s.tag, 0, 0, 0, kFlagAbort, /*src=*/nullptr);
        free_bytes -= kLine;
        written += kLine;
        pending_.erase(pending_.begin() + ptrdiff_t(i));
        progressed = true;
        continue;
      }
      const uint64_t remaining = s.bytes - s.sent;
      uint64_t len = std::min(remaining, max_chunk_);
      if (kLine + RoundUp(len, kLine) > free_bytes) {
        if (!WriteSpaceLocked(&free_bytes)) return written;
        if (kLine + RoundUp(len, kLine) > free_bytes) {
          // Take what room there is, unless that is only a sliver.
          const uint64_t room = (free_bytes - kLine) / kLine * kLine;
          if (room < min_partial_) {
            ++i;
            continue;
          }
          len = room;
        }
      }
      WriteChunkLocked(s.tag, s.bytes, s.sent, len, 0, s.src + s.sent);
      const uint64_t foot = kLine + RoundUp(len, kLine);
      free_bytes -= foot;
      written += foot;
      s.sent += len;
      s.started = true;
      progressed = true;
      if (s.sent == s.bytes) {
        Request* req = s.req;
        pending_.erase(pending_.begin() + ptrdiff_t(i));
        req->Complete(Status::Ok());
        continue;
      }
      ++i;
    }
  }
  return written;
}

void ShmLink::CopyFromRing(char* dst, uint64_t at, uint64_t len) const {
  const uint64_t first = std::min(len, cap_ - at);
  if (first > 0) std::memcpy(dst, read_ring_ + at, first);
  if (len > first) std::memcpy(dst + first, read_ring_, len - first);
}

// Reads every chunk that has arrived. Returns the ring bytes consumed.
uint64_t ShmLink::ReadPassLocked() {
  const uint64_t head = read_head_->load(std::memory_order_acquire);
  uint64_t avail = head - read_tail_local_;
  if (avail == 0) return 0;
  if (avail > cap_ || head % kLine != 0) {
    FailCorruptLocked("write position " + std::to_string(head) + ", read position " +
                      std::to_string(read_tail_local_));
    return 0;
  }
  uint64_t consumed = 0;
  while (avail > 0) {
    // Copy the header out first: the peer could change it after the checks.
    ChunkHeader h;
    std::memcpy(&h, read_ring_ + read_tail_local_ % cap_, sizeof(h));
    if (h.check != ChunkCheck(h)) {
      FailCorruptLocked("bad chunk header at " + std::to_string(read_tail_local_));
      return consumed;
    }
    const uint64_t kind = h.flags & (kControlFlags | kFlagRemote);
    const bool bad_flags =
        (h.flags & ~(kControlFlags | kFlagRemote)) != 0 || (kind & (kind - 1)) != 0;  // at most one
    const bool bad_payload = (kind & kControlFlags) != 0 ? h.len != 0 || h.offset != 0
                             : kind == kFlagRemote
                                 ? h.len != sizeof(RemoteRef) || h.offset != 0
                                 : h.offset > h.total || h.len > h.total - h.offset;
    if (bad_flags || bad_payload || h.len > cap_ - kLine || kLine + RoundUp(h.len, kLine) > avail) {
      FailCorruptLocked("chunk tag " + std::to_string(h.tag) + " size " + std::to_string(h.total) +
                        " offset " + std::to_string(h.offset) + " length " + std::to_string(h.len) +
                        " flags " + std::to_string(h.flags) + " with " + std::to_string(avail) +
                        " bytes in the ring");
      return consumed;
    }
    if (!DeliverLocked(h, (read_tail_local_ + kLine) % cap_)) return consumed;
    const uint64_t foot = kLine + RoundUp(h.len, kLine);
    read_tail_local_ += foot;
    avail -= foot;
    consumed += foot;
    read_tail_->store(read_tail_local_, std::memory_order_release);
  }
  Ring(peer_bell_);  // room in the peer's ring (and it may wait for that)
  return consumed;
}

// Handles one checked chunk whose payload is at `at` in the read ring.
// False if the link failed.
bool ShmLink::DeliverLocked(const ChunkHeader& h, uint64_t at) {
  if ((h.flags & (kFlagAck | kFlagNack)) != 0) return AnswerLocked(h);
  if ((h.flags & kFlagRemote) != 0) return DeliverRemoteLocked(h, at);
  size_t idx = incoming_.size();
  for (size_t i = 0; i < incoming_.size(); ++i) {
    if (incoming_[i].tag == h.tag) {
      idx = i;
      break;
    }
  }
  if ((h.flags & kFlagAbort) != 0) {
    if (idx == incoming_.size()) {
      // Nothing of it came through the ring; if it waits to be read in
      // place, its buffer may be gone.
      for (size_t i = 0; i < unexpected_.size(); ++i) {
        if (unexpected_[i]->in_place && unexpected_[i]->tag == h.tag) {
          Request* claim = unexpected_[i]->claim;
          unexpected_.erase(unexpected_.begin() + ptrdiff_t(i));
          if (claim != nullptr) {
            claim->Complete(Status::PeerFailed("process " + std::to_string(peer_pid_.load()) +
                                               " cancelled sending the message under tag " +
                                               std::to_string(h.tag)));
          }
          break;
        }
      }
      return true;
    }
    Incoming in = incoming_[idx];
    incoming_.erase(incoming_.begin() + ptrdiff_t(idx));
    if (in.u != nullptr) DropUnexpectedLocked(in.u);
    if (in.req != nullptr) {
      in.req->Complete(Status::PeerFailed("process " + std::to_string(peer_pid_.load()) +
                                          " cancelled sending the message under tag " +
                                          std::to_string(h.tag)));
    }
    return true;
  }
  if (idx == incoming_.size()) {
    // A new message.
    if (h.offset != 0) {
      FailCorruptLocked("chunk at offset " + std::to_string(h.offset) + " of a message under tag " +
                        std::to_string(h.tag) + " that had not started");
      return false;
    }
    Incoming in{h.tag, h.total, 0, nullptr, nullptr, nullptr};
    size_t r = 0;
    while (r < posted_.size() && posted_[r].tag != h.tag) ++r;
    if (r < posted_.size()) {
      const PostedRecv p = posted_[r];
      posted_.erase(posted_.begin() + ptrdiff_t(r));
      if (p.bytes != h.total) {
        // The message is that receive's; drop it.
        p.req->Complete(Status::Mismatch(MismatchMessage(h.total, h.tag, p.bytes)));
      } else {
        in.req = p.req;
        in.dst = p.dst;
      }
    } else {
      in.u = StoreUnexpectedLocked(h.tag, h.total, /*with_data=*/true);
      if (in.u == nullptr) return false;
    }
    try {
      incoming_.push_back(in);
    } catch (...) {
      FailLocked("shared-memory link: out of memory");
      return false;
    }
    idx = incoming_.size() - 1;
  } else if (incoming_[idx].total != h.total || incoming_[idx].next != h.offset) {
    FailCorruptLocked("chunk of " + std::to_string(h.total) + " bytes at offset " +
                      std::to_string(h.offset) + " under tag " + std::to_string(h.tag) +
                      "; expected a message of " + std::to_string(incoming_[idx].total) +
                      " bytes at offset " + std::to_string(incoming_[idx].next));
    return false;
  }
  Incoming& in = incoming_[idx];
  if (h.len > 0) {
    if (in.req != nullptr) {
      CopyFromRing(in.dst + h.offset, at, h.len);
    } else if (in.u != nullptr) {
      CopyFromRing(in.u->data + h.offset, at, h.len);
    }
  }
  in.next += h.len;
  if (in.u != nullptr) in.u->received = in.next;
  if (in.next == in.total) {
    const Incoming done = in;
    incoming_.erase(incoming_.begin() + ptrdiff_t(idx));
    if (done.u != nullptr) done.u->complete = true;
    if (done.req != nullptr) done.req->Complete(Status::Ok());
  }
  return true;
}

ShmLink::Unexpected* ShmLink::StoreUnexpectedLocked(uint64_t tag, uint64_t total, bool with_data) {
  std::unique_ptr<Unexpected> u(new (std::nothrow) Unexpected());
  if (u == nullptr) {
    FailLocked("shared-memory link: out of memory");
    return nullptr;
  }
  u->tag = tag;
  u->total = total;
  if (with_data && !AllocateUnexpectedLocked(u.get())) return nullptr;
  try {
    unexpected_.push_back(std::move(u));
  } catch (...) {
    FailLocked("shared-memory link: out of memory");
    return nullptr;
  }
  return unexpected_.back().get();
}

bool ShmLink::AllocateUnexpectedLocked(Unexpected* u) {
  if (u->total == 0) return true;
  u->data = static_cast<char*>(std::malloc(u->total));
  if (u->data == nullptr) {
    FailLocked("shared-memory link: cannot allocate " + std::to_string(u->total) +
               " bytes for the early-arrived message under tag " + std::to_string(u->tag));
    return false;
  }
  return true;
}

void ShmLink::DropUnexpectedLocked(const Unexpected* u) {
  for (size_t i = 0; i < unexpected_.size(); ++i) {
    if (unexpected_[i].get() == u) {
      unexpected_.erase(unexpected_.begin() + ptrdiff_t(i));
      return;
    }
  }
}

}  // namespace shm
}  // namespace smddp
