#include "xla_ffi/algorithms/process_algorithms.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <variant>
#include <vector>

#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/algorithms/process_agreement.h"
#include "xla_ffi/algorithms/process_staging.h"
#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/common/streaming_copy.h"  // CopyBytes
#include "xla_ffi/common/timeout.h"

namespace smddp {

namespace {

// Holds each staggered round's messages to its process, `msgs(process)`
// ({id, bytes}), until the previous round's from its source arrive,
// `received(process)` (transfer ids, in order), chunk by chunk
// (Routes::stagger_to). Round 1 goes at once: each round waits only on an
// earlier round of another process, so none waits in a cycle.
template <typename Msgs, typename Received>
void HoldRounds(const Routes& rt, Messages& m, Msgs msgs, Received received) {
  for (size_t k = 1; k < rt.stagger_to.size(); ++k)
    m.Hold(rt.stagger_to[k], msgs(rt.stagger_to[k]), received(rt.stagger_from[k - 1]));
}

using MsgList = std::vector<std::pair<uint64_t, size_t>>;

// Appends the ids of the transfers of `r`, in order.
void AppendIds(const Messages::Range& r, std::vector<size_t>* ids) {
  for (size_t i = 0; i < r.count; ++i) ids->push_back(r.first + i);
}

// The transfers of `arrivals` (each a rank's block and its range) that come
// from process `q`, in order.
template <typename Arrival>
std::vector<size_t> ArrivalsFrom(const Routes& rt, const std::vector<Arrival>& arrivals, int q) {
  std::vector<size_t> ids;
  for (const Arrival& a : arrivals)
    if (rt.gather_source[a.rank] == q) AppendIds(a.range, &ids);
  return ids;
}

// The body of a call: Start posts its messages and does whatever needs
// nothing received (it never waits), Finish does the rest.
class ProcessBody {
 public:
  virtual ~ProcessBody() = default;
  virtual void Start() = 0;
  virtual Status Finish() = 0;
};

// What the bodies that move [outer, inner] blocks share.
class BlockBody : public ProcessBody {
 public:
  BlockBody(const ProcessCall& c, size_t outer, size_t inner)
      : c_(c), outer_(outer), inner_(inner), block_(outer * inner), m_(c) {}

 protected:
  // Rank `rank`'s [outer, inner] block, contiguous at `block`, into its
  // strided place in an output: out[o, rank, :] = block[o, :].
  void Unpack(void* out, size_t rank, const void* block) const {
    for (size_t o = 0; o < outer_; ++o)
      CopyBytes(static_cast<char*>(out) + (o * c_.size + rank) * inner_,
                static_cast<const char*>(block) + o * inner_, inner_, stream_);
  }

  const ProcessCall& c_;
  const size_t outer_, inner_, block_;
  bool stream_ = false;  // outputs written with streaming stores
  Staging staging_;      // before m_: outlives the transfers into it
  Messages m_;
};

// recv_r[o, s, :] = send_s[o, :] for every rank s.
class AllGatherBody final : public BlockBody {
 public:
  using BlockBody::BlockBody;

  // Posts the receives and this process's blocks, and copies its own blocks
  // into its outputs while the links work.
  void Start() override {
    const Routes& rt = *c_.routes;
    const size_t nl = c_.local->size();
    if (block_ == 0) return;
    stream_ = c_.StreamOutputs();
    char* first = static_cast<char*>(c_.recv[0]);
    // Remote ranks' blocks land in the first local rank's output when they
    // are contiguous there (outer == 1), else in staging.
    const std::vector<int>& order = rt.gather_order;
    char* stage = outer_ == 1 ? nullptr : staging_.Get(order.size() * block_);
    for (int s : order) {
      char* dst = outer_ == 1 ? first + s * inner_ : stage + incoming_.size() * block_;
      incoming_.push_back({s, m_.Recv(rt.gather_source[s], Msg(kData, s), dst, block_), dst});
    }
    HoldRounds(
        rt, m_,
        [&](int) {
          MsgList msgs;
          for (size_t li = 0; li < nl; ++li) msgs.push_back({Msg(kData, (*c_.local)[li]), block_});
          return msgs;
        },
        [&](int q) { return ArrivalsFrom(rt, incoming_, q); });
    for (int q : rt.gather_targets) {
      for (size_t li = 0; li < nl; ++li)
        m_.Send(q, Msg(kData, (*c_.local)[li]), c_.send[li], block_);
    }
    for (size_t d = 0; d < nl; ++d) {
      for (size_t li = 0; li < nl; ++li) Unpack(c_.recv[d], (*c_.local)[li], c_.send[li]);
    }
  }

