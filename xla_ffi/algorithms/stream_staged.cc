// The staged bodies of stream_algorithms.h: every byte through the slots.
#include "xla_ffi/algorithms/stream_steps.h"

#include <algorithm>

namespace smddp {

// In each step a rank reads its peers' slots on a lane per peer (Steps::ForkPeers),
// joined back before the next step: a copy waits for its peer alone and the
// copies of different peers run at once.

// recv[o, p, :] = send_p[o, :]
Status StagedAllGather(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                       size_t inner) {
  const int P = st.size(), me = st.rank();
  SMDDP_RETURN_IF_ERROR(ops.Copy2D(recv + me * inner, P * inner, send, inner, inner, outer));
  return ForEachTile(outer, inner, 1, st.cap(), 1, [&](const Tile& t) -> Status {
    uint8_t* mine;
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    SMDDP_RETURN_IF_ERROR(
        ops.Copy2D(mine, t.width, send + t.row * inner + t.col, inner, t.width, t.rows));
    SMDDP_RETURN_IF_ERROR(st.Post());
    SMDDP_RETURN_IF_ERROR(st.ForkPeers(P - 1));
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;  // staggered so ranks do not all read one peer at once
      StreamOps& lane = st.PeerLane(k - 1);
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs, lane));
      SMDDP_RETURN_IF_ERROR(lane.Copy2D(recv + (t.row * P + q) * inner + t.col, P * inner, theirs,
                                        t.width, t.width, t.rows));
      SMDDP_RETURN_IF_ERROR(st.Release(q, lane));
    }
    return st.JoinPeers();
  });
}

namespace {

// Posts tile t of send [outer, P, inner] as [rows, P, width] into this step's slot.
Status PostBlocks(Steps& st, StreamOps& ops, const uint8_t* send, size_t inner, const Tile& t) {
  uint8_t* mine;
  SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
  const size_t P = size_t(st.size());
  SMDDP_RETURN_IF_ERROR(
      ops.Copy2D(mine, t.width, send + t.row * P * inner + t.col, inner, t.width, t.rows * P));
  return st.Post();
}

}  // namespace

// recv[o, p, :] = send_p[o, rank, :]
Status StagedAllToAll(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t outer,
                      size_t inner) {
  const int P = st.size(), me = st.rank();
  SMDDP_RETURN_IF_ERROR(
      ops.Copy2D(recv + me * inner, P * inner, send + me * inner, P * inner, inner, outer));
  return ForEachTile(outer, inner, P, st.cap(), 1, [&](const Tile& t) -> Status {
    SMDDP_RETURN_IF_ERROR(PostBlocks(st, ops, send, inner, t));
    SMDDP_RETURN_IF_ERROR(st.ForkPeers(P - 1));
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;
      StreamOps& lane = st.PeerLane(k - 1);
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs, lane));
      SMDDP_RETURN_IF_ERROR(lane.Copy2D(recv + (t.row * P + q) * inner + t.col, P * inner,
                                        theirs + me * t.width, P * t.width, t.width, t.rows));
      SMDDP_RETURN_IF_ERROR(st.Release(q, lane));
    }
    SMDDP_RETURN_IF_ERROR(st.JoinPeers());
    return Status::Ok();
  });
}

// recv[o, :] = reduce_p send_p[o, rank, :]; inner in elements.
Status StagedReduceScatter(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                           size_t outer, size_t inner, DType dtype, ReduceOp op) {
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
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv + t.row * inner_b + t.col, inner_b, srcs, P, P * t.width,
                                     t.width / E, t.rows, dtype, op));
    for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
    return Status::Ok();
  });
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
      SMDDP_RETURN_IF_ERROR(
          ops.Reduce(recv + (me * L + j) * E, own * E, srcs, P, own * E, own, 1, dtype, op));
    }
    for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
    // Spread the reduced shards like a gather.
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    if (own) SMDDP_RETURN_IF_ERROR(ops.Copy(mine, recv + (me * L + j) * E, own * E));
    SMDDP_RETURN_IF_ERROR(st.Post());
    SMDDP_RETURN_IF_ERROR(st.ForkPeers(P - 1));
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;
      StreamOps& lane = st.PeerLane(k - 1);
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs, lane));
      const size_t n = valid(q, j, w);
      if (n) SMDDP_RETURN_IF_ERROR(lane.Copy(recv + (q * L + j) * E, theirs, n * E));
      SMDDP_RETURN_IF_ERROR(st.Release(q, lane));
    }
    return st.JoinPeers();
  });
}

}  // namespace smddp
