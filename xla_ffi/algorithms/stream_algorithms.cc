#include "xla_ffi/algorithms/stream_algorithms.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/algorithms/net_port.h"

namespace smddp {

RegionLayout::RegionLayout(int size_, size_t slot_bytes_) : size(size_) {
  slot_bytes = std::max<size_t>((slot_bytes_ + 255) / 256 * 256, 256);
  const size_t flags = kFlagStride * (1 + size_t(size));
  slots_offset = (flags + 4095) / 4096 * 4096;
  total_bytes = slots_offset + kSlots * slot_bytes;
}

std::vector<uint32_t*> AllFlags(const RegionLayout& layout, const std::vector<uint8_t*>& blocks) {
  std::vector<uint32_t*> flags;
  for (uint8_t* block : blocks) {
    if (!block) continue;
    flags.push_back(reinterpret_cast<uint32_t*>(block + layout.posted_offset()));
    for (int q = 0; q < layout.size; ++q)
      flags.push_back(reinterpret_cast<uint32_t*>(block + layout.consumed_offset(q)));
  }
  return flags;
}

namespace {

// A tile of a [rows x inner] byte matrix: what one step moves per rank.
struct Tile {
  size_t row, rows;  // rows of the outer dimension
  size_t col, width; // bytes within a row
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

const void** SourcesOf(StreamRank& me, size_t n) {
  if (me.sources.size() < n) me.sources.resize(n);  // once per rank and size
  return me.sources.data();
}

// The step protocol of stream_algorithms.h for one rank.
class Steps {
 public:
  Steps(StreamRank& me, StreamOps& ops) : me_(me), ops_(ops), layout_(me.layout) {}

  int size() const { return layout_.size; }
  int rank() const { return me_.rank; }
  size_t cap() const { return layout_.slot_bytes; }
  // Room for `n` reduction sources, kept by the rank across calls.
  const void** Sources(size_t n) { return SourcesOf(me_, n); }

  // Starts the next step; its slot is free once every peer consumed the step
  // that last used it.
  Status Begin(uint8_t** slot) {
    step_ = __atomic_add_fetch(&me_.step, 1, __ATOMIC_RELAXED);  // the watchdog reads it
    if (step_ > uint32_t(RegionLayout::kSlots)) {
      for (int q = 0; q < size(); ++q) {
        if (q == rank()) continue;
        SMDDP_RETURN_IF_ERROR(ops_.WaitAtLeast(Consumed(rank(), q), step_ - RegionLayout::kSlots));
      }
    }
    *slot = Slot(rank());
    return Status::Ok();
  }
  Status Post() { return ops_.Write(Posted(rank()), step_); }
  // Waits until peer q posted this step; returns its slot.
  Status Await(int q, const uint8_t** slot) {
    *slot = Slot(q);
    return q == rank() ? Status::Ok() : ops_.WaitAtLeast(Posted(q), step_);
  }
  Status Release(int q) {
    return q == rank() ? Status::Ok() : ops_.Write(Consumed(q, rank()), step_);
  }

  // Direct reads: the whole call is one step that uses no slot.
  void BeginDirect() { step_ = __atomic_add_fetch(&me_.step, 1, __ATOMIC_RELAXED); }
  Status AwaitPosted(int q) { return q == rank() ? Status::Ok() : ops_.WaitAtLeast(Posted(q), step_); }
  // Later work on this stream waits until every peer consumed this step.
  Status AwaitConsumed() {
    for (int q = 0; q < size(); ++q) {
      if (q != rank()) SMDDP_RETURN_IF_ERROR(ops_.WaitAtLeast(Consumed(rank(), q), step_));
    }
    return Status::Ok();
  }

 private:
  uint8_t* Slot(int q) const {
    return me_.regions[q] + layout_.slot_offset(int(step_ % RegionLayout::kSlots));
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
  uint32_t step_ = 0;
};

// recv[o, p, :] = send_p[o, :]
Status StagedAllGather(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                       size_t inner) {
  const int P = st.size(), me = st.rank();
  SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + me * inner, P * inner, send, inner, inner, outer));
  return ForEachTile(outer, inner, 1, st.cap(), 1, [&](const Tile& t) -> Status {
    uint8_t* mine;
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    SMDDP_RETURN_IF_ERROR(ops.Copy2D(mine, t.width, send + t.row * inner + t.col, inner, t.width, t.rows));
    SMDDP_RETURN_IF_ERROR(st.Post());
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;  // staggered so ranks do not all read one peer at once
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + (t.row * P + q) * inner + t.col, P * inner, theirs,
                                       t.width, t.width, t.rows));
      SMDDP_RETURN_IF_ERROR(st.Release(q));
    }
    return Status::Ok();
  });
}

