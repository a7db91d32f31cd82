#include "xla_ffi/algorithms/process_algorithms.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "xla_ffi/algorithms/messages.h"
#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/common/streaming_copy.h"  // CopyBytes

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

// What every process must agree on, sent to every peer ahead of the call's data.
struct Header {
  char op[16];
  uint64_t dtype, reduce, send_bytes, recv_bytes, size, kind, outer, inner, count;
  uint64_t hierarchical, chunk_bytes;  // how the call moves data: must agree too
};

static_assert(sizeof(Header) < 4096, "a header is one chunk (chunks are 4 KiB or more)");

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
  h.hierarchical = c.routes->hierarchical ? 1 : 0;
  h.chunk_bytes = c.chunk_bytes;
  return h;
}

std::string Describe(const Header& h) {
  std::ostringstream os;
  std::string op(h.op, strnlen(h.op, sizeof(h.op)));
  os << op << " of " << (h.dtype < 16 ? DTypeName(DType(h.dtype)) : "?") << " (" << h.send_bytes
     << " bytes in, " << h.recv_bytes << " bytes out per device";
  if (op != "all_gather" && op != "all_to_all")
    os << ", " << (h.reduce < 3 ? ReduceOpName(ReduceOp(h.reduce)) : "?");
  os << ", " << h.size << " devices; " << (h.hierarchical ? "hierarchical" : "flat") << " routes, "
     << (h.chunk_bytes ? std::to_string(h.chunk_bytes) + "-byte" : std::string("default"))
     << " chunks)";
  return os.str();
}

}  // namespace

// The agreement check's messages: this process's header, posted to every
// peer, and the receives of theirs (declared last: destroyed first, it
// withdraws what is still in flight before the headers go). Peer i's header
// is transfer i of `m`: posted first, and one chunk (a chunk is >= 4 KiB).
struct ProcessRun::Agreement final : CallWatch {
  Agreement(const ProcessCall& call, const Plan& plan)
      : c(call), mine(MakeHeader(call, plan)), theirs(call.peers.size()), m(call) {
    for (size_t i = 0; i < c.peers.size(); ++i)
      m.Recv(c.peers[i], Msg(kHeader), &theirs[i], sizeof(Header));
    for (int p : c.peers) m.Send(p, Msg(kHeader), &mine, sizeof(Header));
  }
  // Compares this process's view of the call with every peer's that arrived.
  Status Check() const override;

  const ProcessCall& c;
  const Header mine;
  std::vector<Header> theirs;
  Messages m;
};

Status ProcessRun::Agreement::Check() const {
  for (size_t i = 0; i < c.peers.size(); ++i) {
    if (m.Succeeded(i) && std::memcmp(&theirs[i], &mine, sizeof(Header)) != 0) {
      return c.Concerning(
          c.peers[i], Status::Mismatch(
                          c.where + ": processes disagree on the call: this process (process " +
                          std::to_string(c.world->process()) + ") runs " + Describe(mine) +
                          " but " + c.DescribeProcess(c.peers[i]) + " runs " + Describe(theirs[i]) +
                          ". Every process must run the same program on same-shaped inputs."));
    }
  }
  return Status::Ok();
}

