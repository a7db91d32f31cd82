#include "xla_ffi/transports/shm_link.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/common/protocol.h"
#include "xla_ffi/transports/process_liveness.h"
#include "xla_ffi/transports/shm_file.h"
#include "xla_ffi/common/settings.h"

namespace smddp {
namespace {

// Segment layout: a page of control data (header, each side's pid and closed
// flag, each ring's head and tail, each side's doorbell, every field group on
// its own cache line), then ring 0 (written by the creator) and ring 1
// (written by the opener).
constexpr uint64_t kMagic = 0x314b4e494c4d4853ull;  // "SHMLINK1"
// The segment's layout version is the wire protocol's (common/protocol.h).
constexpr uint64_t kLine = 64;
constexpr uint64_t kPage = 4096;
constexpr uint64_t kDataOffset = kPage;
constexpr uint64_t kMinRing = 16 << 10;
constexpr uint64_t kMaxRing = uint64_t(1) << 30;

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "ring counters in shared memory must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "");

struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t data_offset;
  uint64_t ring_bytes;
  uint64_t total_bytes;
};

struct alignas(64) SideState {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> closed;
};

struct alignas(64) Counter {
  std::atomic<uint64_t> value;
};

struct alignas(64) Doorbell {
  std::atomic<uint32_t> count;
  std::atomic<uint32_t> sleepers;
};

struct Layout {
  SegmentHeader header;  // offset 0
  SideState side[2];     // 64, 128: 0 = creator, 1 = opener
  Counter head[2];       // 192, 256: ring i is written by side i
  Counter tail[2];       // 320, 384
  // Side i's cancels of messages the peer may be reading in place: a reader
  // that sees this change while it copied discards what it read.
  Counter cancels[2];    // 448, 512
  // Side i's doorbell: the peer (or another thread of side i) adds to `count`
  // after writing to side i's ring, freeing room in side i's ring or
  // completing side i's requests, and wakes side i's `sleepers` (a futex on
  // `count`): a waiter sleeps until something happened instead of polling.
  Doorbell bell[2];      // 576, 640
};
static_assert(sizeof(Layout) <= kDataOffset, "control data must fit one page");

// A chunk: this header, then `len` payload bytes, padded to 64.
constexpr uint64_t kFlagAbort = 1;   // the sender cancelled message `tag`
// Single copy: the payload is a RemoteRef, and the reader copies the
// message's `total` bytes straight from the writer's memory
// (process_vm_readv), then answers with an Ack (the writer's buffer is free)
// or, if it may not read there, a Nack (total = its errno) after which the
// writer sends the message again through the ring.
constexpr uint64_t kFlagRemote = 2;
constexpr uint64_t kFlagAck = 4;
constexpr uint64_t kFlagNack = 8;
constexpr uint64_t kControlFlags = kFlagAbort | kFlagAck | kFlagNack;  // header only
struct RemoteRef {
  uint64_t address;  // of the message in the writer's address space
  uint64_t cancels;  // the writer's cancel count when it sent the reference
};
struct ChunkHeader {
  uint64_t tag;
  uint64_t total;   // the message's size
  uint64_t offset;  // of this chunk's payload in the message
  uint64_t len;     // payload bytes
  uint64_t flags;
  uint64_t check;   // ChunkCheck() of the fields above
  uint64_t reserved[2];
};
static_assert(sizeof(ChunkHeader) == kLine, "chunk header is one cache line");

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

uint64_t ChunkCheck(const ChunkHeader& h) {
  uint64_t x = kMagic;
  x = Mix(x ^ h.tag);
  x = Mix(x ^ h.total);
  x = Mix(x ^ h.offset);
  x = Mix(x ^ h.len);
  x = Mix(x ^ h.flags);
  return x;
}

uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// Futexes on the shared segment (not FUTEX_PRIVATE_FLAG: two processes).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, unsigned max_us) {
  timespec timeout{time_t(max_us / 1000000), long(max_us % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout,
            nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
}

// Tells the side that owns `bell` that something happened, waking it if it
// sleeps. Cheap when nobody sleeps: one atomic add and one load.
void Ring(Doorbell* bell) {
  bell->count.fetch_add(1, std::memory_order_seq_cst);
  if (bell->sleepers.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&bell->count);
}

}  // namespace

class ShmSegment {
 public:
  ShmSegment(void* base, size_t size, bool created_here)
      : base_(static_cast<char*>(base)), size_(size), created_here_(created_here) {}
  ~ShmSegment() { ::munmap(base_, size_); }
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  Layout* layout() const { return reinterpret_cast<Layout*>(base_); }
  uint64_t ring_bytes() const { return (size_ - kDataOffset) / 2; }
  char* ring(int i) const { return base_ + kDataOffset + uint64_t(i) * ring_bytes(); }
  bool created_here() const { return created_here_; }