  Status Finish() override {
    const Routes& rt = *c_.routes;
    const size_t nl = c_.local->size();
    for (const Incoming& in : incoming_) {
      // Chunk by chunk, as it arrives: relayed on, and copied into the other
      // local outputs.
      for (size_t k = 0; k < in.range.count; ++k) {
        SMDDP_RETURN_IF_ERROR(m_.Wait(in.range.first + k));
        for (int t : rt.gather_relay[in.rank])
          m_.SendChunk(t, Msg(kData, in.rank), block_, k, in.dst);
        if (outer_ != 1) continue;
        size_t off, bytes;
        m_.Chunk(block_, k, &off, &bytes);
        for (size_t d = 1; d < nl; ++d)
          CopyBytes(static_cast<char*>(c_.recv[d]) + in.rank * inner_ + off, in.dst + off, bytes,
                    stream_);
      }
      if (outer_ != 1) {
        for (size_t d = 0; d < nl; ++d) Unpack(c_.recv[d], in.rank, in.dst);
      }
    }
    return m_.WaitAll();
  }

 private:
  struct Incoming {
    int rank;
    Messages::Range range;
    char* dst;
  };
  std::vector<Incoming> incoming_;
};

// Reduces elements [j0, j1) of rank r's block ([outer, inner] rows taken from
// row r of every local rank's [outer, n, inner] input) together with `extra`
// flat arrays, into flat `dst`.
class BlockReducer {
 public:
  BlockReducer(const ProcessCall& c, DType dtype, ReduceOp op, size_t inner)
      : c_(c), dtype_(dtype), op_(op), esize_(ElementSize(dtype)), inner_(inner) {}

  void Run(int r, size_t j0, size_t j1, const std::vector<const char*>& extra, char* dst) {
    const size_t n = c_.size, nl = c_.local->size();
    srcs_.resize(nl + extra.size());
    for (size_t j = j0; j < j1;) {
      const size_t o = j / inner_, i = j % inner_, len = std::min(j1 - j, inner_ - i);
      for (size_t li = 0; li < nl; ++li)
        srcs_[li] = static_cast<const char*>(c_.send[li]) + ((o * n + r) * inner_ + i) * esize_;
      for (size_t e = 0; e < extra.size(); ++e) srcs_[nl + e] = extra[e] + j * esize_;
      Reduce(dtype_, op_, srcs_.data(), int(srcs_.size()), dst + j * esize_, len);
      j += len;
    }
  }

 private:
  const ProcessCall& c_;
  DType dtype_;
  ReduceOp op_;
  size_t esize_, inner_;
  std::vector<const void*> srcs_;
};

// Contributions received for each rank that has sources, in staging.
struct Contributions {
  std::vector<std::vector<const char*>> buffers;     // per rank, per source
  std::vector<std::vector<Messages::Range>> ranges;  // per rank, per source

  // Posts the receives: rank r's contributions of bytes(r) each.
  template <typename Bytes>
  char* Post(const ProcessCall& c, Messages& m, Staging& staging, uint64_t round, Bytes bytes,
             size_t slot_bytes, size_t extra_bytes) {
    const Routes& rt = *c.routes;
    size_t slots = 0;
    for (int r = 0; r < c.size; ++r) slots += rt.reduce_sources[r].size();
    char* stage = staging.Get(slots * slot_bytes + extra_bytes);
    buffers.assign(c.size, {});
    ranges.assign(c.size, {});
    size_t k = 0;
    for (int r = 0; r < c.size; ++r) {
      for (int q : rt.reduce_sources[r]) {
        char* slot = stage + (k++) * slot_bytes;
        buffers[r].push_back(slot);
        ranges[r].push_back(m.Recv(q, Msg(round, r), slot, bytes(r)));
      }
    }
    return stage + slots * slot_bytes;  // the extra bytes
  }

  // The transfers of the contributions from process `q`, by rank.
  std::vector<size_t> From(const Routes& rt, int q) const {
    std::vector<size_t> ids;
    for (size_t r = 0; r < ranges.size(); ++r) {
      for (size_t i = 0; i < ranges[r].size(); ++i)
        if (rt.reduce_sources[r][i] == q) AppendIds(ranges[r][i], &ids);
    }
    return ids;
  }