// Posts tile t of send [outer, P, inner] as [rows, P, width] into this step's slot.
Status PostBlocks(Steps& st, StreamOps& ops, const uint8_t* send, size_t inner, const Tile& t) {
  uint8_t* mine;
  SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
  const size_t P = size_t(st.size());
  SMDDP_RETURN_IF_ERROR(ops.Copy2D(mine, t.width, send + t.row * P * inner + t.col, inner, t.width,
                                   t.rows * P));
  return st.Post();
}

// recv[o, p, :] = send_p[o, rank, :]
Status StagedAllToAll(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                      size_t inner) {
  const int P = st.size(), me = st.rank();
  SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + me * inner, P * inner, send + me * inner, P * inner,
                                   inner, outer));
  return ForEachTile(outer, inner, P, st.cap(), 1, [&](const Tile& t) -> Status {
    SMDDP_RETURN_IF_ERROR(PostBlocks(st, ops, send, inner, t));
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + (t.row * P + q) * inner + t.col, P * inner,
                                       theirs + me * t.width, P * t.width, t.width, t.rows));
      SMDDP_RETURN_IF_ERROR(st.Release(q));
    }
    return Status::Ok();
  });
}

// recv[o, :] = reduce_p send_p[o, rank, :]; inner in elements.
Status StagedReduceScatter(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                           size_t inner, DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t E = ElementSize(dtype), inner_b = inner * E;
  const void** srcs = st.Sources(P);
  return ForEachTile(outer, inner_b, P, st.cap(), E, [&](const Tile& t) -> Status {
    SMDDP_RETURN_IF_ERROR(PostBlocks(st, ops, send, inner_b, t));
    for (int q = 0; q < P; ++q) {
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      srcs[q] = theirs + me * t.width;
    }
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv + t.row * inner_b + t.col, inner_b, srcs, P,
                                     P * t.width, t.width / E, t.rows, dtype, op));
    for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
    return Status::Ok();
  });
}

// all_reduce's balanced shards: shard q is elements [q L, (q + 1) L) clipped
// to `count`. How many of them lie in [q L + j, q L + j + w).
size_t ShardElements(size_t count, size_t L, int q, size_t j, size_t w) {
  const size_t begin = std::min(count, q * L + j);
  const size_t end = std::min({count, q * L + j + w, (q + 1) * L});
  return end > begin ? end - begin : 0;
}

// recv = reduce_p send_p, balanced: rank r reduces shard r from every peer's
// slot, then every rank copies each reduced shard from its owner's slot.
Status StagedAllReduce(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t count,
                       DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t E = ElementSize(dtype);
  const size_t L = (count + P - 1) / P;
  auto valid = [&](int q, size_t j, size_t w) { return ShardElements(count, L, q, j, w); };
  const void** srcs = st.Sources(P);
  return ForEachTile(1, L * E, P, st.cap(), E, [&](const Tile& t) -> Status {
    const size_t j = t.col / E, w = t.width / E;
    uint8_t* mine;
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    for (int q = 0; q < P; ++q) {
      const size_t n = valid(q, j, w);
      if (n) SMDDP_RETURN_IF_ERROR(ops.Copy(mine + q * t.width, send + (q * L + j) * E, n * E));
    }
    SMDDP_RETURN_IF_ERROR(st.Post());
    const size_t own = valid(me, j, w);
    for (int q = 0; q < P; ++q) {
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      srcs[q] = theirs + me * t.width;
    }
    if (own) {
      SMDDP_RETURN_IF_ERROR(ops.Reduce(recv + (me * L + j) * E, own * E, srcs, P, own * E,
                                       own, 1, dtype, op));
    }
    for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
    // Spread the reduced shards like a gather.
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    if (own) SMDDP_RETURN_IF_ERROR(ops.Copy(mine, recv + (me * L + j) * E, own * E));
    SMDDP_RETURN_IF_ERROR(st.Post());
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      const size_t n = valid(q, j, w);
      if (n) SMDDP_RETURN_IF_ERROR(ops.Copy(recv + (q * L + j) * E, theirs, n * E));
      SMDDP_RETURN_IF_ERROR(st.Release(q));
    }
    return Status::Ok();
  });
}