 private:
  char* base_;
  size_t size_;
  bool created_here_;
};

Status CreateShmSegment(size_t ring_bytes, std::string* name,
                        std::shared_ptr<ShmSegment>* out) {
  if (ring_bytes > kMaxRing) {
    return Status::InvalidArgument("shared-memory ring of " + std::to_string(ring_bytes) +
                         " bytes requested; at most " + std::to_string(kMaxRing) +
                         " are supported");
  }
  const uint64_t ring = std::max<uint64_t>(kMinRing, RoundUp(ring_bytes, kPage));
  const uint64_t total = kDataOffset + 2 * ring;

  std::string nm;
  void* base = nullptr;
  SMDDP_RETURN_IF_ERROR(
      CreateShmFile(total, "lower JAX_SMDDP_SHM_RING_BYTES", &nm, &base));

  Layout* lay = new (base) Layout();
  lay->header.magic = kMagic;
  lay->header.version = WireProtocolVersion();
  lay->header.data_offset = uint32_t(kDataOffset);
  lay->header.ring_bytes = ring;
  lay->header.total_bytes = total;
  lay->side[0].pid.store(int32_t(::getpid()), std::memory_order_release);

  *name = nm;
  *out = std::make_shared<ShmSegment>(base, total, /*created_here=*/true);
  return Status::Ok();
}

Status OpenShmSegment(const std::string& name, std::shared_ptr<ShmSegment>* out) {
  void* base = nullptr;
  size_t size = 0;
  SMDDP_RETURN_IF_ERROR(OpenShmFile(name, "segment", kDataOffset + 2 * kMinRing,
                                    kDataOffset + 2 * kMaxRing, &base, &size));
  auto segment = std::make_shared<ShmSegment>(base, size, /*created_here=*/false);

  SegmentHeader h;
  std::memcpy(&h, base, sizeof(h));
  if (h.magic != kMagic) {
    return Status::Error("shared-memory segment " + name + " is not a jax_smddp link");
  }
  if (h.version != WireProtocolVersion()) {
    return Status::Protocol("shared-memory segment " + name + " is of wire protocol version " +
                            std::to_string(h.version) + ", this process speaks " +
                            std::to_string(WireProtocolVersion()) +
                            " (processes from different jax_smddp builds)");
  }
  if (h.data_offset != kDataOffset || h.ring_bytes < kMinRing || h.ring_bytes > kMaxRing ||
      h.ring_bytes % kPage != 0 || h.total_bytes != kDataOffset + 2 * h.ring_bytes ||
      h.total_bytes != size) {
    return Status::Error("shared-memory segment " + name + " has an inconsistent header");
  }
  Layout* lay = segment->layout();
  int32_t expected = 0;
  if (!lay->side[1].pid.compare_exchange_strong(expected, int32_t(::getpid()),
                                                std::memory_order_acq_rel)) {
    return Status::Error("shared-memory segment " + name +
                         " is already in use by process " + std::to_string(expected));
  }
  *out = std::move(segment);
  return Status::Ok();
}

Status UnlinkShmSegment(const std::string& name) { return UnlinkShmFile(name); }

size_t SingleCopyMinBytes() {
  static const uint64_t bytes = uint64_t(IntSetting("JAX_SMDDP_SHM_SINGLE_COPY_BYTES"));
  return size_t(bytes);
}

size_t DefaultShmRingBytes() {
  return size_t(std::min<uint64_t>(uint64_t(IntSetting("JAX_SMDDP_SHM_RING_BYTES")), kMaxRing));
}

namespace {

class ShmLink final : public Link {
 public:
  ShmLink(std::shared_ptr<ShmSegment> segment, bool creator, int peer_pid)
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