  Status WaitChunk(Messages& m, int r, size_t k) {
    for (const auto& range : ranges[r]) SMDDP_RETURN_IF_ERROR(m.Wait(range.first + k));
    return Status::Ok();
  }
};

// What the reductions share: the contributions received into staging, and
// the ranks handled in Routes::reduce_order, those that need nothing
// received as the body starts, the others as it finishes.
class ReductionBody : public ProcessBody {
 public:
  ReductionBody(const ProcessCall& c, DType dtype) : c_(c), esize_(ElementSize(dtype)), m_(c) {}

 protected:
  // Reduces rank r's part (with what was received for it) and sends it on,
  // chunk by chunk, or completes it into the local outputs.
  virtual Status Rank(int r) = 0;

  // The ranks of the first stage of reduce_order: they wait for nothing.
  void StartRanks() {
    const std::vector<int>& order = c_.routes->reduce_order;
    while (next_ < order.size() && c_.routes->reduce_dest[order[next_]] >= 0 &&
           c_.routes->reduce_sources[order[next_]].empty()) {
      const Status st = Rank(order[next_++]);  // waits for nothing: cannot fail
      (void)st;
    }
  }
  Status FinishRanks() {
    const std::vector<int>& order = c_.routes->reduce_order;
    while (next_ < order.size()) SMDDP_RETURN_IF_ERROR(Rank(order[next_++]));
    return Status::Ok();
  }
  // The partials sent to process `q`, rank r's of bytes(r).
  template <typename Bytes>
  MsgList PartialsTo(int q, Bytes bytes) const {
    MsgList msgs;
    for (int r = 0; r < c_.size; ++r)
      if (c_.routes->reduce_dest[r] == q) msgs.push_back({Msg(kData, r), bytes(r)});
    return msgs;
  }
  // The index among this process's ranks of r, one of them.
  size_t LocalIndex(int r) const {
    return size_t(std::lower_bound(c_.local->begin(), c_.local->end(), r) - c_.local->begin());
  }
  // The next of the staged partials of `bytes` each.
  char* NextPartial(size_t bytes) { return partials_ + (next_partial_++) * bytes; }

  const ProcessCall& c_;
  const size_t esize_;
  Staging staging_;  // before m_: outlives the transfers into it
  Messages m_;
  Contributions in_;
  char* partials_ = nullptr;  // staging after the contributions (Contributions::Post)

 private:
  size_t next_ = 0, next_partial_ = 0;
};

// recv_r[o, :] = reduce over ranks s of send_s[o, r, :]. Each rank's block is
// reduced once per process (its own ranks first), combined per host on the
// way (hierarchical routes), and completed by the rank's own process.
class ReduceScatterBody final : public ReductionBody {
 public:
  ReduceScatterBody(const ProcessCall& c, DType dtype, ReduceOp op, size_t outer, size_t inner)
      : ReductionBody(c, dtype),
        outer_(outer),
        bb_(outer * inner * ElementSize(dtype)),
        reducer_(c, dtype, op, inner) {}

  // Posts the receives and sends the ranks that need nothing received.
  void Start() override {
    const Routes& rt = *c_.routes;
    if (bb_ == 0) return;
    size_t outgoing = 0;
    for (int r = 0; r < c_.size; ++r) outgoing += rt.reduce_dest[r] >= 0 ? 1 : 0;
    partials_ = in_.Post(c_, m_, staging_, kData, [&](int) { return bb_; }, bb_, outgoing * bb_);
    HoldRounds(
        rt, m_, [&](int q) { return PartialsTo(q, [&](int) { return bb_; }); },
        [&](int q) { return in_.From(rt, q); });
    StartRanks();
    // What Finish sends once combined: its handshakes now, on quiet links.
    for (int r = 0; r < c_.size; ++r) {
      if (rt.reduce_dest[r] >= 0 && !in_.buffers[r].empty())
        m_.Announce(rt.reduce_dest[r], Msg(kData, r), bb_);
    }
  }

  Status Finish() override {
    if (bb_ == 0) return Status::Ok();
    SMDDP_RETURN_IF_ERROR(FinishRanks());
    return m_.WaitAll();
  }

