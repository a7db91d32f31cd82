// The messages of one cross-process call: tagged sends and receives posted on
// the links to peer processes, split into chunks so that work on what has
// arrived overlaps with what is still in flight, and waited for with the
// call's deadline while watching the peers: a peer that dies or stalls fails
// the call on every process, naming it, instead of hanging.
#ifndef JAX_SMDDP_ALGORITHMS_MESSAGES_H_
#define JAX_SMDDP_ALGORITHMS_MESSAGES_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "xla_ffi/algorithms/process_call.h"
#include "xla_ffi/algorithms/wait_polls.h"
#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

// Default bytes per chunk (JAX_SMDDP_CHUNK_BYTES, or its declared default); a call may
// choose its own (ProcessCall::chunk_bytes).
size_t ChunkBytes();

class Messages {
 public:
  // Posted chunks [first, first + count) of one message.
  struct Range {
    size_t first = 0, count = 0;
  };

  explicit Messages(const ProcessCall& call);
  // Withdraws whatever is still in flight: no link touches the call's
  // buffers after this (the call's error path).
  ~Messages();

  // Posts message `msg` (an id unique within the call) to or from `process`
  // as chunks of the call's chunk size; a zero-byte message posts nothing.
  Range Send(int process, uint64_t msg, const void* src, size_t bytes);
  Range Recv(int process, uint64_t msg, void* dst, size_t bytes);
  // Posts only chunk `i` of message `msg`, a `total`-byte message whose bytes
  // start at `base` (to send each chunk as soon as it is computed).
  void SendChunk(int process, uint64_t msg, size_t total, size_t i, const void* base);

  // Holds back messages `msgs` ({id, bytes}, in order) to `process`: the
  // j-th of their S chunks, once Send or SendChunk hands it over, goes out
  // only when transfer after[j * G / S] of the G `after` is done (released
  // as the links progress; WaitAll releases the rest). Direct ones are
  // announced now. For staggered rounds between hosts (Routes::stagger_to).
  void Hold(int process, const std::vector<std::pair<uint64_t, size_t>>& msgs,
            const std::vector<size_t>& after);

  // Announces message `msg` of `total` bytes to `process`, whose chunks are
  // sent later, each by SendChunk as it is computed: where the link has a
  // handshake to do (libfabric's direct transfers), it happens now, at the
  // call's start, not behind the bytes already on the wire when the chunk is
  // ready. SendChunk then hands over the bytes of an announced chunk.
  void Announce(int process, uint64_t msg, size_t total);

  // How many chunks a `total`-byte message has.
  size_t Chunks(size_t total) const { return (total + chunk_ - 1) / chunk_; }

  // Byte range [offset, offset + bytes) of chunk `i` of a `total`-byte message.
  void Chunk(size_t total, size_t i, size_t* offset, size_t* bytes) const;

  // Waits until transfer `id` is done, progressing every link of the call
  // (and checking the call's watch, if any, as often as the peers).
  Status Wait(size_t id);
  // Whether transfer `id` is done and succeeded, without waiting.
  bool Succeeded(size_t id) const {
    return entries_[id].req.done() && entries_[id].req.status().ok();
  }
  Status WaitRange(const Range& r);
  Status WaitAll();
  // Progresses the links, never sleeping, until every posted transfer is
  // done (true; failures included, for WaitAll to report) or `until` passed.
  bool PollAll(Clock::time_point until) { return PollRange({0, entries_.size()}, until); }
  // The same for the transfers of `r` only.
  bool PollRange(const Range& r, Clock::time_point until);

 private:
  struct Entry {
    Request req;
    int process;
    Link* link;
    bool recv;
    bool settled = false;  // done, or cancelled
  };
  size_t Post(int process, uint64_t tag, const void* src, void* dst, size_t bytes, bool recv);
  // A new entry for a transfer to or from `process` over `link`.
  Entry& NewEntry(int process, Link* link, bool recv);
  // Sends chunk `tag` of `n` bytes from `src`: announced, held or posted now.
  void Out(int process, uint64_t tag, const char* src, size_t n);
  // Hands an announced chunk's bytes over, or posts it.
  void Hand(int process, uint64_t tag, const char* src, size_t n);
  // Sends the held chunks whose gate is done.
  void Release();
  static constexpr size_t kNone = ~size_t(0);
  // The index in announced_ of chunk `tag` to `process`, or kNone.
  size_t FindAnnounced(int process, uint64_t tag) const;
  void ProgressAll();
  Status CheckPeers();
  // The failure of the link to `process` (`why`: its PeerFailure()), in the
  // call's words.
  Status PeerFailed(int process, Link& link, const std::string& why) const;

  const ProcessCall& call_;
  size_t chunk_;              // bytes per chunk
  WaitPolls polls_;           // how long a wait polls, yields, then sleeps
  std::vector<Link*> links_;  // for progress: one per progress key of the peers
  // links_ is one link whose descriptor every arrival signals: waits sleep long on it.
  bool one_descriptor_ = false;
  std::deque<Entry> entries_;
  // Announced chunks not yet handed over by SendChunk: tens per call at most
  // (found by a scan).
  struct Announced {
    int process;
    uint64_t tag;
    size_t entry;
  };
  std::vector<Announced> announced_;
  // Held messages' chunks not yet handed over: the transfer each waits for.
  struct Gate {
    int process;
    uint64_t tag;
    size_t after;
  };
  std::vector<Gate> gates_;
  // Chunks handed over whose transfer `after` is not yet done.
  struct Held {
    size_t after;
    int process;
    uint64_t tag;
    const char* src;
    size_t bytes;
  };
  std::vector<Held> held_;
  Clock::time_point next_check_;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_MESSAGES_H_