  ~ShmLink() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      FailLocked("the shared-memory link was closed");
    }
    // After our last ring write: the peer drains what we wrote, then sees
    // the flag and reports an orderly exit.
    me_side_->closed.store(1, std::memory_order_release);
    Ring(peer_bell_);
  }

  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override {
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

  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) {
      req->Complete(Status::WithCode(failure_code_, Failure()));
      return;
    }
    for (size_t ui = 0; ui < unexpected_.size(); ++ui) {
      Unexpected* u = unexpected_[ui].get();
      if (u->tag != tag) continue;
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
                                         "under tag " + std::to_string(tag)));
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

  void Progress() override {
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
        // While we read, the peer may have freed room in our ring.
        if (!pending_.empty()) moved += WritePassLocked();
      }
      total += moved;
      if (moved == 0 || total >= 4 * cap_) break;
    }
    // Requests of this process's other threads may have completed.
    if (total > 0 && my_bell_->sleepers.load(std::memory_order_seq_cst) != 0) Ring(my_bell_);
  }

  uint32_t Activity() const override { return my_bell_->count.load(std::memory_order_seq_cst); }

  void AwaitActivity(uint32_t seen, unsigned max_us) override {
    my_bell_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    // The futex sleeps only while the count still equals `seen`: a ring
    // between the caller's last look and now returns at once.
    if (!failed_.load(std::memory_order_acquire)) FutexWait(&my_bell_->count, seen, max_us);
    my_bell_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }

  void Cancel(Request* req) override {
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
    for (Incoming& in : incoming_) {
      if (in.req == req) {
        in.req = nullptr;  // the rest of the message is discarded
        in.dst = nullptr;
        return;
      }
    }
  }

  std::string PeerFailure() override {
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

  StatusCode PeerFailureCode() override {
    std::lock_guard<std::mutex> lock(fail_mu_);
    return failure_code_;
  }

  std::string Kind() const override { return "shared memory"; }

  uint64_t SingleCopyBytes() const override {
    return single_copy_bytes_.load(std::memory_order_relaxed);
  }

  std::string SingleCopy() const override {
    std::lock_guard<std::mutex> lock(single_copy_mu_);
    return single_copy_off_.empty() ? "on" : "off: " + single_copy_off_;
  }

 private:
  struct PendingSend {
    uint64_t tag;
    const char* src;
    uint64_t bytes;
    uint64_t sent;
    Request* req;
    bool started = false;  // a chunk is in the ring
    bool abort = false;    // cancelled after it started: write an abort chunk
    bool remote = false;   // send a RemoteRef; the reader copies in place
    uint64_t control = 0;  // an Ack or Nack to write (no request, no data)
  };
  struct PostedRecv {
    uint64_t tag;
    char* dst;
    uint64_t bytes;
    Request* req;
  };
  struct Unexpected {
    uint64_t tag = 0;
    uint64_t total = 0;
    uint64_t received = 0;
    char* data = nullptr;
    bool complete = false;
    ~Unexpected() { std::free(data); }
  };
  // A message partly arrived. Its bytes go to `req`/`dst` (a posted
  // receive), `u` (the unexpected store) or, with neither, nowhere.
  struct Incoming {
    uint64_t tag;
    uint64_t total;
    uint64_t next;  // bytes arrived
    Request* req;
    char* dst;
    Unexpected* u;
  };

  std::string Failure() {
    std::lock_guard<std::mutex> lock(fail_mu_);
    return failure_;
  }

  std::string Corrupt(const std::string& what) const {
    return "shared-memory link to process " + std::to_string(peer_pid_.load()) +
           ": corrupt data from the peer (" + what + ")";
  }

  // The peer wrote what this process cannot parse: the link fails with a
  // protocol error naming it.
  void FailCorruptLocked(const std::string& what) { FailLocked(Corrupt(what), StatusCode::kProtocol); }

  static std::string MismatchMessage(uint64_t sent, uint64_t tag, uint64_t expected) {
    return "peer sent " + std::to_string(sent) + " bytes under tag " +
           std::to_string(tag) + ", expected " + std::to_string(expected);
  }

  // Fails every request; the link does nothing more. kPeerFailed: the link
  // is gone with its peer; kProtocol: the peer wrote what cannot be parsed.
  void FailLocked(std::string reason, StatusCode code = StatusCode::kPeerFailed) {
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
    for (Incoming& in : incoming_) {
      if (in.req != nullptr) in.req->Complete(st);
    }
    pending_.clear();
    posted_.clear();
    incoming_.clear();
    unexpected_.clear();
  }

  // Free bytes in the write ring, from the peer's read position. False (the
  // link failed) if that position is impossible.
  bool WriteSpaceLocked(uint64_t* free_bytes) {
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

  void WriteChunkLocked(uint64_t tag, uint64_t total, uint64_t offset, uint64_t len,
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
  bool EligibleLocked(size_t i) const {
    if (pending_[i].control != 0) return true;
    for (size_t j = 0; j < i; ++j) {
      if (pending_[j].control == 0 && pending_[j].tag == pending_[i].tag) return false;
    }
    return true;
  }

  // Writes chunks of pending sends, one per send in turn, while they fit.
  // Returns the ring bytes written.
  uint64_t WritePassLocked() {
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

  void CopyFromRing(char* dst, uint64_t at, uint64_t len) const {
    const uint64_t first = std::min(len, cap_ - at);
    if (first > 0) std::memcpy(dst, read_ring_ + at, first);
    if (len > first) std::memcpy(dst + first, read_ring_, len - first);
  }

  // Reads every chunk that has arrived. Returns the ring bytes consumed.
  uint64_t ReadPassLocked() {
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
      const bool bad_flags = (h.flags & ~(kControlFlags | kFlagRemote)) != 0 ||
                             (kind & (kind - 1)) != 0;  // at most one
      const bool bad_payload =
          (kind & kControlFlags) != 0 ? h.len != 0 || h.offset != 0
          : kind == kFlagRemote       ? h.len != sizeof(RemoteRef) || h.offset != 0
                                      : h.offset > h.total || h.len > h.total - h.offset;
      if (bad_flags || bad_payload || h.len > cap_ - kLine ||
          kLine + RoundUp(h.len, kLine) > avail) {
        FailCorruptLocked("chunk tag " + std::to_string(h.tag) + " size " +
                           std::to_string(h.total) + " offset " +
                           std::to_string(h.offset) + " length " + std::to_string(h.len) +
                           " flags " + std::to_string(h.flags) + " with " +
                           std::to_string(avail) + " bytes in the ring");
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
  bool DeliverLocked(const ChunkHeader& h, uint64_t at) {
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
      if (idx == incoming_.size()) return true;  // nothing of it arrived
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
        FailCorruptLocked("chunk at offset " + std::to_string(h.offset) +
                           " of a message under tag " + std::to_string(h.tag) +
                           " that had not started");
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
        std::unique_ptr<Unexpected> u(new (std::nothrow) Unexpected());
        if (u == nullptr) {
          FailLocked("shared-memory link: out of memory");
          return false;
        }
        u->tag = h.tag;
        u->total = h.total;
        if (h.total > 0) {
          u->data = static_cast<char*>(std::malloc(h.total));
          if (u->data == nullptr) {
            FailLocked("shared-memory link: cannot allocate " + std::to_string(h.total) +
                       " bytes for the early-arrived message under tag " +
                       std::to_string(h.tag));
            return false;
          }
        }
        in.u = u.get();
        try {
          unexpected_.push_back(std::move(u));
        } catch (...) {
          FailLocked("shared-memory link: out of memory");
          return false;
        }
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

  // Queues an Ack or Nack for message `tag` of the peer, ahead of data.
  // `req` (a receive) completes once the Ack is in the ring: a process never
  // leaves a call with the peer still waiting for its Ack.
  void QueueControlLocked(uint64_t tag, uint64_t flag, uint64_t value, Request* req = nullptr) {
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
  bool AttachToAckLocked(uint64_t tag, Request* req) {
    for (PendingSend& c : pending_) {
      if (c.control == kFlagAck && c.tag == tag && c.req == nullptr) {
        c.req = req;
        WritePassLocked();
        return true;
      }
    }
    return false;
  }

  void SetSingleCopyOff(const std::string& why) {
    std::lock_guard<std::mutex> lock(single_copy_mu_);
    if (single_copy_off_.empty()) single_copy_off_ = why;
  }

  // Under Yama's ptrace_scope 1 (Ubuntu's default) only an ancestor may read
  // a process's memory; this lets the job's other processes (same user) do
  // it, as without Yama. Elsewhere a no-op.
  static void AllowPeersToRead() {
    static std::once_flag once;
    std::call_once(once, [] { ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); });
  }

  int PeerPidLocked() {
    int pid = peer_pid_.load(std::memory_order_relaxed);
    return pid > 0 ? pid : peer_side_->pid.load(std::memory_order_acquire);
  }

  // A RemoteRef chunk: the message is copied from the peer's memory now,
  // straight into its receive's buffer if one is posted, else into the
  // unexpected store (so that sends complete without a posted receive, as
  // through the ring), then acknowledged. If the kernel refuses (ptrace
  // rules), the receive stays posted, a Nack asks the peer to send the message
  // through the ring, and the link says why single copy is off.
  bool DeliverRemoteLocked(const ChunkHeader& h, uint64_t at) {
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
      SetSingleCopyOff("this process may not read " + peer + "'s memory (process_vm_readv: " +
                       std::strerror(err) + "; ptrace rules: Yama's ptrace_scope, a "
                       "container without CAP_SYS_PTRACE or with a seccomp filter, another "
                       "user, or a process that is not dumpable); messages go through the ring "
                       "(two copies)");
      QueueControlLocked(h.tag, kFlagNack, uint64_t(err));
      return !failed_.load(std::memory_order_relaxed);
    }
    Status st = Status::Ok();
    if (cancelled) {
      st = Status::PeerFailed(peer + " cancelled the message under tag " +
                              std::to_string(h.tag) + " while it was being read");
    } else if (err == ESRCH) {
      st = Status::PeerFailed(peer + " exited while this process read a message from its "
                              "memory");
    } else if (err != 0) {
      FailCorruptLocked("reading " + std::to_string(h.total) + " bytes at " +
                         std::to_string(ref.address) + " of its memory failed: " +
                         std::strerror(err));
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
  int ReadRemote(int pid, const RemoteRef& ref, char* dst, uint64_t bytes, bool* cancelled) {
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
  bool AnswerLocked(const ChunkHeader& h) {
    for (size_t i = 0; i < awaiting_.size(); ++i) {
      if (awaiting_[i].tag != h.tag) continue;
      PendingSend s = awaiting_[i];
      awaiting_.erase(awaiting_.begin() + ptrdiff_t(i));
      if ((h.flags & kFlagAck) != 0) {
        s.req->Complete(Status::Ok());
        return true;
      }
      single_copy_refused_.store(true, std::memory_order_relaxed);
      SetSingleCopyOff("process " + std::to_string(PeerPidLocked()) +
                       " may not read this process's memory (process_vm_readv: " +
                       std::strerror(int(h.total)) + "); messages go through the ring (two "
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

  void DropUnexpectedLocked(const Unexpected* u) {
    for (size_t i = 0; i < unexpected_.size(); ++i) {
      if (unexpected_[i].get() == u) {
        unexpected_.erase(unexpected_.begin() + ptrdiff_t(i));
        return;
      }
    }
  }

  std::shared_ptr<ShmSegment> segment_;
  SideState* me_side_;
  SideState* peer_side_;
  char* write_ring_;
  char* read_ring_;
  std::atomic<uint64_t>* write_head_;
  std::atomic<uint64_t>* write_tail_;
  std::atomic<uint64_t>* read_head_;
  std::atomic<uint64_t>* read_tail_;
  std::atomic<uint64_t>* my_cancels_;
  std::atomic<uint64_t>* peer_cancels_;
  Doorbell* my_bell_;    // woken when the peer wrote, made room or this side completed requests
  Doorbell* peer_bell_;
  uint64_t single_copy_min_ = 0;  // messages this long or longer are read in place
  std::atomic<bool> single_copy_refused_{false};  // the peer may not read our memory
  std::atomic<uint64_t> single_copy_bytes_{0};
  mutable std::mutex single_copy_mu_;
  std::string single_copy_off_;  // why single copy is off; empty while on
  uint64_t cap_;
  uint64_t max_chunk_;
  uint64_t min_partial_;

  std::mutex progress_mu_;  // try-locked by Progress: one progresses at a time
  std::mutex mu_;           // everything below, and all ring access
  uint64_t write_head_local_ = 0;  // ours; never read back from shared memory
  uint64_t seen_tail_ = 0;
  uint64_t read_tail_local_ = 0;
  std::vector<PendingSend> pending_;  // in posting order
  std::vector<PendingSend> awaiting_;  // RemoteRefs sent, the peer's answer not yet in
  std::vector<PostedRecv> posted_;    // in posting order
  std::vector<Incoming> incoming_;
  std::vector<std::unique_ptr<Unexpected>> unexpected_;  // in arrival order

  std::atomic<bool> failed_{false};
  std::mutex fail_mu_;
  std::string failure_;
  StatusCode failure_code_ = StatusCode::kPeerFailed;

  std::mutex live_mu_;  // the liveness check below
  std::atomic<int> peer_pid_{0};  // <= 0 until known
  uint64_t peer_start_ = 0;
  std::chrono::steady_clock::time_point next_check_{};
};

}  // namespace

std::unique_ptr<Link> MakeShmLink(std::shared_ptr<ShmSegment> segment, bool creator,
                                  int peer_pid) {
  return std::make_unique<ShmLink>(std::move(segment), creator, peer_pid);
}

}  // namespace smddp
