// The direct-read bodies of stream_algorithms.h: the peers' buffers read in place.
#include "xla_ffi/algorithms/stream_steps.h"

namespace smddp {

// The direct-read forms (stream_algorithms.h): `in[q]` is rank q's input.
// Every rank posts first, so peers can start on its input while it copies its own part.
// Each source has a lane of its own (StreamOps::Lane), joined back before the
// end: a peer's copy waits for that peer alone, the copies of different peers
// run at once, and the rank's own part waits for none.
// recv[o, p, :] = in_p[o, :] (all_gather) or in_p[o, rank, :] (all_to_all).
Status DirectAllGatherOrAllToAll(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                                 uint8_t* recv, size_t outer, size_t inner, bool all_to_all) {
  const int P = st.size(), me = st.rank();
  const size_t spitch = all_to_all ? P * inner : inner;
  const size_t pick = all_to_all ? me * inner : 0;  // this rank's block within a row
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());
  SMDDP_RETURN_IF_ERROR(ops.Fork(P));
  for (int k = 0; k < P; ++k) {
    const int q = (me + k) % P;  // staggered so ranks do not all read one peer at once
    StreamOps& lane = ops.Lane(k);
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q, lane));
    SMDDP_RETURN_IF_ERROR(
        lane.Copy2D(recv + q * inner, P * inner, in[q] + pick, spitch, inner, outer));
    SMDDP_RETURN_IF_ERROR(st.ReleaseDirect(q, lane));  // after its copy, on its lane
  }
  SMDDP_RETURN_IF_ERROR(ops.Join());
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
  SMDDP_RETURN_IF_ERROR(st.AwaitAllPosted());
  for (int q = 0; q < P; ++q) srcs[q] = in[q] + me * inner_b;
  if (outer && inner)
    SMDDP_RETURN_IF_ERROR(ops.Reduce(recv, inner_b, srcs, P, P * inner_b, inner, outer, dtype, op));
  SMDDP_RETURN_IF_ERROR(st.ReleaseAll());
  return st.AwaitConsumed();
}

// recv = reduce_p in_p in one round: rank r reduces shard r of every input
// and stores it into every rank's output (out[q], posted: XLA gave q's
// stream that buffer for this call) from the one kernel. A rank's output is
// whole once every peer released it, which AwaitConsumed waits for; that
// also covers the peers' reads of its input.
Status DirectAllReduce(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                       const std::vector<uint8_t*>& out, size_t count, DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t E = ElementSize(dtype);
  const size_t L = (count + P - 1) / P;
  const size_t own = ShardElements(count, L, me, 0, L);
  const void** srcs = st.Sources(2 * size_t(P));
  void** dsts = const_cast<void**>(srcs + P);  // the rank's room holds both lists
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());  // the input is ready and the output free
  SMDDP_RETURN_IF_ERROR(st.AwaitAllPosted());
  for (int k = 0; k < P; ++k) {
    const int q = (me + k) % P;  // own output first: the peers' shards land after it
    srcs[q] = in[q] + me * L * E;
    dsts[k] = out[q] + me * L * E;
  }
  if (own) SMDDP_RETURN_IF_ERROR(ops.ReduceToEach(dsts, P, srcs, P, own, dtype, op));
  SMDDP_RETURN_IF_ERROR(st.ReleaseAll());
  return st.AwaitConsumed();
}

// The device exchange (stream_algorithms.h: DeviceExchange). The entry is
// written before the post on the same stream: a peer that saw the post reads
// this call's entry (Resolve faults on another call's).
Status DevicePost(Steps& st, StreamOps& ops) {
  StreamRank& me = st.me();
  me.device.entry[0] = st.step();
  auto* mailbox =
      reinterpret_cast<uint64_t*>(me.regions[me.rank] + me.layout.mailbox_offset(st.step()));
  SMDDP_RETURN_IF_ERROR(ops.WriteWords(mailbox, me.device.entry, kMailboxWords));
  return st.Post();
}

