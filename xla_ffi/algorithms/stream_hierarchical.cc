// The hierarchical bodies of stream_algorithms.h: groups across hosts, over
// this host's slots and the rank's network port (net_port.h).
#include "xla_ffi/algorithms/stream_algorithms.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/algorithms/stream_steps.h"

namespace smddp {
namespace {

// One rank's call of a hierarchical body, and the prologue the three bodies
// (its members) share: the call's buffers, the group's shape as this rank
// sees it, and a tile's bytes (what both a staging slot and a network slot
// hold).
struct HierarchicalCall {
  HierarchicalCall(StreamRank& local_rank, NetPort& net_port, const std::vector<int>& ranks,
                   StreamOps& stream_ops, const void* send_v, void* recv_v)
      : local(local_rank),
        port(net_port),
        rank_of(ranks),
        ops(stream_ops),
        send(static_cast<const uint8_t*>(send_v)),
        recv(static_cast<uint8_t*>(recv_v)),
        H(port.hosts),
        L(local.layout.size),
        h(port.host),
        i(local.rank),
        P(size_t(H) * L),
        net(port.layout),
        cap(std::min(local.layout.slot_bytes, net.slot_bytes)) {}

  // What every hierarchical call checks first: the group is set up for this
  // rank, and no earlier network step failed (that fails this call).
  Status Ready() const {
    if (int(rank_of.size()) != H * L || int(port.links.size()) != H || !port.proxy)
      return Status::Error("jax_smddp: hierarchical communicator is not set up for this rank");
    return port.proxy->failed() ? port.proxy->error() : Status::Ok();
  }

  // The bodies (stream_algorithms.h: RunStreamHierarchical*).
  Status AllGather(size_t outer, size_t inner);
  Status ReduceScatter(size_t outer, size_t inner, DType dtype, ReduceOp op);
  Status AllToAll(size_t outer, size_t inner);

  StreamRank& local;  // this rank among its host's ranks
  NetPort& port;
  const std::vector<int>& rank_of;  // host g's j-th rank -> group rank, at g * L + j
  StreamOps& ops;
  const uint8_t* const send;
  uint8_t* const recv;
  const int H, L, h, i;  // hosts, ranks per host, this rank's host and its rank there
  const size_t P;        // ranks in the group
  const NetLayout& net;
  const size_t cap;
};

// Starts the port's next network step (*step): its send slot is free once the
// proxy is done with the step that last used it (slots are double-buffered).
Status BeginNetworkStep(NetPort& port, StreamOps& ops, uint32_t* step) {
  const uint32_t s = *step = ++port.step;
  return s > 2 ? ops.WaitAtLeast(port.stream<uint32_t>(port.layout.done(), true), s - 2)
               : Status::Ok();
}

Status HierarchicalCall::AllGather(size_t outer, size_t inner) {
  return ForEachTile(outer, inner, 1, cap, 1, [&](const Tile& t) -> Status {
    // Network: hand this tile to the proxy (all-to-all over the rail).
    uint32_t s;
    SMDDP_RETURN_IF_ERROR(BeginNetworkStep(port, ops, &s));
    const uint8_t* mine = send + t.row * inner + t.col;
    SMDDP_RETURN_IF_ERROR(
        ops.Copy2D(port.slot_stream(net.send_slot(s)), t.width, mine, inner, t.width, t.rows));
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

Status HierarchicalCall::ReduceScatter(size_t outer, size_t inner, DType dtype, ReduceOp op) {
  const size_t E = ElementSize(dtype), inner_b = inner * E;
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
      uint8_t* dst = g == h ? port.slot_stream(net.recv_slot(h, s))
                            : port.slot_stream(net.send_slot(s)) + g * sub;
      SMDDP_RETURN_IF_ERROR(
          ops.Reduce(dst, t.width, srcs, L, L * t.width, t.width / E, t.rows, dtype, op));
      for (int j = 0; j < L; ++j) SMDDP_RETURN_IF_ERROR(st.Release(j));
    }
    // Across hosts: partial g to host g's rail peer, theirs for this host back.
    SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.posted()), s));
    port.proxy->Enqueue(&port, s, sub, /*scatter=*/true);
    for (int k = 0; k < H; ++k) {
      if (k != h)
        SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(port.stream<uint32_t>(net.arrived(k), true), s));
      srcs[k] = port.slot_stream(net.recv_slot(k, s));
    }
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv + t.row * inner_b + t.col, inner_b, srcs, H, t.width,
                                     t.width / E, t.rows, dtype, op));
    for (int k = 0; k < H; ++k) {
      if (k != h) SMDDP_RETURN_IF_ERROR(ops.Write(port.stream<uint32_t>(net.consumed(k)), s));
    }
    return Status::Ok();
  });
}