// The direct-read forms (stream_algorithms.h): `in[q]` is rank q's input.
// Every rank posts first, so peers can start on its input while it copies its own part.
// recv[o, p, :] = in_p[o, :] (all_gather) or in_p[o, rank, :] (all_to_all).
Status DirectAllGatherOrAllToAll(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                                 uint8_t* recv, size_t outer, size_t inner, bool all_to_all) {
  const int P = st.size(), me = st.rank();
  const size_t spitch = all_to_all ? P * inner : inner;
  const size_t pick = all_to_all ? me * inner : 0;  // this rank's block within a row
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());
  for (int k = 0; k < P; ++k) {
    const int q = (me + k) % P;  // staggered so ranks do not all read one peer at once
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q));
    SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + q * inner, P * inner, in[q] + pick, spitch, inner, outer));
    SMDDP_RETURN_IF_ERROR(st.Release(q));
  }
  return st.AwaitConsumed();
}

// recv[o, :] = reduce_p in_p[o, rank, :]; inner in elements.
Status DirectReduceScatter(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                           uint8_t* recv, size_t outer, size_t inner, DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t inner_b = inner * ElementSize(dtype);
  const void** srcs = st.Sources(P);
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());
  for (int q = 0; q < P; ++q) {
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q));
    srcs[q] = in[q] + me * inner_b;
  }
  if (outer && inner)
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv, inner_b, srcs, P, P * inner_b, inner, outer, dtype, op));
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
  return st.AwaitConsumed();
}

// recv = reduce_p in_p, balanced as StagedAllReduce: rank r reduces shard r of
// every input into its own output (out[r]), then copies every other shard
// out of its owner's output.
Status DirectAllReduce(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                       const std::vector<uint8_t*>& out, size_t count, DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t E = ElementSize(dtype);
  const size_t L = (count + P - 1) / P;
  auto shard = [&](int q) { return ShardElements(count, L, q, 0, L); };
  const void** srcs = st.Sources(P);
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());  // the input is ready
  for (int q = 0; q < P; ++q) {
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q));
    srcs[q] = in[q] + me * L * E;
  }
  const size_t own = shard(me);
  if (own) SMDDP_RETURN_IF_ERROR(ops.Reduce(out[me] + me * L * E, own * E, srcs, P, own * E, own,
                                             1, dtype, op));
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());  // the reduced shard is ready
  for (int k = 1; k < P; ++k) {
    const int q = (me + k) % P;
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q));
    if (const size_t n = shard(q)) SMDDP_RETURN_IF_ERROR(ops.Copy(out[me] + q * L * E, out[q] + q * L * E, n * E));
    SMDDP_RETURN_IF_ERROR(st.Release(q));
  }
  // Peers have read this rank's input (step one) and reduced shard (step
  // two): the counters only grow, so waiting for step two covers both.
  return st.AwaitConsumed();
}

// What every hierarchical call checks first: the group is set up for this
// rank, and no earlier network step failed (that fails this call).
Status HierarchyReady(const StreamRank& local, const NetPort& port, const std::vector<int>& rank_of) {
  const int H = port.hosts, L = local.layout.size;
  if (int(rank_of.size()) != H * L || int(port.links.size()) != H || !port.proxy)
    return Status::Error("jax_smddp: hierarchical communicator is not set up for this rank");
  return port.proxy->failed() ? port.proxy->error() : Status::Ok();
}

// Starts the port's next network step (*step): its send slot is free once the
// proxy is done with the step that last used it (slots are double-buffered).
Status BeginNetworkStep(NetPort& port, StreamOps& ops, uint32_t* step) {
  const uint32_t s = *step = ++port.step;
  return s > 2 ? ops.WaitAtLeast(port.stream<uint32_t>(port.layout.done(), true), s - 2) : Status::Ok();
}

}  // namespace

bool DirectReadsNeedOutputs(Plan::Kind kind) { return kind == Plan::Kind::kAllReduce; }

