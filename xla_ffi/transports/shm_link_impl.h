// What the files of the shared-memory link (shm_link.h) share, private to
// xla_ffi/transports/shm_*.cc: the segment's layout and its doorbells
// (shm_segment.cc), the chunk format, and the ShmLink class, whose methods
// are defined by concept: the Link adapter and its failure (shm_link.cc), the
// ring protocol (shm_ring.cc), single copy (shm_single_copy.cc).
#ifndef JAX_SMDDP_TRANSPORTS_SHM_LINK_IMPL_H_
#define JAX_SMDDP_TRANSPORTS_SHM_LINK_IMPL_H_

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"
#include "xla_ffi/transports/shm_link.h"

namespace smddp {
namespace shm {

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
  Counter cancels[2];  // 448, 512
  // Side i's doorbell: the peer (or another thread of side i) adds to `count`
  // after writing to side i's ring, freeing room in side i's ring or
  // completing side i's requests, and wakes side i's `sleepers` (a futex on
  // `count`): a waiter sleeps until something happened instead of polling.
  Doorbell bell[2];  // 576, 640
};
static_assert(sizeof(Layout) <= kDataOffset, "control data must fit one page");

// A chunk: this header, then `len` payload bytes, padded to 64.
constexpr uint64_t kFlagAbort = 1;  // the sender cancelled message `tag`
// Single copy: the payload is a RemoteRef, and the reader copies the
// message's `total` bytes straight from the writer's memory
// (process_vm_readv), then answers with an Ack (the writer's buffer is free)
// or, if it may not read there, a Nack (total = its errno) after which the
// writer sends the message again through the ring.
constexpr uint64_t kFlagRemote = 2;
constexpr uint64_t kFlagAck = 4;
constexpr uint64_t kFlagNack = 8;
constexpr uint64_t kControlFlags = kFlagAbort | kFlagAck | kFlagNack;  // header only
// Messages to be read in place that arrive before their receive: from this
// size they wait, unread, for the receive, for up to kUnclaimedReadAfter,
// before the reader copies them into its unexpected store
// (ReadInPlaceMessagesLocked). Below it they are copied there at once:
// at 64-256 KiB on a 2-core VM, waiting for the receive cost each call about
// 50 us more than the second copy (docs/cpu_floor.md).
constexpr uint64_t kWaitForReceiveBytes = 512 << 10;
constexpr std::chrono::milliseconds kUnclaimedReadAfter{2};
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
  uint64_t check;  // ChunkCheck() of the fields above
  uint64_t reserved[2];
};
static_assert(sizeof(ChunkHeader) == kLine, "chunk header is one cache line");

inline uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

inline uint64_t ChunkCheck(const ChunkHeader& h) {
  uint64_t x = kMagic;
  x = Mix(x ^ h.tag);
  x = Mix(x ^ h.total);
  x = Mix(x ^ h.offset);
  x = Mix(x ^ h.len);
  x = Mix(x ^ h.flags);
  return x;
}

inline uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// Futexes on the shared segment (not FUTEX_PRIVATE_FLAG: two processes).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, unsigned max_us);
void FutexWakeAll(std::atomic<uint32_t>* word);

// Tells the side that owns `bell` that something happened, waking it if it
// sleeps. Cheap when nobody sleeps: one atomic add and one load.
void Ring(Doorbell* bell);

}  // namespace shm

class ShmSegment {
 public:
  ShmSegment(void* base, size_t size, bool created_here)
      : base_(static_cast<char*>(base)), size_(size), created_here_(created_here) {}
  ~ShmSegment() { ::munmap(base_, size_); }
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  shm::Layout* layout() const { return reinterpret_cast<shm::Layout*>(base_); }
  uint64_t ring_bytes() const { return (size_ - shm::kDataOffset) / 2; }
  char* ring(int i) const { return base_ + shm::kDataOffset + uint64_t(i) * ring_bytes(); }
  bool created_here() const { return created_here_; }

 private:
  char* base_;
  size_t size_;
  bool created_here_;
};

namespace shm {

class ShmLink final : public Link {
 public:
  ShmLink(std::shared_ptr<ShmSegment> segment, bool creator, int peer_pid);
  ~ShmLink() override;
  void Send(uint64_t tag, const void* src, size_t bytes, Request* req) override;
  void Recv(uint64_t tag, void* dst, size_t bytes, Request* req) override;
  void Progress() override;
  uint32_t Activity() const override;
  void AwaitActivity(uint32_t seen, unsigned max_us) override;
  void Cancel(Request* req) override;
  std::string PeerFailure() override;
  StatusCode PeerFailureCode() override;
  std::string Kind() const override;
  uint64_t SingleCopyBytes() const override;
  std::string SingleCopy() const override;

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
    // A message to be read in place, still in the writer's memory at `ref`
    // (no data here), arrived at `since`; `claim`: the receive it is to be
    // read into by the next Progress (none: it waits for one).
    bool in_place = false;
    RemoteRef ref{};
    std::chrono::steady_clock::time_point since{};
    Request* claim = nullptr;
    char* claim_dst = nullptr;
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