Status HierarchicalCall::AllToAll(size_t outer, size_t inner) {
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
        if (g != h)
          SMDDP_RETURN_IF_ERROR(copy_from(j, g, to_send + g * part + j * t.width, L * t.width));
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

}  // namespace

Status RunStreamHierarchicalAllGather(size_t outer, size_t inner, StreamRank& local, NetPort& port,
                                      const std::vector<int>& rank_of, StreamOps& ops,
                                      const void* send, void* recv) {
  HierarchicalCall call(local, port, rank_of, ops, send, recv);
  SMDDP_RETURN_IF_ERROR(call.Ready());
  return call.AllGather(outer, inner);
}

Status RunStreamHierarchicalReduceScatter(size_t outer, size_t inner, DType dtype, ReduceOp op,
                                          StreamRank& local, NetPort& port,
                                          const std::vector<int>& rank_of, StreamOps& ops,
                                          const void* send, void* recv) {
  HierarchicalCall call(local, port, rank_of, ops, send, recv);
  SMDDP_RETURN_IF_ERROR(call.Ready());
  return call.ReduceScatter(outer, inner, dtype, op);
}

Status RunStreamHierarchicalAllReduce(size_t count, DType dtype, ReduceOp op, StreamRank& local,
                                      NetPort& port, const std::vector<int>& rank_of,
                                      StreamOps& ops, const void* send, void* recv) {
  const size_t ranks = rank_of.size();
  if (ranks == 0 || count % ranks != 0)
    return Status::Unsupported(
        "jax_smddp (GPU): an all_reduce across hosts runs as reduce_scatter + all_gather, which "
        "needs a count divisible by the ranks (" +
        std::to_string(count) + " over " + std::to_string(ranks) + ")");
  const size_t shard = count / ranks, shard_bytes = shard * ElementSize(dtype);
  const int me = rank_of[size_t(port.host) * size_t(local.layout.size) + size_t(local.rank)];
  // This rank's shard of the output, reduced, then every shard gathered in
  // place around it.
  uint8_t* own = static_cast<uint8_t*>(recv) + size_t(me) * shard_bytes;
  SMDDP_RETURN_IF_ERROR(RunStreamHierarchicalReduceScatter(1, shard, dtype, op, local, port,
                                                           rank_of, ops, send, own));
  return RunStreamHierarchicalAllGather(1, shard_bytes, local, port, rank_of, ops, own, recv);
}

Status RunStreamHierarchicalAllToAll(size_t outer, size_t inner, StreamRank& local, NetPort& port,
                                     const std::vector<int>& rank_of, StreamOps& ops,
                                     const void* send, void* recv) {
  HierarchicalCall call(local, port, rank_of, ops, send, recv);
  SMDDP_RETURN_IF_ERROR(call.Ready());
  return call.AllToAll(outer, inner);
}

Status RunStreamHierarchicalPlan(const Plan& plan, StreamRank& local, NetPort& port,
                                 const std::vector<int>& rank_of, StreamOps& ops, const void* send,
                                 void* recv) {
  switch (plan.kind) {
    case Collective::kAllGather:
      return RunStreamHierarchicalAllGather(plan.outer, plan.inner, local, port, rank_of, ops, send,
                                            recv);
    case Collective::kReduceScatter:
      return RunStreamHierarchicalReduceScatter(plan.outer, plan.inner, plan.dtype, plan.op, local,
                                                port, rank_of, ops, send, recv);
    case Collective::kAllReduce:
      return RunStreamHierarchicalAllReduce(plan.count, plan.dtype, plan.op, local, port, rank_of,
                                            ops, send, recv);
    case Collective::kAllToAll:
      return RunStreamHierarchicalAllToAll(plan.outer, plan.inner, local, port, rank_of, ops, send,
                                           recv);
    case Collective::kCollectivePermute:
      break;  // not served (kGpuAcrossHosts)
  }
  return Status::Unsupported(std::string("jax_smddp (GPU): ") + CollectiveName(plan.kind) +
                             " has no body across hosts (" + CollectivesServedBy(kGpuAcrossHosts) +
                             " have)");
}

}  // namespace smddp