Status ReleaseEveryoneWaitingOn(const StreamRank& me, StreamOps& ops) {
  const RegionLayout& layout = me.layout;
  auto block = [&](int q) { return me.flags.empty() ? me.regions[q] : me.flags[q]; };
  const uint32_t released = ReleasedFlag(me.step);
  SMDDP_RETURN_IF_ERROR(ops.Write(reinterpret_cast<uint32_t*>(block(me.rank) + layout.posted_offset()),
                                  released));
  for (int q = 0; q < layout.size; ++q) {
    if (q == me.rank || !block(q)) continue;
    SMDDP_RETURN_IF_ERROR(ops.Write(
        reinterpret_cast<uint32_t*>(block(q) + layout.consumed_offset(me.rank)), released));
  }
  return Status::Ok();
}

Status RunStreamHierarchicalAllGather(size_t outer, size_t inner, StreamRank& local, NetPort& port,
                                      const std::vector<int>& rank_of, StreamOps& ops,
                                      const void* send_v, void* recv_v) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  const int H = port.hosts, L = local.layout.size, h = port.host, i = local.rank;
  const size_t P = size_t(H) * L;
  SMDDP_RETURN_IF_ERROR(HierarchyReady(local, port, rank_of));
  const NetLayout& net = port.layout;
  const size_t cap = std::min(local.layout.slot_bytes, net.slot_bytes);
  return ForEachTile(outer, inner, 1, cap, 1, [&](const Tile& t) -> Status {
    // Network: hand this tile to the proxy (all-to-all over the rail).
    uint32_t s;
    SMDDP_RETURN_IF_ERROR(BeginNetworkStep(port, ops, &s));
    const uint8_t* mine = send + t.row * inner + t.col;
    SMDDP_RETURN_IF_ERROR(ops.Copy2D(port.slot_stream(net.send_slot(s)), t.width, mine, inner, t.width, t.rows));
    SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.posted()), s));
    port.proxy->Enqueue(&port, s, t.rows * t.width);
    // Inside the host, host by host (the same order on every rank).
    for (int g = 0; g < H; ++g) {
      const uint8_t* src = mine;
      size_t spitch = inner;
      if (g != h) {
        SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(port.stream<uint32_t>(net.arrived(g), true), s));
        src = port.slot_stream(net.recv_slot(g, s));
        spitch = t.width;
      }
      auto out = [&](int j) { return recv + (t.row * P + rank_of[g * L + j]) * inner + t.col; };
      SMDDP_RETURN_IF_ERROR(ops.Copy2D(out(i), P * inner, src, spitch, t.width, t.rows));
      if (L > 1) {
        Steps st(local, ops);
        uint8_t* slot;
        SMDDP_RETURN_IF_ERROR(st.Begin(&slot));
        SMDDP_RETURN_IF_ERROR(ops.Copy2D(slot, t.width, src, spitch, t.width, t.rows));
        SMDDP_RETURN_IF_ERROR(st.Post());
        if (g != h) SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.consumed(g)), s));
        for (int k = 1; k < L; ++k) {
          const int j = (i + k) % L;
          const uint8_t* theirs;
          SMDDP_RETURN_IF_ERROR(st.Await(j, &theirs));
          SMDDP_RETURN_IF_ERROR(ops.Copy2D(out(j), P * inner, theirs, t.width, t.width, t.rows));
          SMDDP_RETURN_IF_ERROR(st.Release(j));
        }
      } else if (g != h) {
        SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.consumed(g)), s));
      }
    }
    return Status::Ok();
  });
}