namespace {

// Remote ranks in the order their blocks are awaited: those this process
// relays first, so no process waits on a relay that waits on it.
std::vector<int> GatherOrder(const ProcessCall& c) {
  const Routes& rt = *c.routes;
  std::vector<int> order;
  for (int pass = 0; pass < 2; ++pass) {
    for (int s = 0; s < c.size; ++s) {
      if (rt.gather_source[s] < 0) continue;
      if ((pass == 0) == !rt.gather_relay[s].empty()) order.push_back(s);
    }
  }
  return order;
}

// recv_r[o, s, :] = send_s[o, :] for every rank s.
Status ProcessAllGather(const ProcessCall& c, size_t outer, size_t inner) {
  const Routes& rt = *c.routes;
  const size_t n = c.size, block = outer * inner, nl = c.local.size();
  if (block == 0) return Status::Ok();
  const bool stream = c.StreamOutputs();
  Messages m(c);
  char* first = static_cast<char*>(c.recv[0]);
  // Remote ranks' blocks land in the first local rank's output when they are
  // contiguous there (outer == 1), else in staging.
  struct Incoming {
    int rank;
    Messages::Range range;
    char* dst;
  };
  std::vector<Incoming> incoming;
  const std::vector<int> order = GatherOrder(c);
  char* stage = outer == 1 ? nullptr : Scratch(order.size() * block);
  for (int s : order) {
    char* dst = outer == 1 ? first + s * inner : stage + incoming.size() * block;
    incoming.push_back({s, m.Recv(rt.gather_source[s], Msg(kData, s), dst, block), dst});
  }
  for (int q : rt.gather_targets) {
    for (size_t li = 0; li < nl; ++li) m.Send(q, Msg(kData, c.local[li]), c.send[li], block);
  }
  // This process's own blocks, while the links work.
  for (size_t d = 0; d < nl; ++d) {
    char* out = static_cast<char*>(c.recv[d]);
    for (size_t o = 0; o < outer; ++o) {
      for (size_t li = 0; li < nl; ++li) {
        CopyBytes(out + (o * n + c.local[li]) * inner,
                  static_cast<const char*>(c.send[li]) + o * inner, inner, stream);
      }
    }
  }
  for (const Incoming& in : incoming) {
    // Chunk by chunk, as it arrives: relayed on, and copied into the other
    // local outputs.
    for (size_t k = 0; k < in.range.count; ++k) {
      SMDDP_RETURN_IF_ERROR(m.Wait(in.range.first + k));
      for (int t : rt.gather_relay[in.rank]) m.SendChunk(t, Msg(kData, in.rank), block, k, in.dst);
      if (outer != 1) continue;
      size_t off, bytes;
      m.Chunk(block, k, &off, &bytes);
      for (size_t d = 1; d < nl; ++d)
        CopyBytes(static_cast<char*>(c.recv[d]) + in.rank * inner + off, in.dst + off, bytes,
                  stream);
    }
    if (outer != 1) {
      for (size_t d = 0; d < nl; ++d) {
        char* out = static_cast<char*>(c.recv[d]);
        for (size_t o = 0; o < outer; ++o)
          CopyBytes(out + (o * n + in.rank) * inner, in.dst + o * inner, inner, stream);
      }
    }
  }
  return m.WaitAll();
}

// Ranks in the order reductions handle them: remote ranks that need nothing
// received (this process's partial only), then remote ranks this process
// combines for its host, then its own ranks; each stage waits only on
// earlier stages of other processes, so none waits in a cycle.
std::vector<int> ReduceOrder(const ProcessCall& c) {
  const Routes& rt = *c.routes;
  std::vector<int> order;
  for (int pass = 0; pass < 3; ++pass) {
    for (int r = 0; r < c.size; ++r) {
      const bool local = rt.reduce_dest[r] < 0;
      const bool combines = !rt.reduce_sources[r].empty();
      const int stage = local ? 2 : (combines ? 1 : 0);
      if (stage == pass) order.push_back(r);
    }
  }
  return order;
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

// Contributions received for each rank that has sources, in staging.
struct Contributions {
  std::vector<std::vector<const char*>> buffers;     // per rank, per source
  std::vector<std::vector<Messages::Range>> ranges;  // per rank, per source

  // Posts the receives: rank r's contributions of bytes(r) each.
  template <typename Bytes>
  char* Post(const ProcessCall& c, Messages& m, uint64_t round, Bytes bytes, size_t slot_bytes,
             size_t extra_bytes) {
    const Routes& rt = *c.routes;
    size_t slots = 0;
    for (int r = 0; r < c.size; ++r) slots += rt.reduce_sources[r].size();
    char* stage = Scratch(slots * slot_bytes + extra_bytes);
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

  Status WaitChunk(Messages& m, int r, size_t k) {
    for (const auto& range : ranges[r]) SMDDP_RETURN_IF_ERROR(m.Wait(range.first + k));
    return Status::Ok();
  }
};

// recv_r[o, :] = reduce over ranks s of send_s[o, r, :]. Each rank's block is
// reduced once per process (its own ranks first), combined per host on the
// way (hierarchical routes), and completed by the rank's own process.
Status ProcessReduceScatter(const ProcessCall& c, DType dtype, ReduceOp op, size_t outer,
                            size_t inner) {
  const Routes& rt = *c.routes;
  const size_t esize = ElementSize(dtype), block = outer * inner, bb = block * esize;
  const size_t nl = c.local.size();
  if (bb == 0) return Status::Ok();
  Messages m(c);
  size_t outgoing = 0;
  for (int r = 0; r < c.size; ++r) outgoing += rt.reduce_dest[r] >= 0 ? 1 : 0;
  Contributions in;
  char* partials = in.Post(c, m, kData, [&](int) { return bb; }, bb, outgoing * bb);
  BlockReducer reducer(c, dtype, op, inner);
  const size_t chunks = m.Chunks(bb);
  size_t next_partial = 0;
  for (int r : ReduceOrder(c)) {
    const int dest = rt.reduce_dest[r];
    const bool combines = !in.buffers[r].empty();
    char* out;
    if (dest < 0) {
      out = static_cast<char*>(
          c.recv[std::lower_bound(c.local.begin(), c.local.end(), r) - c.local.begin()]);
    } else if (!combines && nl == 1 && outer == 1) {
      out = nullptr;  // the partial is the input itself
    } else {
      out = partials + (next_partial++) * bb;
    }
    const char* base = out ? out : static_cast<const char*>(c.send[0]) + r * bb;
    for (size_t k = 0; k < chunks; ++k) {
      size_t off, bytes;
      m.Chunk(bb, k, &off, &bytes);
      if (out) {
        SMDDP_RETURN_IF_ERROR(in.WaitChunk(m, r, k));
        reducer.Run(r, off / esize, (off + bytes) / esize, in.buffers[r], out);
      }
      if (dest >= 0) m.SendChunk(dest, Msg(kData, r), bb, k, base);
    }
  }
  return m.WaitAll();
}

// recv = reduce over ranks of send, balanced: shard r (the r-th of `size`
// equal parts) is reduced once, by rank r's process (combined per host on the
// way), and its result spread to every process as a gather would.
Status ProcessAllReduce(const ProcessCall& c, DType dtype, ReduceOp op, size_t count) {
  const Routes& rt = *c.routes;
  const size_t n = c.size, esize = ElementSize(dtype), nl = c.local.size();
  if (count == 0) return Status::Ok();
  const bool stream = c.StreamOutputs();
  auto begin = [&](size_t r) { return count * r / n; };
  auto shard = [&](size_t r) { return (count * (r + 1) / n - count * r / n) * esize; };
  size_t max_shard = 0, outgoing = 0;
  for (size_t r = 0; r < n; ++r) {
    max_shard = std::max(max_shard, shard(r));
    outgoing += rt.reduce_dest[r] >= 0 ? 1 : 0;
  }
  Messages m(c);
  Contributions in;
  char* partials =
      in.Post(c, m, kData, [&](int r) { return shard(r); }, max_shard, outgoing * max_shard);
  char* first = static_cast<char*>(c.recv[0]);
  struct Result {
    int rank;
    Messages::Range range;
  };
  std::vector<Result> results;
  for (int s : GatherOrder(c))
    results.push_back(
        {s, m.Recv(rt.gather_source[s], Msg(kResult, s), first + begin(s) * esize, shard(s))});
  std::vector<const void*> srcs;
  auto reduce = [&](size_t r, size_t off, size_t bytes, const std::vector<const char*>& extra,
                    char* dst) {
    srcs.clear();
    for (size_t li = 0; li < nl; ++li)
      srcs.push_back(static_cast<const char*>(c.send[li]) + begin(r) * esize + off);
    for (const char* e : extra) srcs.push_back(e + off);
    Reduce(dtype, op, srcs.data(), int(srcs.size()), dst + off, bytes / esize);
  };
  size_t next_partial = 0;
  for (int r : ReduceOrder(c)) {
    const size_t sb = shard(r);
    const int dest = rt.reduce_dest[r];
    const bool combines = !in.buffers[r].empty();
    char* out;
    int li = -1;
    if (dest < 0) {
      li = int(std::lower_bound(c.local.begin(), c.local.end(), r) - c.local.begin());
      out = static_cast<char*>(c.recv[li]) + begin(r) * esize;
    } else if (!combines && nl == 1) {
      out = nullptr;  // the partial is the input itself
    } else {
      out = partials + (next_partial++) * max_shard;
    }
    const char* base = out ? out : static_cast<const char*>(c.send[0]) + begin(r) * esize;
    for (size_t k = 0; k < m.Chunks(sb); ++k) {
      size_t off, bytes;
      m.Chunk(sb, k, &off, &bytes);
      if (out) {
        SMDDP_RETURN_IF_ERROR(in.WaitChunk(m, r, k));
        reduce(r, off, bytes, in.buffers[r], out);
      }
      if (dest >= 0) {
        m.SendChunk(dest, Msg(kData, r), sb, k, base);
        continue;
      }
      // This process's shard is final: out to the other processes, and into
      // the other local outputs.
      for (int t : rt.gather_targets) m.SendChunk(t, Msg(kResult, r), sb, k, out);
      for (size_t d = 0; d < nl; ++d) {
        if (int(d) != li)
          CopyBytes(static_cast<char*>(c.recv[d]) + begin(r) * esize + off, out + off, bytes,
                    stream);
      }
    }
  }
  for (const Result& res : results) {
    const size_t sb = shard(res.rank);
    char* base = first + begin(res.rank) * esize;
    for (size_t k = 0; k < res.range.count; ++k) {
      SMDDP_RETURN_IF_ERROR(m.Wait(res.range.first + k));
      for (int t : rt.gather_relay[res.rank]) m.SendChunk(t, Msg(kResult, res.rank), sb, k, base);
      size_t off, bytes;
      m.Chunk(sb, k, &off, &bytes);
      for (size_t d = 1; d < nl; ++d)
        CopyBytes(static_cast<char*>(c.recv[d]) + begin(res.rank) * esize + off, base + off, bytes,
                  stream);
    }
  }
  return m.WaitAll();
}

// recv_r[o, s, :] = send_s[o, r, :].
Status ProcessAllToAll(const ProcessCall& c, size_t outer, size_t inner) {
  const size_t n = c.size, nl = c.local.size(), np = c.peers.size(), block = outer * inner;
  if (block == 0) return Status::Ok();
  const bool stream = c.StreamOutputs();
  Messages m(c);
  size_t remote = 0;
  for (const auto& ranks : c.peer_ranks) remote += ranks.size();
  // With outer > 1 blocks are strided: packed and unpacked through staging.
  char* stage = outer == 1 ? nullptr : Scratch(2 * nl * remote * block);
  char* unpacked = stage;
  char* packed = stage ? stage + nl * remote * block : nullptr;
  struct Incoming {
    int to_local;
    int from;
    Messages::Range range;
    char* dst;
  };
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
          for (size_t o = 0; o < outer; ++o)
            std::memcpy(p + o * inner, send + (o * n + r) * inner, inner);
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
        CopyBytes(out + (o * n + c.local[li]) * inner, send + (o * n + c.local[d]) * inner, inner,
                  stream);
    }
  }
  for (const Incoming& in : incoming) {
    SMDDP_RETURN_IF_ERROR(m.WaitRange(in.range));
    if (outer != 1) {
      char* out = static_cast<char*>(c.recv[in.to_local]);
      for (size_t o = 0; o < outer; ++o)
        CopyBytes(out + (o * n + in.from) * inner, in.dst + o * inner, inner, stream);
    }
  }
  return m.WaitAll();
}

Status RunBody(const Plan& plan, ProcessCall& call) {
  switch (plan.kind) {
    case Plan::Kind::kAllGather:
      return ProcessAllGather(call, plan.outer, plan.inner);
    case Plan::Kind::kReduceScatter:
      return ProcessReduceScatter(call, plan.dtype, plan.op, plan.outer, plan.inner);
    case Plan::Kind::kAllReduce:
      return ProcessAllReduce(call, plan.dtype, plan.op, plan.count);
    case Plan::Kind::kAllToAll:
      return ProcessAllToAll(call, plan.outer, plan.inner);
  }
  return Status::Error("jax_smddp: unknown collective plan");
}

}  // namespace

