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
  if (own)
    SMDDP_RETURN_IF_ERROR(
        ops.Reduce(out[me] + me * L * E, own * E, srcs, P, own * E, own, 1, dtype, op));
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());        // the reduced shard is ready
  SMDDP_RETURN_IF_ERROR(ops.Fork(P - 1));  // a lane per peer, as DirectAllGatherOrAllToAll
  for (int k = 1; k < P; ++k) {
    const int q = (me + k) % P;
    StreamOps& lane = ops.Lane(k - 1);
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(q, lane));
    if (const size_t n = shard(q))
      SMDDP_RETURN_IF_ERROR(lane.Copy(out[me] + q * L * E, out[q] + q * L * E, n * E));
    SMDDP_RETURN_IF_ERROR(st.ReleaseDirect(q, lane));
  }
  SMDDP_RETURN_IF_ERROR(ops.Join());
  // Peers have read this rank's input (step one) and reduced shard (step
  // two): the counters only grow, so waiting for step two covers both.
  return st.AwaitConsumed();
}

}  // namespace smddp