Status RunStreamHierarchicalReduceScatter(size_t outer, size_t inner, DType dtype, ReduceOp op,
                                          StreamRank& local, NetPort& port,
                                          const std::vector<int>& rank_of, StreamOps& ops,
                                          const void* send_v, void* recv_v) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  const int H = port.hosts, L = local.layout.size, h = port.host, i = local.rank;
  const size_t P = size_t(H) * L, E = ElementSize(dtype), inner_b = inner * E;
  SMDDP_RETURN_IF_ERROR(HierarchyReady(local, port, rank_of));
  const NetLayout& net = port.layout;
  const size_t cap = std::min(local.layout.slot_bytes, net.slot_bytes);
  const void** srcs = SourcesOf(local, size_t(std::max(H, L)));
  return ForEachTile(outer, inner_b, size_t(std::max(H, L)), cap, E, [&](const Tile& t) -> Status {
    uint32_t s;
    SMDDP_RETURN_IF_ERROR(BeginNetworkStep(port, ops, &s));
    const size_t sub = t.rows * t.width;  // one destination's part of this tile
    // Inside the host: the partial sum of each host's blocks for rail i.
    for (int g = 0; g < H; ++g) {
      Steps st(local, ops);
      uint8_t* slot;
      SMDDP_RETURN_IF_ERROR(st.Begin(&slot));
      for (int j = 0; j < L; ++j) {  // [rows, L, width]: host g's rails' blocks
        const int q = rank_of[g * L + j];
        SMDDP_RETURN_IF_ERROR(ops.Copy2D(slot + j * t.width, L * t.width,
                                         send + (t.row * P + q) * inner_b + t.col, P * inner_b,
                                         t.width, t.rows));
      }
      SMDDP_RETURN_IF_ERROR(st.Post());
      for (int j = 0; j < L; ++j) {
        const uint8_t* theirs;
        SMDDP_RETURN_IF_ERROR(st.Await(j, &theirs));
        srcs[j] = theirs + i * t.width;
      }
      // This host's own partial waits in its (unused) receive slot.
      uint8_t* dst = g == h ? port.slot_stream(net.recv_slot(h, s)) : port.slot_stream(net.send_slot(s)) + g * sub;
      SMDDP_RETURN_IF_ERROR(ops.Reduce(dst, t.width, srcs, L, L * t.width, t.width / E,
                                       t.rows, dtype, op));
      for (int j = 0; j < L; ++j) SMDDP_RETURN_IF_ERROR(st.Release(j));
    }
    // Across hosts: partial g to host g's rail peer, theirs for this host back.
    SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.posted()), s));
    port.proxy->Enqueue(&port, s, sub, /*scatter=*/true);
    for (int k = 0; k < H; ++k) {
      if (k != h) SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(port.stream<uint32_t>(net.arrived(k), true), s));
      srcs[k] = port.slot_stream(net.recv_slot(k, s));
    }
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv + t.row * inner_b + t.col, inner_b, srcs, H,
                                     t.width, t.width / E, t.rows, dtype, op));
    for (int k = 0; k < H; ++k) {
      if (k != h) SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.consumed(k)), s));
    }
    return Status::Ok();
  });
}

Status RunStreamHierarchicalAllToAll(size_t outer, size_t inner, StreamRank& local, NetPort& port,
                                     const std::vector<int>& rank_of, StreamOps& ops,
                                     const void* send_v, void* recv_v) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  const int H = port.hosts, L = local.layout.size, h = port.host, i = local.rank;
  const size_t P = size_t(H) * L;
  SMDDP_RETURN_IF_ERROR(HierarchyReady(local, port, rank_of));
  const NetLayout& net = port.layout;
  const size_t cap = std::min(local.layout.slot_bytes, net.slot_bytes);
  // Local rank j's posted slot (this rank's own blocks are read from `send`).
  const void** posted = SourcesOf(local, size_t(L));
  // A tile moves every block once, so it is sized for all P of them.
  return ForEachTile(outer, inner, P, cap, 1, [&](const Tile& t) -> Status {
    uint32_t s;
    SMDDP_RETURN_IF_ERROR(BeginNetworkStep(port, ops, &s));
    const size_t part = t.rows * L * t.width;  // one host's part: [rows, L, width]
    auto block = [&](int g, int k) {  // this rank's block for rank (g, k); row pitch P * inner
      return send + (t.row * P + rank_of[g * L + k]) * inner + t.col;
    };
    auto out = [&](int q) { return recv + (t.row * P + q) * inner + t.col; };  // pitch P * inner
    // Rank (h, j)'s block for rank (g, i): from `send` or from j's slot,
    // where it posted its blocks as [H, rows, L, width].
    auto copy_from = [&](int j, int g, uint8_t* dst, size_t dpitch) -> Status {
      if (j == i) return ops.Copy2D(dst, dpitch, block(g, i), P * inner, t.width, t.rows);
      const auto* theirs = static_cast<const uint8_t*>(posted[j]);
      return ops.Copy2D(dst, dpitch, theirs + g * part + i * t.width, L * t.width, t.width, t.rows);
    };
    Steps st(local, ops);
    if (L > 1) {
      uint8_t* slot;  // [H, rows, L, width]: block (g, k) where rank k of this host reads it
      SMDDP_RETURN_IF_ERROR(st.Begin(&slot));
      for (int g = 0; g < H; ++g) {
        for (int k = 0; k < L; ++k) {
          if (k == i) continue;  // this rank reads its own blocks from `send`
          SMDDP_RETURN_IF_ERROR(ops.Copy2D(slot + g * part + k * t.width, L * t.width, block(g, k),
                                           P * inner, t.width, t.rows));
        }
      }
      SMDDP_RETURN_IF_ERROR(st.Post());
    }
    // The other hosts' parts first, so the network starts before this host's own blocks move.
    uint8_t* to_send = port.slot_stream(net.send_slot(s));
    for (int k = 0; k < L; ++k) {
      const int j = (i + k) % L;  // staggered so ranks do not all read one peer at once
      if (j != i) {
        const uint8_t* theirs;
        SMDDP_RETURN_IF_ERROR(st.Await(j, &theirs));
        posted[j] = theirs;
      }
      for (int g = 0; g < H; ++g) {
        if (g != h) SMDDP_RETURN_IF_ERROR(copy_from(j, g, to_send + g * part + j * t.width, L * t.width));
      }
    }
    SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.posted()), s));
    port.proxy->Enqueue(&port, s, part, /*scatter=*/true);
    for (int k = 0; k < L; ++k) {
      const int j = (i + k) % L;
      SMDDP_RETURN_IF_ERROR(copy_from(j, h, out(rank_of[h * L + j]), P * inner));
      if (j != i) SMDDP_RETURN_IF_ERROR(st.Release(j));
    }
    // Host g's part: rank (g, j)'s block for this rank at j.
    for (int g = 0; g < H; ++g) {
      if (g == h) continue;
      SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(port.stream<uint32_t>(net.arrived(g), true), s));
      const uint8_t* arrived = port.slot_stream(net.recv_slot(g, s));
      for (int j = 0; j < L; ++j) {
        SMDDP_RETURN_IF_ERROR(ops.Copy2D(out(rank_of[g * L + j]), P * inner, arrived + j * t.width,
                                         L * t.width, t.width, t.rows));
      }
      SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.consumed(g)), s));
    }
    return Status::Ok();
  });
}

