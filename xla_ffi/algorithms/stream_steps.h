// What the stream-ordered bodies share, private to xla_ffi/algorithms/: the
// tiling of a call into steps, the step protocol of one rank (Steps,
// stream_algorithms.h), and the staged (stream_staged.cc) and direct-read
// (stream_direct.cc) bodies that RunStreamPlan (stream_algorithms.cc) picks
// from. The hierarchical bodies are in stream_hierarchical.cc.
#ifndef JAX_SMDDP_ALGORITHMS_STREAM_STEPS_H_
#define JAX_SMDDP_ALGORITHMS_STREAM_STEPS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "xla_ffi/algorithms/stream_algorithms.h"

namespace smddp {

// A tile of a [rows x inner] byte matrix: what one step moves per rank.
struct Tile {
  size_t row, rows;   // rows of the outer dimension
  size_t col, width;  // bytes within a row
};

// Splits [outer x inner bytes] into tiles whose `fanout` copies fit in `cap`
// bytes (whole rows when a row fits, else pieces of one row, `align`ed).
template <typename F>
Status ForEachTile(size_t outer, size_t inner, size_t fanout, size_t cap, size_t align, F&& f) {
  if (outer == 0 || inner == 0) return Status::Ok();
  if (fanout * inner <= cap) {
    const size_t per = cap / (fanout * inner);
    for (size_t r = 0; r < outer; r += per) {
      SMDDP_RETURN_IF_ERROR(f(Tile{r, std::min(per, outer - r), 0, inner}));
    }
    return Status::Ok();
  }
  const size_t w = cap / fanout / align * align;
  if (w == 0) return Status::Error("jax_smddp: staging slot too small for one element per rank");
  for (size_t r = 0; r < outer; ++r) {
    for (size_t c = 0; c < inner; c += w) {
      SMDDP_RETURN_IF_ERROR(f(Tile{r, 1, c, std::min(w, inner - c)}));
    }
  }
  return Status::Ok();
}

inline const void** SourcesOf(StreamRank& me, size_t n) {
  if (me.sources.size() < n) me.sources.resize(n);  // once per rank and size
  return me.sources.data();
}

// The step protocol of stream_algorithms.h for one rank; `replayable`: a
// call that may be replayed as captured, by tokens and steps of its own.
class Steps {
 public:
  Steps(StreamRank& me, StreamOps& ops, bool replayable = false)
      : me_(me), ops_(ops), layout_(me.layout), replayable_(replayable) {}

  int size() const { return layout_.size; }
  int rank() const { return me_.rank; }
  uint32_t step() const { return step_; }
  StreamRank& me() { return me_; }
  size_t cap() const { return layout_.slot_bytes; }
  // Room for `n` reduction sources, kept by the rank across calls.
  const void** Sources(size_t n) { return SourcesOf(me_, n); }

  // Starts the next step; its slot is free once every peer consumed the step
  // that last used it.
  Status Begin(uint8_t** slot) {
    // The group's step counter (the watchdog reads it), or the call's own.
    step_ = replayable_ ? step_ + 1 : __atomic_add_fetch(&me_.step, 1, __ATOMIC_RELAXED);
    ++begun_;
    if (replayable_ && step_ > uint32_t(RegionLayout::kSlots)) {
      SMDDP_RETURN_IF_ERROR(TakeBack(SlotIndex()));
    } else if (step_ > uint32_t(RegionLayout::kSlots)) {
      for (int q = 0; q < size(); ++q) {
        if (q == rank()) continue;
        SMDDP_RETURN_IF_ERROR(ops_.WaitAtLeast(Consumed(rank(), q), step_ - RegionLayout::kSlots));
      }
    }
    *slot = Slot(rank());
    return Status::Ok();
  }
  Status Post() {
    if (!replayable_) return ops_.Write(Posted(rank()), step_);
    for (int q = 0; q < size(); ++q) {
      if (q != rank()) SMDDP_RETURN_IF_ERROR(ops_.Write(PostedToken(q, SlotIndex(), rank()), 1));
    }
    return Status::Ok();
  }
  // Waits until peer q posted this step; returns its slot. (On `on`: this
  // call's ops or one of its lanes, StreamOps::Lane.)
  Status Await(int q, const uint8_t** slot) { return Await(q, slot, ops_); }
  Status Await(int q, const uint8_t** slot, StreamOps& on) {
    *slot = Slot(q);
    if (q == rank()) return Status::Ok();
    if (!replayable_) return on.WaitAtLeast(Posted(q), step_);
    uint32_t* token = PostedToken(rank(), SlotIndex(), q);
    SMDDP_RETURN_IF_ERROR(on.WaitAtLeast(token, 1));
    return on.Write(token, 0);  // q posts this slot again only after our Release
  }
  Status Release(int q) { return Release(q, ops_); }
  Status Release(int q, StreamOps& on) {
    if (q == rank()) return Status::Ok();
    return replayable_ ? on.Write(ConsumedToken(q, SlotIndex(), rank()), 1)
                       : on.Write(Consumed(q, rank()), step_);
  }
  // Lanes for reading `peers` peers' slots at once (StreamOps::Fork), or
  // none: a replayable call stays on its one stream (a CUDA graph captures
  // it as it was enqueued).
  Status ForkPeers(int peers) { return replayable_ ? Status::Ok() : ops_.Fork(peers); }
  StreamOps& PeerLane(int k) { return replayable_ ? ops_ : ops_.Lane(k); }
  Status JoinPeers() { return replayable_ ? Status::Ok() : ops_.Join(); }
  // After a staged call (replayable, or StreamRank::drain_each_call): later
  // work on this stream waits until every peer consumed this call's steps,
  // so its slots are free for whatever call comes next.
  Status Finish() {
    if (begun_ == 0) return Status::Ok();
    if (!replayable_) return AwaitConsumed();
    const int used = int(std::min<uint32_t>(begun_, RegionLayout::kSlots));
    for (int k = 0; k < used; ++k)
      SMDDP_RETURN_IF_ERROR(TakeBack(int((step_ - uint32_t(k)) % RegionLayout::kSlots)));
    return Status::Ok();
  }