 private:
  Status Rank(int r) override {
    const int dest = c_.routes->reduce_dest[r];
    const bool combines = !in_.buffers[r].empty();
    char* out;
    if (dest < 0) {
      out = static_cast<char*>(c_.recv[LocalIndex(r)]);
    } else if (!combines && c_.local->size() == 1 && outer_ == 1) {
      out = nullptr;  // the partial is the input itself
    } else {
      out = NextPartial(bb_);
    }
    const char* base = out ? out : static_cast<const char*>(c_.send[0]) + r * bb_;
    for (size_t k = 0; k < m_.Chunks(bb_); ++k) {
      size_t off, bytes;
      m_.Chunk(bb_, k, &off, &bytes);
      if (out) {
        SMDDP_RETURN_IF_ERROR(in_.WaitChunk(m_, r, k));
        reducer_.Run(r, off / esize_, (off + bytes) / esize_, in_.buffers[r], out);
      }
      if (dest >= 0) m_.SendChunk(dest, Msg(kData, r), bb_, k, base);
    }
    return Status::Ok();
  }

  const size_t outer_, bb_;
  BlockReducer reducer_;
};

// recv = reduce over ranks of send, balanced: shard r (the r-th of `size`
// equal parts) is reduced once, by rank r's process (combined per host on the
// way), and its result spread to every process as a gather would.
class AllReduceBody final : public ReductionBody {
 public:
  AllReduceBody(const ProcessCall& c, DType dtype, ReduceOp op, size_t count)
      : ReductionBody(c, dtype), dtype_(dtype), op_(op), count_(count) {}

  // Posts the receives and sends the shards that need nothing received.
  void Start() override {
    const Routes& rt = *c_.routes;
    const size_t n = c_.size;
    if (count_ == 0) return;
    stream_ = c_.StreamOutputs();
    size_t outgoing = 0;
    for (size_t r = 0; r < n; ++r) {
      max_shard_ = std::max(max_shard_, Shard(r));
      outgoing += rt.reduce_dest[r] >= 0 ? 1 : 0;
    }
    partials_ = in_.Post(
        c_, m_, staging_, kData, [&](int r) { return Shard(r); }, max_shard_,
        outgoing * max_shard_);
    char* first = static_cast<char*>(c_.recv[0]);
    for (int s : rt.gather_order)
      results_.push_back(
          {s, m_.Recv(rt.gather_source[s], Msg(kResult, s), first + Begin(s) * esize_, Shard(s))});
    // Both exchanges in rounds: the shards to reduce, then the results.
    HoldRounds(
        rt, m_, [&](int q) { return PartialsTo(q, [&](int r) { return Shard(r); }); },
        [&](int q) { return in_.From(rt, q); });
    HoldRounds(
        rt, m_,
        [&](int) {
          MsgList msgs;
          for (size_t r = 0; r < n; ++r)
            if (rt.reduce_dest[r] < 0) msgs.push_back({Msg(kResult, r), Shard(r)});
          return msgs;
        },
        [&](int q) { return ArrivalsFrom(rt, results_, q); });
    StartRanks();
    // What Finish sends once reduced (combined shards, this process's
    // results): its handshakes now, on quiet links.
    for (size_t r = 0; r < n; ++r) {
      const int dest = rt.reduce_dest[r];
      if (dest >= 0 && !in_.buffers[r].empty()) m_.Announce(dest, Msg(kData, r), Shard(r));
      if (dest < 0) {
        for (int t : rt.gather_targets) m_.Announce(t, Msg(kResult, r), Shard(r));
      }
    }
  }

  Status Finish() override {
    if (count_ == 0) return Status::Ok();
    const Routes& rt = *c_.routes;
    const size_t nl = c_.local->size();
    SMDDP_RETURN_IF_ERROR(FinishRanks());
    char* first = static_cast<char*>(c_.recv[0]);
    for (const Result& res : results_) {
      const size_t sb = Shard(res.rank);
      char* base = first + Begin(res.rank) * esize_;
      for (size_t k = 0; k < res.range.count; ++k) {
        SMDDP_RETURN_IF_ERROR(m_.Wait(res.range.first + k));
        for (int t : rt.gather_relay[res.rank])
          m_.SendChunk(t, Msg(kResult, res.rank), sb, k, base);
        size_t off, bytes;
        m_.Chunk(sb, k, &off, &bytes);
        for (size_t d = 1; d < nl; ++d)
          CopyBytes(static_cast<char*>(c_.recv[d]) + Begin(res.rank) * esize_ + off, base + off,
                    bytes, stream_);
      }
    }
    return m_.WaitAll();
  }