Status RunStreamPlan(const Plan& plan, StreamRank& me, StreamOps& ops, const void* send_v,
                     void* recv_v) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  if (int(me.regions.size()) != me.layout.size || me.rank < 0 || me.rank >= me.layout.size ||
      !(me.flags.empty() || int(me.flags.size()) == me.layout.size))
    return Status::Error("jax_smddp: stream communicator is not set up for this rank");
  if (me.layout.size == 1) {  // a group of one: the output is the input, one copy, no staging
    const size_t bytes = plan.kind == Plan::Kind::kAllReduce
                             ? plan.count * ElementSize(plan.dtype)
                             : plan.outer * plan.inner *
                                   (plan.kind == Plan::Kind::kReduceScatter ? ElementSize(plan.dtype) : 1);
    return bytes ? ops.Copy(recv, send, bytes) : Status::Ok();
  }
  Steps steps(me, ops);
  if (!me.inputs.empty()) {
    const size_t P = size_t(me.layout.size);
    if (me.inputs.size() != P || me.inputs[me.rank] != send ||
        (DirectReadsNeedOutputs(plan.kind) && (me.outputs.size() != P || me.outputs[me.rank] != recv)))
      return Status::Error("jax_smddp: direct reads need every rank's buffers of this call");
    switch (plan.kind) {
      case Plan::Kind::kAllGather:
      case Plan::Kind::kAllToAll:
        return DirectAllGatherOrAllToAll(steps, ops, me.inputs, recv, plan.outer, plan.inner,
                                         plan.kind == Plan::Kind::kAllToAll);
      case Plan::Kind::kReduceScatter:
        return DirectReduceScatter(steps, ops, me.inputs, recv, plan.outer, plan.inner, plan.dtype, plan.op);
      case Plan::Kind::kAllReduce:
        return DirectAllReduce(steps, ops, me.inputs, me.outputs, plan.count, plan.dtype, plan.op);
    }
  }
  switch (plan.kind) {
    case Plan::Kind::kAllGather:
      return StagedAllGather(steps, ops, send, recv, plan.outer, plan.inner);
    case Plan::Kind::kAllToAll:
      return StagedAllToAll(steps, ops, send, recv, plan.outer, plan.inner);
    case Plan::Kind::kReduceScatter:
      return StagedReduceScatter(steps, ops, send, recv, plan.outer, plan.inner, plan.dtype, plan.op);
    case Plan::Kind::kAllReduce:
      return StagedAllReduce(steps, ops, send, recv, plan.count, plan.dtype, plan.op);
  }
  return Status::Error("jax_smddp: unknown collective kind");
}

}  // namespace smddp
