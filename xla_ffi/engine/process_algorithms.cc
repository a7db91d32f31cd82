#include "xla_ffi/engine/process_algorithms.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "xla_ffi/engine/messages.h"
#include "xla_ffi/engine/reduce.h"

namespace smddp {

namespace {

enum Round : uint64_t { kHeader = 1, kData = 2, kResult = 3 };

// A message id, unique within a call.
uint64_t Msg(uint64_t round, uint64_t a = 0, uint64_t b = 0) {
  return (round << 56) ^ (a << 28) ^ b;
}

// Staging memory of the calling thread, reused across calls (the engine's
// workers live long): calls allocate nothing in the steady state.
char* Scratch(size_t bytes) {
  thread_local std::unique_ptr<char[]> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    buffer.reset(new char[bytes]);
    capacity = bytes;
  }
  return buffer.get();
}

// What every process must agree on, sent to every peer before any data.
struct Header {
  char op[16];
  uint64_t dtype, reduce, send_bytes, recv_bytes, size, kind, outer, inner, count;
};

Header MakeHeader(const ProcessCall& c, const Plan& p) {
  Header h;
  std::memset(&h, 0, sizeof(h));
  std::strncpy(h.op, c.info.op, sizeof(h.op) - 1);
  h.dtype = uint64_t(c.info.dtype);
  h.reduce = uint64_t(c.info.reduce);
  h.send_bytes = c.info.send_bytes;
  h.recv_bytes = c.info.recv_bytes;
  h.size = uint64_t(c.size);
  h.kind = uint64_t(p.kind);
  h.outer = p.outer;
  h.inner = p.inner;
  h.count = p.count;
  return h;
}

std::string Describe(const Header& h) {
  std::ostringstream os;
  std::string op(h.op, strnlen(h.op, sizeof(h.op)));
  os << op << " of " << (h.dtype < 16 ? DTypeName(DType(h.dtype)) : "?") << " ("
     << h.send_bytes << " bytes in, " << h.recv_bytes << " bytes out per device";
  if (op != "all_gather" && op != "all_to_all")
    os << ", " << (h.reduce < 3 ? ReduceOpName(ReduceOp(h.reduce)) : "?");
  os << ", " << h.size << " devices)";
  return os.str();
}

Status CheckCallsAgree(const ProcessCall& c, const Plan& plan) {
  Messages m(c);
  const Header mine = MakeHeader(c, plan);
  std::vector<Header> theirs(c.peers.size());
  for (size_t i = 0; i < c.peers.size(); ++i) m.Recv(c.peers[i], Msg(kHeader), &theirs[i], sizeof(Header));
  for (int p : c.peers) m.Send(p, Msg(kHeader), &mine, sizeof(Header));
  SMDDP_RETURN_IF_ERROR(m.WaitAll());
  for (size_t i = 0; i < c.peers.size(); ++i) {
    if (std::memcmp(&theirs[i], &mine, sizeof(Header)) != 0) {
      return Status::Error(c.where + ": processes disagree on the call: this process (process " +
                           std::to_string(c.world->process()) + ") runs " + Describe(mine) + " but " +
                           c.DescribeProcess(c.peers[i]) + " runs " + Describe(theirs[i]) +
                           ". Every process must run the same program on same-shaped inputs.");
    }
  }
  return Status::Ok();
}

// recv_r[o, s, :] = send_s[o, :] for every rank s.
Status AllGatherAcross(const ProcessCall& c, size_t outer, size_t inner) {
  const size_t n = c.size, block = outer * inner, nl = c.local.size();
  if (block == 0) return Status::Ok();
  Messages m(c);
  char* first = static_cast<char*>(c.recv[0]);
  // Remote ranks' blocks land in the first local rank's output when they are
  // contiguous there (outer == 1), else in staging.
  struct Incoming { int rank; Messages::Range range; char* dst; };
  std::vector<Incoming> incoming;
  size_t remote = 0;
  for (const auto& ranks : c.peer_ranks) remote += ranks.size();
  char* stage = outer == 1 ? nullptr : Scratch(remote * block);
  for (size_t qi = 0; qi < c.peers.size(); ++qi) {
    for (int s : c.peer_ranks[qi]) {
      char* dst = outer == 1 ? first + s * inner : stage + incoming.size() * block;
      incoming.push_back({s, m.Recv(c.peers[qi], Msg(kData, s), dst, block), dst});
    }
  }
  for (int q : c.peers) {
    for (size_t li = 0; li < nl; ++li) m.Send(q, Msg(kData, c.local[li]), c.send[li], block);
  }
  // This process's own blocks, while the network works.
  for (size_t d = 0; d < nl; ++d) {
    char* out = static_cast<char*>(c.recv[d]);
    for (size_t o = 0; o < outer; ++o) {
      for (size_t li = 0; li < nl; ++li) {
        std::memcpy(out + (o * n + c.local[li]) * inner,
                    static_cast<const char*>(c.send[li]) + o * inner, inner);
      }
    }
  }
  for (const Incoming& in : incoming) {
    if (outer == 1) {
      // Chunk by chunk into the other local outputs as it arrives.
      for (size_t k = 0; k < in.range.count; ++k) {
        SMDDP_RETURN_IF_ERROR(m.Wait(in.range.first + k));
        size_t off, bytes;
        Messages::Chunk(block, k, &off, &bytes);
        for (size_t d = 1; d < nl; ++d)
          std::memcpy(static_cast<char*>(c.recv[d]) + in.rank * inner + off, in.dst + off, bytes);
      }
    } else {
      SMDDP_RETURN_IF_ERROR(m.WaitRange(in.range));
      for (size_t d = 0; d < nl; ++d) {
        char* out = static_cast<char*>(c.recv[d]);
        for (size_t o = 0; o < outer; ++o)
          std::memcpy(out + (o * n + in.rank) * inner, in.dst + o * inner, inner);
      }
    }
  }
  return m.WaitAll();
}

// Reduces elements [j0, j1) of rank r's block ([outer, inner] rows taken from
// row r of every local rank's [outer, n, inner] input) together with `extra`
// flat arrays, into flat `dst`.
class BlockReducer {
 public:
  BlockReducer(const ProcessCall& c, DType dtype, ReduceOp op, size_t inner)
      : c_(c), dtype_(dtype), op_(op), esize_(ElementSize(dtype)), inner_(inner) {}