  // The link itself and its failure (shm_link.cc).
  std::string Failure();
  std::string Corrupt(const std::string& what) const;
  void FailCorruptLocked(const std::string& what);
  static std::string MismatchMessage(uint64_t sent, uint64_t tag, uint64_t expected);
  void FailLocked(std::string reason, StatusCode code = StatusCode::kPeerFailed);

  // The ring protocol (shm_ring.cc): chunks written and read, delivered to
  // receives or to the unexpected store.
  bool WriteSpaceLocked(uint64_t* free_bytes);
  void WriteChunkLocked(uint64_t tag, uint64_t total, uint64_t offset, uint64_t len, uint64_t flags,
                        const char* src);
  bool EligibleLocked(size_t i) const;
  uint64_t WritePassLocked();
  void CopyFromRing(char* dst, uint64_t at, uint64_t len) const;
  uint64_t ReadPassLocked();
  bool DeliverLocked(const ChunkHeader& h, uint64_t at);
  // A new entry at the end of the unexpected store, with room for the
  // message's bytes when `with_data`; null if memory ran out (the link failed).
  Unexpected* StoreUnexpectedLocked(uint64_t tag, uint64_t total, bool with_data);
  // Room for `u`'s bytes; false if memory ran out (the link failed).
  bool AllocateUnexpectedLocked(Unexpected* u);
  void DropUnexpectedLocked(const Unexpected* u);

  // Single copy (shm_single_copy.cc): messages read in place from the
  // writer's memory, and their Acks and Nacks.
  void QueueControlLocked(uint64_t tag, uint64_t flag, uint64_t value, Request* req = nullptr);
  bool AttachToAckLocked(uint64_t tag, Request* req);
  void SetSingleCopyOff(const std::string& why);
  static void AllowPeersToRead();
  int PeerPidLocked();
  bool DeliverRemoteLocked(const ChunkHeader& h, uint64_t at);
  enum class InPlace { kRead, kFailed, kRefused, kLinkFailed };
  InPlace ReadInPlaceLocked(uint64_t tag, uint64_t total, const RemoteRef& ref, char* dst,
                            Request* req);
  void RejectInPlaceLocked(uint64_t tag, uint64_t sent, uint64_t expected, Request* req);
  bool ReadInPlaceMessagesLocked();
  int ReadRemote(int pid, const RemoteRef& ref, char* dst, uint64_t bytes, bool* cancelled);
  bool AnswerLocked(const ChunkHeader& h);

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
  Doorbell* my_bell_;  // woken when the peer wrote, made room or this side completed requests
  Doorbell* peer_bell_;
  uint64_t single_copy_min_ = 0;                  // messages this long or longer are read in place
  std::atomic<bool> single_copy_refused_{false};  // the peer may not read our memory
  std::atomic<uint64_t> single_copy_bytes_{0};
  mutable std::mutex single_copy_mu_;
  std::string single_copy_off_;  // why single copy is off; empty while on
  uint64_t cap_;
  uint64_t max_chunk_;
  uint64_t min_partial_;

  std::mutex progress_mu_;         // try-locked by Progress: one progresses at a time
  std::mutex mu_;                  // everything below, and all ring access
  uint64_t write_head_local_ = 0;  // ours; never read back from shared memory
  uint64_t seen_tail_ = 0;
  uint64_t read_tail_local_ = 0;
  std::vector<PendingSend> pending_;   // in posting order
  std::vector<PendingSend> awaiting_;  // RemoteRefs sent, the peer's answer not yet in
  std::vector<PostedRecv> posted_;     // in posting order
  std::vector<Incoming> incoming_;
  std::vector<std::unique_ptr<Unexpected>> unexpected_;  // in arrival order

  std::atomic<bool> failed_{false};
  std::mutex fail_mu_;
  std::string failure_;
  StatusCode failure_code_ = StatusCode::kPeerFailed;

  std::mutex live_mu_;            // the liveness check below
  std::atomic<int> peer_pid_{0};  // <= 0 until known
  uint64_t peer_start_ = 0;
  std::chrono::steady_clock::time_point next_check_{};
};

}  // namespace shm
}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_SHM_LINK_IMPL_H_