ProcessRun::ProcessRun(const Plan& plan, ProcessCall& call)
    : plan_(plan),
      call_(call),
      start_(Clock::now()),
      agreement_(std::make_unique<Agreement>(call, plan)) {}

ProcessRun::~ProcessRun() = default;

bool ProcessRun::PeersArrived(Clock::time_point until) { return agreement_->m.PollAll(until); }

// The body starts at once, without waiting for the peers' views: data moves
// while late peers arrive. A peer that runs another call is still reported
// as such, never as what its data did to this one: the views are compared as
// they arrive while the body waits, and all of them once it is done, before
// the call may succeed; a disagreement outranks the body's own failure (a
// message of the wrong size, or a timeout waiting for one).
Status ProcessRun::Finish() {
  Agreement& a = *agreement_;
  const auto body_from = Clock::now();
  call_.watch = &a;
  const Status body = RunBody(plan_, call_);
  call_.watch = nullptr;
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
  agreement_.reset();
  if (call_.phases) {
    const auto s = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    call_.phases->agree_s = s(body_from - start_) + s(Clock::now() - body_to);
    call_.phases->body_s = s(body_to - body_from);
  }
  if (!agreed.ok()) return agreed;
  if (!body.ok()) return body;
  return st;
}

}  // namespace smddp