 private:
  size_t Begin(size_t r) const { return count_ * r / c_.size; }
  size_t Shard(size_t r) const {
    return (count_ * (r + 1) / c_.size - count_ * r / c_.size) * esize_;
  }

  // A shard of this process's is final: out to the other processes, and
  // into the other local outputs.
  Status Rank(int r) override {
    const Routes& rt = *c_.routes;
    const size_t nl = c_.local->size(), sb = Shard(r);
    const int dest = rt.reduce_dest[r];
    const bool combines = !in_.buffers[r].empty();
    char* out;
    int li = -1;
    if (dest < 0) {
      li = int(LocalIndex(r));
      out = static_cast<char*>(c_.recv[li]) + Begin(r) * esize_;
    } else if (!combines && nl == 1) {
      out = nullptr;  // the partial is the input itself
    } else {
      out = NextPartial(max_shard_);
    }
    const char* base = out ? out : static_cast<const char*>(c_.send[0]) + Begin(r) * esize_;
    for (size_t k = 0; k < m_.Chunks(sb); ++k) {
      size_t off, bytes;
      m_.Chunk(sb, k, &off, &bytes);
      if (out) {
        SMDDP_RETURN_IF_ERROR(in_.WaitChunk(m_, r, k));
        srcs_.clear();
        for (size_t i = 0; i < nl; ++i)
          srcs_.push_back(static_cast<const char*>(c_.send[i]) + Begin(r) * esize_ + off);
        for (const char* e : in_.buffers[r]) srcs_.push_back(e + off);
        Reduce(dtype_, op_, srcs_.data(), int(srcs_.size()), out + off, bytes / esize_);
      }
      if (dest >= 0) {
        m_.SendChunk(dest, Msg(kData, r), sb, k, base);
        continue;
      }
      for (int t : rt.gather_targets) m_.SendChunk(t, Msg(kResult, r), sb, k, out);
      for (size_t d = 0; d < nl; ++d) {
        if (int(d) != li)
          CopyBytes(static_cast<char*>(c_.recv[d]) + Begin(r) * esize_ + off, out + off, bytes,
                    stream_);
      }
    }
    return Status::Ok();
  }

  struct Result {
    int rank;
    Messages::Range range;
  };
  const DType dtype_;
  const ReduceOp op_;
  const size_t count_;
  bool stream_ = false;
  size_t max_shard_ = 0;
  std::vector<Result> results_;
  std::vector<const void*> srcs_;
};

// recv_r[o, s, :] = send_s[o, r, :].
class AllToAllBody final : public BlockBody {
 public:
  using BlockBody::BlockBody;

  // Posts the receives and sends, and copies this process's own blocks.
  void Start() override {
    const size_t n = c_.size, nl = c_.local->size(), np = c_.peers->size();
    if (block_ == 0) return;
    stream_ = c_.StreamOutputs();
    size_t remote = 0;
    for (const auto& ranks : *c_.peer_ranks) remote += ranks.size();
    // With outer > 1 blocks are strided: packed and unpacked through staging.
    char* stage = outer_ == 1 ? nullptr : staging_.Get(2 * nl * remote * block_);
    char* unpacked = stage;
    char* packed = stage ? stage + nl * remote * block_ : nullptr;
    for (size_t li = 0; li < nl; ++li) {
      const int r = (*c_.local)[li];
      for (size_t qi = 0; qi < np; ++qi) {
        for (int s : (*c_.peer_ranks)[qi]) {
          char* dst = outer_ == 1 ? static_cast<char*>(c_.recv[li]) + s * inner_
                                  : unpacked + incoming_.size() * block_;
          incoming_.push_back(
              {int(li), s, m_.Recv((*c_.peers)[qi], Msg(kData, s, r), dst, block_), dst});
        }
      }
    }
    size_t k = 0;
    for (size_t li = 0; li < nl; ++li) {
      const char* send = static_cast<const char*>(c_.send[li]);
      for (size_t qi = 0; qi < np; ++qi) {
        for (int r : (*c_.peer_ranks)[qi]) {
          const char* src = send + r * inner_;
          if (outer_ != 1) {
            char* p = packed + (k++) * block_;
            for (size_t o = 0; o < outer_; ++o)
              std::memcpy(p + o * inner_, send + (o * n + r) * inner_, inner_);
            src = p;
          }
          m_.Send((*c_.peers)[qi], Msg(kData, (*c_.local)[li], r), src, block_);
        }
      }
    }
    for (size_t d = 0; d < nl; ++d) {
      char* out = static_cast<char*>(c_.recv[d]);
      for (size_t li = 0; li < nl; ++li) {
        const char* send = static_cast<const char*>(c_.send[li]);
        for (size_t o = 0; o < outer_; ++o)
          CopyBytes(out + (o * n + (*c_.local)[li]) * inner_,
                    send + (o * n + (*c_.local)[d]) * inner_, inner_, stream_);
      }
    }
  }