  void Run(int r, size_t j0, size_t j1, const std::vector<const char*>& extra, char* dst) {
    const size_t n = c_.size, nl = c_.local.size();
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

// recv_r[o, :] = reduce over ranks s of send_s[o, r, :]. Each process sends
// each peer one partial (its own ranks reduced) per rank of that peer.
Status ReduceScatterAcross(const ProcessCall& c, DType dtype, ReduceOp op, size_t outer,
                           size_t inner) {
  const size_t esize = ElementSize(dtype), block = outer * inner, bb = block * esize;
  const size_t nl = c.local.size(), np = c.peers.size();
  if (bb == 0) return Status::Ok();
  Messages m(c);
  size_t remote = 0;
  for (const auto& ranks : c.peer_ranks) remote += ranks.size();
  const bool direct = nl == 1 && outer == 1;  // partials are the input itself
  char* stage = Scratch((nl * np + (direct ? 0 : remote)) * bb);
  char* partials = stage + nl * np * bb;
  std::vector<std::vector<Messages::Range>> in(nl, std::vector<Messages::Range>(np));
  for (size_t li = 0; li < nl; ++li) {
    for (size_t qi = 0; qi < np; ++qi)
      in[li][qi] = m.Recv(c.peers[qi], Msg(kData, c.local[li]), stage + (li * np + qi) * bb, bb);
  }
  BlockReducer reducer(c, dtype, op, inner);
  const std::vector<const char*> none;
  const size_t chunks = Messages::Chunks(bb);
  size_t k_remote = 0;
  for (size_t qi = 0; qi < np; ++qi) {
    for (int r : c.peer_ranks[qi]) {
      const char* base;
      if (direct) {
        base = static_cast<const char*>(c.send[0]) + r * bb;
      } else {
        base = partials + (k_remote++) * bb;
      }
      for (size_t k = 0; k < chunks; ++k) {
        size_t off, bytes;
        Messages::Chunk(bb, k, &off, &bytes);
        if (!direct)
          reducer.Run(r, off / esize, (off + bytes) / esize, none, const_cast<char*>(base));
        m.SendChunk(c.peers[qi], Msg(kData, r), bb, k, base);
      }
    }
  }
  std::vector<const char*> extra(np);
  for (size_t li = 0; li < nl; ++li) {
    for (size_t qi = 0; qi < np; ++qi) extra[qi] = stage + (li * np + qi) * bb;
    for (size_t k = 0; k < chunks; ++k) {
      for (size_t qi = 0; qi < np; ++qi) SMDDP_RETURN_IF_ERROR(m.Wait(in[li][qi].first + k));
      size_t off, bytes;
      Messages::Chunk(bb, k, &off, &bytes);
      reducer.Run(c.local[li], off / esize, (off + bytes) / esize, extra,
                  static_cast<char*>(c.recv[li]));
    }
  }
  return m.WaitAll();
}

// recv = reduce over ranks of send, balanced: shard r (the r-th of `size`
// equal parts) is reduced once, by rank r's process, and sent to the others.
Status AllReduceAcross(const ProcessCall& c, DType dtype, ReduceOp op, size_t count) {
  const size_t n = c.size, esize = ElementSize(dtype), nl = c.local.size(), np = c.peers.size();
  if (count == 0) return Status::Ok();
  auto begin = [&](size_t r) { return count * r / n; };
  auto shard = [&](size_t r) { return (count * (r + 1) / n - count * r / n) * esize; };
  Messages m(c);
  size_t max_shard = 0;
  for (size_t r = 0; r < n; ++r) max_shard = std::max(max_shard, shard(r));
  size_t remote = 0;
  for (const auto& ranks : c.peer_ranks) remote += ranks.size();
  const bool direct = nl == 1;
  char* stage = Scratch((nl * np + (direct ? 0 : remote)) * max_shard);
  char* partials = stage + nl * np * max_shard;
  char* first = static_cast<char*>(c.recv[0]);
  // Partials of this process's shards from every peer; finished remote shards.
  std::vector<std::vector<Messages::Range>> in(nl, std::vector<Messages::Range>(np));
  for (size_t li = 0; li < nl; ++li) {
    const int r = c.local[li];
    for (size_t qi = 0; qi < np; ++qi)
      in[li][qi] = m.Recv(c.peers[qi], Msg(kData, r), stage + (li * np + qi) * max_shard, shard(r));
  }
  struct Result { int rank; Messages::Range range; };
  std::vector<Result> results;
  for (size_t qi = 0; qi < np; ++qi) {
    for (int s : c.peer_ranks[qi])
      results.push_back({s, m.Recv(c.peers[qi], Msg(kResult, s), first + begin(s) * esize, shard(s))});
  }
  std::vector<const void*> srcs(nl + np);
  auto reduce_local = [&](size_t r, size_t off, size_t bytes, const std::vector<const char*>& extra,
                          char* dst) {
    size_t k = 0;
    for (size_t li = 0; li < nl; ++li)
      srcs[k++] = static_cast<const char*>(c.send[li]) + begin(r) * esize + off;
    for (const char* e : extra) srcs[k++] = e + off;
    Reduce(dtype, op, srcs.data(), int(k), dst, bytes / esize);
  };
  // Partials of the peers' shards, chunk by chunk.
  const std::vector<const char*> none;
  size_t k_remote = 0;
  for (size_t qi = 0; qi < np; ++qi) {
    for (int r : c.peer_ranks[qi]) {
      const size_t sb = shard(r);
      const char* base = direct ? static_cast<const char*>(c.send[0]) + begin(r) * esize
                                : partials + (k_remote++) * max_shard;
      for (size_t k = 0; k < Messages::Chunks(sb); ++k) {
        size_t off, bytes;
        Messages::Chunk(sb, k, &off, &bytes);
        if (!direct) reduce_local(r, off, bytes, none, const_cast<char*>(base) + off);
        m.SendChunk(c.peers[qi], Msg(kData, r), sb, k, base);
      }
    }
  }
  // This process's shards: reduce, send to every peer, copy to the other local outputs.
  std::vector<const char*> extra(np);
  for (size_t li = 0; li < nl; ++li) {
    const int r = c.local[li];
    const size_t sb = shard(r);
    char* result = static_cast<char*>(c.recv[li]) + begin(r) * esize;
    for (size_t qi = 0; qi < np; ++qi) extra[qi] = stage + (li * np + qi) * max_shard;
    for (size_t k = 0; k < Messages::Chunks(sb); ++k) {
      for (size_t qi = 0; qi < np; ++qi) SMDDP_RETURN_IF_ERROR(m.Wait(in[li][qi].first + k));
      size_t off, bytes;
      Messages::Chunk(sb, k, &off, &bytes);
      // reduce_local offsets sources by `off`; the destination is chunk k.
      reduce_local(r, off, bytes, extra, result + off);
      for (int q : c.peers) m.SendChunk(q, Msg(kResult, r), sb, k, result);
      for (size_t d = 0; d < nl; ++d) {
        if (d != li) std::memcpy(static_cast<char*>(c.recv[d]) + begin(r) * esize + off, result + off, bytes);
      }
    }
  }
  for (const Result& res : results) {
    const size_t sb = shard(res.rank);
    for (size_t k = 0; k < res.range.count; ++k) {
      SMDDP_RETURN_IF_ERROR(m.Wait(res.range.first + k));
      size_t off, bytes;
      Messages::Chunk(sb, k, &off, &bytes);
      for (size_t d = 1; d < nl; ++d)
        std::memcpy(static_cast<char*>(c.recv[d]) + begin(res.rank) * esize + off,
                    first + begin(res.rank) * esize + off, bytes);
    }
  }
  return m.WaitAll();
}

// recv_r[o, s, :] = send_s[o, r, :].
Status AllToAllAcross(const ProcessCall& c, size_t outer, size_t inner) {
  const size_t n = c.size, nl = c.local.size(), np = c.peers.size(), block = outer * inner;
  if (block == 0) return Status::Ok();
  Messages m(c);
  size_t remote = 0;
  for (const auto& ranks : c.peer_ranks) remote += ranks.size();
  // With outer > 1 blocks are strided: packed and unpacked through staging.
  char* stage = outer == 1 ? nullptr : Scratch(2 * nl * remote * block);
  char* unpacked = stage;
  char* packed = stage ? stage + nl * remote * block : nullptr;
  struct Incoming { int to_local; int from; Messages::Range range; char* dst; };
  std::vector<Incoming> incoming;
  for (size_t li = 0; li < nl; ++li) {
    const int r = c.local[li];
    for (size_t qi = 0; qi < np; ++qi) {
      for (int s : c.peer_ranks[qi]) {
        char* dst = outer == 1 ? static_cast<char*>(c.recv[li]) + s * inner
                               : unpacked + incoming.size() * block;
        incoming.push_back({int(li), s, m.Recv(c.peers[qi], Msg(kData, s, r), dst, block), dst});
      }
    }
  }
  size_t k = 0;
  for (size_t li = 0; li < nl; ++li) {
    const char* send = static_cast<const char*>(c.send[li]);
    for (size_t qi = 0; qi < np; ++qi) {
      for (int r : c.peer_ranks[qi]) {
        const char* src = send + r * inner;
        if (outer != 1) {
          char* p = packed + (k++) * block;
          for (size_t o = 0; o < outer; ++o) std::memcpy(p + o * inner, send + (o * n + r) * inner, inner);
          src = p;
        }
        m.Send(c.peers[qi], Msg(kData, c.local[li], r), src, block);
      }
    }
  }
  for (size_t d = 0; d < nl; ++d) {
    char* out = static_cast<char*>(c.recv[d]);
    for (size_t li = 0; li < nl; ++li) {
      const char* send = static_cast<const char*>(c.send[li]);
      for (size_t o = 0; o < outer; ++o)
        std::memcpy(out + (o * n + c.local[li]) * inner, send + (o * n + c.local[d]) * inner, inner);
    }
  }
  for (const Incoming& in : incoming) {
    SMDDP_RETURN_IF_ERROR(m.WaitRange(in.range));
    if (outer != 1) {
      char* out = static_cast<char*>(c.recv[in.to_local]);
      for (size_t o = 0; o < outer; ++o)
        std::memcpy(out + (o * n + in.from) * inner, in.dst + o * inner, inner);
    }
  }
  return m.WaitAll();
}

}  // namespace

Status RunProcessPlan(const Plan& plan, ProcessCall& call) {
  SMDDP_RETURN_IF_ERROR(CheckCallsAgree(call, plan));
  switch (plan.kind) {
    case Plan::Kind::kAllGather: return AllGatherAcross(call, plan.outer, plan.inner);
    case Plan::Kind::kReduceScatter:
      return ReduceScatterAcross(call, plan.dtype, plan.op, plan.outer, plan.inner);
    case Plan::Kind::kAllReduce: return AllReduceAcross(call, plan.dtype, plan.op, plan.count);
    case Plan::Kind::kAllToAll: return AllToAllAcross(call, plan.outer, plan.inner);
  }
  return Status::Error("jax_smddp: unknown collective plan");
}

}  // namespace smddp