  // Direct reads: the whole call is one step that uses no slot.
  void BeginDirect() { step_ = __atomic_add_fetch(&me_.step, 1, __ATOMIC_RELAXED); }
  // On `on`: this call's ops, or one of its lanes (StreamOps::Lane).
  Status AwaitPosted(int q) { return AwaitPosted(q, ops_); }
  Status AwaitPosted(int q, StreamOps& on) {
    return q == rank() ? Status::Ok() : on.WaitAtLeast(Posted(q), step_);
  }
  Status ReleaseDirect(int q, StreamOps& on) { return Release(q, on); }
  // Later work on this stream waits until every peer consumed this step.
  Status AwaitConsumed() {
    return Batched(
        [&](int q) { return Consumed(rank(), q); },
        [&](const uint32_t* const* f, int n) { return ops_.WaitAllAtLeast(f, n, step_); });
  }
  // Direct reads: waits until every peer posted this step (its buffers are
  // ready), and tells every peer this rank is done with them.
  Status AwaitAllPosted() {
    return Batched(
        [&](int q) { return Posted(q); },
        [&](const uint32_t* const* f, int n) { return ops_.WaitAllAtLeast(f, n, step_); });
  }
  Status ReleaseAll() {
    return Batched([&](int q) { return Consumed(q, rank()); },
                   [&](uint32_t* const* f, int n) { return ops_.WriteAll(f, n, step_); });
  }

 private:
  // `act` on the flags `flag(q)` of every peer q, in batches (StreamOps'
  // WaitAllAtLeast and WriteAll).
  template <typename Flag, typename Act>
  Status Batched(Flag&& flag, Act&& act) {
    constexpr int kAtOnce = 32;
    using Pointer = decltype(flag(0));
    Pointer flags[kAtOnce];
    int n = 0;
    for (int q = 0; q < size(); ++q) {
      if (q == rank()) continue;
      flags[n++] = flag(q);
      if (n == kAtOnce) {
        SMDDP_RETURN_IF_ERROR(act(flags, n));
        n = 0;
      }
    }
    return n ? act(flags, n) : Status::Ok();
  }
  int SlotIndex() const { return int(step_ % RegionLayout::kSlots); }
  uint8_t* Slot(int q) const { return me_.regions[q] + layout_.slot_offset(SlotIndex()); }
  // Replayable: waits until every peer consumed this rank's `slot`, and
  // clears their tokens for its next use.
  Status TakeBack(int slot) {
    for (int q = 0; q < size(); ++q) {
      if (q == rank()) continue;
      uint32_t* token = ConsumedToken(rank(), slot, q);
      SMDDP_RETURN_IF_ERROR(ops_.WaitAtLeast(token, 1));
      SMDDP_RETURN_IF_ERROR(ops_.Write(token, 0));
    }
    return Status::Ok();
  }
  // In `owner`'s flags: `writer` posted `slot`; `reader` consumed owner's `slot`.
  uint32_t* PostedToken(int owner, int slot, int writer) const {
    return reinterpret_cast<uint32_t*>(Flags(owner) + layout_.posted_token_offset(slot, writer));
  }
  uint32_t* ConsumedToken(int owner, int slot, int reader) const {
    return reinterpret_cast<uint32_t*>(Flags(owner) + layout_.consumed_token_offset(slot, reader));
  }
  uint8_t* Flags(int q) const { return me_.flags.empty() ? me_.regions[q] : me_.flags[q]; }
  uint32_t* Posted(int q) const {
    return reinterpret_cast<uint32_t*>(Flags(q) + layout_.posted_offset());
  }
  uint32_t* Consumed(int owner, int reader) const {
    return reinterpret_cast<uint32_t*>(Flags(owner) + layout_.consumed_offset(reader));
  }