  Status Finish() override {
    for (const Incoming& in : incoming_) {
      SMDDP_RETURN_IF_ERROR(m_.WaitRange(in.range));
      if (outer_ != 1) Unpack(c_.recv[in.to_local], in.from, in.dst);
    }
    return m_.WaitAll();
  }

 private:
  struct Incoming {
    int to_local;
    int from;
    Messages::Range range;
    char* dst;
  };
  std::vector<Incoming> incoming_;
};

// recv_t = send_s for each pair (s, t) of the permutation (sources[t] = s),
// zeros for the ranks that receive nothing: a rank's block goes straight to
// its target's process, or is copied when both are this process's.
class CollectivePermuteBody final : public ProcessBody {
 public:
  CollectivePermuteBody(const ProcessCall& c, const int64_t* sources, size_t bytes)
      : c_(c), sources_(sources), bytes_(bytes), m_(c) {}

  void Start() override {
    const std::vector<int>& local = *c_.local;
    const int me = c_.world->process();
    if (bytes_ == 0 || !sources_) return;
    stream_ = c_.StreamOutputs();
    auto local_index = [&](int64_t r) {
      return size_t(std::lower_bound(local.begin(), local.end(), int(r)) - local.begin());
    };
    for (size_t li = 0; li < local.size(); ++li) {
      const int t = local[li];
      const int64_t s = sources_[t];
      if (s < 0 || s >= c_.size) continue;
      const int from = (*c_.process_of_rank)[s];
      if (from != me)
        incoming_.push_back(
            m_.Recv(from, Msg(kData, uint64_t(s), uint64_t(t)), c_.recv[li], bytes_));
    }
    for (int t = 0; t < c_.size; ++t) {
      const int64_t s = sources_[t];
      if (s < 0 || s >= c_.size || (*c_.process_of_rank)[s] != me) continue;
      const void* src = c_.send[local_index(s)];
      const int to = (*c_.process_of_rank)[t];
      if (to != me) m_.Send(to, Msg(kData, uint64_t(s), uint64_t(t)), src, bytes_);
    }
    for (size_t li = 0; li < local.size(); ++li) {
      const int64_t s = sources_[local[li]];
      if (s < 0 || s >= c_.size) {
        std::memset(c_.recv[li], 0, bytes_);
      } else if ((*c_.process_of_rank)[s] == me) {
        CopyBytes(c_.recv[li], c_.send[local_index(s)], bytes_, stream_);
      }
    }
  }

  Status Finish() override {
    if (bytes_ && !sources_)
      return Status::Error("jax_smddp: collective_permute without its permutation");
    for (const Messages::Range& in : incoming_) SMDDP_RETURN_IF_ERROR(m_.WaitRange(in));
    return m_.WaitAll();
  }

 private:
  const ProcessCall& c_;
  const int64_t* sources_;
  const size_t bytes_;
  bool stream_ = false;
  Messages m_;
  std::vector<Messages::Range> incoming_;
};

}  // namespace

// A call's agreement check and body: one allocation per call.
struct ProcessRun::Parts {
  Parts(const Plan& plan, const ProcessCall& call) : agreement(call, plan) {
    switch (plan.kind) {
      case Collective::kAllGather:
        body = &bodies.emplace<AllGatherBody>(call, plan.outer, plan.inner);
        break;
      case Collective::kReduceScatter:
        body =
            &bodies.emplace<ReduceScatterBody>(call, plan.dtype, plan.op, plan.outer, plan.inner);
        break;
      case Collective::kAllReduce:
        body = &bodies.emplace<AllReduceBody>(call, plan.dtype, plan.op, plan.count);
        break;
      case Collective::kAllToAll:
        body = &bodies.emplace<AllToAllBody>(call, plan.outer, plan.inner);
        break;
      case Collective::kCollectivePermute:
        body = &bodies.emplace<CollectivePermuteBody>(call, plan.sources, plan.outer * plan.inner);
        break;
    }
  }
  // Withdraws what the body still has in flight.
  void EndBody() {
    bodies.emplace<std::monostate>();
    body = nullptr;
  }

