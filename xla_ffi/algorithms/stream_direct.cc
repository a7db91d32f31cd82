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

}  // namespace smddp