  StreamRank& me_;
  StreamOps& ops_;
  const RegionLayout& layout_;
  const bool replayable_;
  uint32_t step_ = 0;   // the current step: the group's, or the call's own when replayable
  uint32_t begun_ = 0;  // steps this call began
};

// all_reduce's balanced shards: shard q is elements [q L, (q + 1) L) clipped
// to `count`. How many of them lie in [q L + j, q L + j + w).
inline size_t ShardElements(size_t count, size_t L, int q, size_t j, size_t w) {
  const size_t begin = std::min(count, q * L + j);
  const size_t end = std::min({count, q * L + j + w, (q + 1) * L});
  return end > begin ? end - begin : 0;
}

// The staged bodies (stream_staged.cc): every byte through the slots.

// recv[o, p, :] = send_p[o, :]
Status StagedAllGather(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                       size_t inner);

// recv[o, p, :] = send_p[o, rank, :]
Status StagedAllToAll(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                      size_t inner);

// recv[o, :] = reduce_p send_p[o, rank, :]; inner in elements.
Status StagedReduceScatter(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                           size_t outer, size_t inner, DType dtype, ReduceOp op);

// recv = reduce_p send_p, balanced: rank r reduces shard r from every peer's
// slot, then every rank copies each reduced shard from its owner's slot.
Status StagedAllReduce(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t count,
                       DType dtype, ReduceOp op);

// The direct-read bodies (stream_direct.cc; stream_algorithms.h): `in[q]`
// is rank q's input.

// recv[o, p, :] = in_p[o, :] (all_gather) or in_p[o, rank, :] (all_to_all).
Status DirectAllGatherOrAllToAll(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                                 uint8_t* recv, size_t outer, size_t inner, bool all_to_all);

// recv[o, :] = reduce_p in_p[o, rank, :]; inner in elements.
Status DirectReduceScatter(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                           uint8_t* recv, size_t outer, size_t inner, DType dtype, ReduceOp op);

// recv = reduce_p in_p in one step: rank r reduces shard r of every input
// into every rank's output (out[q]).
Status DirectAllReduce(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                       const std::vector<uint8_t*>& out, size_t count, DType dtype, ReduceOp op);

// The same by the device exchange (stream_direct.cc; stream_algorithms.h:
// DeviceExchange): the peers' buffers resolved on the device.
Status DeviceAllGatherOrAllToAll(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                                 size_t outer, size_t inner, bool all_to_all);
Status DeviceReduceScatter(Steps& st, StreamOps& ops, uint8_t* recv, size_t outer, size_t inner,
                           DType dtype, ReduceOp op);
Status DeviceAllReduce(Steps& st, StreamOps& ops, size_t count, DType dtype, ReduceOp op);
Status DeviceCollectivePermute(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                               size_t bytes, int64_t source);
// The device exchange's parts: writes this rank's entry for this step, then
// posts; where rank q's buffer `which` of this call is resolved to (this
// rank's resolved words); resolves it there on `on`.
Status DevicePost(Steps& st, StreamOps& ops);
uint64_t* DeviceResolved(Steps& st, int q, int which);
Status DeviceResolve(Steps& st, StreamOps& on, int q, int which);

// collective_permute (stream_permute.cc): recv = the input of rank `source`
// (zeros where it is -1), `bytes` of it; every rank runs the call's steps.
// Direct: `in[q]` is rank q's input. Staged: `sends` says whether some other
// rank's source is this one (its step slots then carry its input).
Status DirectCollectivePermute(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                               uint8_t* recv, size_t bytes, int64_t source);
Status StagedCollectivePermute(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                               size_t bytes, int64_t source, bool sends);

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_STREAM_STEPS_H_