  ProcessAgreement agreement;
  std::variant<std::monostate, AllGatherBody, ReduceScatterBody, AllReduceBody, AllToAllBody,
               CollectivePermuteBody>
      bodies;
  ProcessBody* body = nullptr;  // the one in `bodies`
};

ProcessRun::ProcessRun(const Plan& plan, ProcessCall& call)
    : call_(call), start_(Clock::now()), parts_(std::make_unique<Parts>(plan, call)) {
  // The body starts at once, without waiting for the peers' views: its
  // receives are posted and this process's data is on its way before the
  // calling thread decides who runs the rest, so peers that came earlier
  // are not kept waiting by that decision (or the hand-off to a worker).
  parts_->body->Start();
  started_ = Clock::now();
}

ProcessRun::~ProcessRun() = default;

bool ProcessRun::PeersArrived(Clock::time_point until) {
  // The peers' views only: this process's own may still be on its way.
  return parts_->agreement.m.PollRange({0, call_.peers->size()}, until);
}

// A peer that runs another call is still reported as such, never as what
// its data did to this one: the views are compared as they arrive while the
// body waits, and all of them once it is done, before the call may succeed;
// a disagreement outranks the body's own failure (a message of the wrong
// size, or a timeout waiting for one).
Status ProcessRun::Finish() {
  ProcessAgreement& a = parts_->agreement;
  const auto body_from = Clock::now();
  call_.watch = &a;
  const Status body = parts_->body->Finish();
  call_.watch = nullptr;
  // Withdraws what is still in flight (on failure) before the call ends.
  parts_->EndBody();
  const auto body_to = Clock::now();
  const Status st = body.ok() ? a.m.WaitAll() : Status::Ok();
  // What arrived is compared even when the rest did not.
  Status agreed = a.Check();
  if (agreed.ok() && body.code() == StatusCode::kMismatch) {
    // A message of the wrong size: a peer that runs another call sent its
    // view before its data; give it a moment to arrive.
    a.m.PollAll(Clock::now() + std::chrono::seconds(1));
    agreed = a.Check();
  }
  const Status late = body.code() == StatusCode::kTimeout ? NeverArrived(body) : Status::Ok();
  parts_.reset();
  if (call_.phases) {
    const auto s = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    // The body's two parts; the rest (the wait for the peers' views, a
    // hand-off to a worker) is the agreement's.
    call_.phases->body_s = s(started_ - start_) + s(body_to - body_from);
    call_.phases->agree_s = s(body_from - started_) + s(Clock::now() - body_to);
  }
  if (!agreed.ok()) return agreed;
  if (!late.ok()) return late;
  if (!body.ok()) return body;
  return st;
}

// A peer whose view of the call never came is the one that never reached it:
// name it rather than the process the body waited on, which may be waiting on
// it too (a ring's previous hop, a relay).
Status ProcessRun::NeverArrived(const Status& timeout) {
  // The headers share the body's links, whose progress completed those that came.
  ProcessAgreement& a = parts_->agreement;
  for (size_t i = 0; i < call_.peers->size(); ++i) {
    if (a.m.Succeeded(i)) continue;
    const int q = (*call_.peers)[i];
    std::string why = call_.where() + ": timed out after " + Seconds(Clock::now() - call_.start) +
                      ": " + call_.DescribeProcess(q) +
                      " never reached this collective (its view of the call never came)";
    const std::vector<int>& waited = timeout.peer_processes();
    if (!waited.empty() && waited[0] != q)
      why += "; the wait that timed out was for " + call_.DescribeProcess(waited[0]);
    return call_.Concerning(
        q,
        Status::Timeout(why + ". It is stalled, late or running another program; " + kIfOnlySlow));
  }
  return Status::Ok();
}

}  // namespace smddp