uint64_t* DeviceResolved(Steps& st, int q, int which) {
  StreamRank& me = st.me();
  return reinterpret_cast<uint64_t*>(me.regions[me.rank] + me.layout.resolved_offset()) +
         size_t(which) * me.layout.size + q;
}

Status DeviceResolve(Steps& st, StreamOps& on, int q, int which) {
  StreamRank& me = st.me();
  const auto* entry =
      reinterpret_cast<const uint64_t*>(me.regions[q] + me.layout.mailbox_offset(st.step()));
  const uint64_t* table = q == me.rank ? nullptr : me.device.tables[q];
  const uint8_t* flags = me.flags.empty() ? me.regions[q] : me.flags[q];
  const auto* posted = reinterpret_cast<const uint32_t*>(flags + me.layout.posted_offset());
  return on.Resolve(DeviceResolved(st, q, which), entry, st.step(), which, table,
                    me.device.released, posted);
}

Status DeviceAllGatherOrAllToAll(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                                 size_t outer, size_t inner, bool all_to_all) {
  const int P = st.size(), me = st.rank();
  const size_t spitch = all_to_all ? P * inner : inner;
  const size_t pick = all_to_all ? me * inner : 0;
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(DevicePost(st, ops));
  SMDDP_RETURN_IF_ERROR(ops.Fork(P));
  for (int k = 0; k < P; ++k) {
    const int q = (me + k) % P;
    StreamOps& lane = ops.Lane(k);
    if (q == me) {
      SMDDP_RETURN_IF_ERROR(
          lane.Copy2D(recv + q * inner, P * inner, send + pick, spitch, inner, outer));
      continue;
    }
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q, lane));
    SMDDP_RETURN_IF_ERROR(DeviceResolve(st, lane, q, 0));
    SMDDP_RETURN_IF_ERROR(lane.Copy2DFrom(recv + q * inner, P * inner, DeviceResolved(st, q, 0),
                                          pick, spitch, inner, outer));
    SMDDP_RETURN_IF_ERROR(st.ReleaseDirect(q, lane));
  }
  SMDDP_RETURN_IF_ERROR(ops.Join());
  return st.AwaitConsumed();
}

Status DeviceReduceScatter(Steps& st, StreamOps& ops, uint8_t* recv, size_t outer, size_t inner,
                           DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t inner_b = inner * ElementSize(dtype);
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(DevicePost(st, ops));
  SMDDP_RETURN_IF_ERROR(st.AwaitAllPosted());
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(DeviceResolve(st, ops, q, 0));
  if (outer && inner)
    SMDDP_RETURN_IF_ERROR(ops.ReduceFrom(nullptr, 1, size_t(recv), inner_b,
                                         DeviceResolved(st, 0, 0), P, me * inner_b, P * inner_b,
                                         inner, outer, dtype, op));
  SMDDP_RETURN_IF_ERROR(st.ReleaseAll());
  return st.AwaitConsumed();
}

Status DeviceAllReduce(Steps& st, StreamOps& ops, size_t count, DType dtype, ReduceOp op) {
  const int P = st.size(), me = st.rank();
  const size_t E = ElementSize(dtype);
  const size_t L = (count + P - 1) / P;
  const size_t own = ShardElements(count, L, me, 0, L);
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(DevicePost(st, ops));  // the input is ready and the output free
  SMDDP_RETURN_IF_ERROR(st.AwaitAllPosted());
  for (int q = 0; q < P; ++q) {
    SMDDP_RETURN_IF_ERROR(DeviceResolve(st, ops, q, 0));
    SMDDP_RETURN_IF_ERROR(DeviceResolve(st, ops, q, 1));
  }
  if (own)
    SMDDP_RETURN_IF_ERROR(ops.ReduceFrom(DeviceResolved(st, 0, 1), P, me * L * E, own * E,
                                         DeviceResolved(st, 0, 0), P, me * L * E, own * E, own, 1,
                                         dtype, op));
  SMDDP_RETURN_IF_ERROR(st.ReleaseAll());
  return st.AwaitConsumed();
}

}  // namespace smddp
