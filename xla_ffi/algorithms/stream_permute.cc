// collective_permute's stream bodies (stream_algorithms.h): rank r's output is
// the input of rank sources[r] (zeros where it is -1). Every rank of the group
// runs every step, as in the other bodies, so the flags and step counters stay
// alike across ranks; only the copy from the source moves data. And
// RunStreamPairPermute, where only the pairs take part (the NCCL front end).
#include "xla_ffi/algorithms/stream_steps.h"

namespace smddp {

namespace {

// The output of a rank whose source is none or itself: no peer involved.
Status LocalPart(StreamOps& ops, const uint8_t* send, uint8_t* recv, size_t bytes, int64_t source,
                 int me) {
  if (source < 0) return ops.Zero(recv, bytes);
  if (source == me && bytes) return ops.Copy(recv, send, bytes);
  return Status::Ok();
}

}  // namespace

Status DirectCollectivePermute(Steps& st, StreamOps& ops, const std::vector<const uint8_t*>& in,
                               uint8_t* recv, size_t bytes, int64_t source) {
  const int P = st.size(), me = st.rank();
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(st.Post());  // the input is ready for the rank it goes to
  SMDDP_RETURN_IF_ERROR(LocalPart(ops, in[me], recv, bytes, source, me));
  if (source >= 0 && source != me) {
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(int(source)));
    if (bytes) SMDDP_RETURN_IF_ERROR(ops.Copy(recv, in[source], bytes));
  }
  // Every peer's input is done with: read (the source, in stream order after
  // its copy) or never needed.
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
  return st.AwaitConsumed();
}

Status DeviceCollectivePermute(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                               size_t bytes, int64_t source) {
  const int P = st.size(), me = st.rank();
  st.BeginDirect();
  SMDDP_RETURN_IF_ERROR(DevicePost(st, ops));  // the input is ready for the rank it goes to
  SMDDP_RETURN_IF_ERROR(LocalPart(ops, send, recv, bytes, source, me));
  if (source >= 0 && source != me) {
    SMDDP_RETURN_IF_ERROR(st.AwaitPosted(int(source)));
    SMDDP_RETURN_IF_ERROR(DeviceResolve(st, ops, int(source), 0));
    if (bytes)
      SMDDP_RETURN_IF_ERROR(
          ops.Copy2DFrom(recv, bytes, DeviceResolved(st, int(source), 0), 0, bytes, bytes, 1));
  }
  for (int q = 0; q < P; ++q) SMDDP_RETURN_IF_ERROR(st.Release(q));
  return st.AwaitConsumed();
}

Status StagedCollectivePermute(Steps& st, StreamOps& ops, const uint8_t* send, uint8_t* recv,
                               size_t bytes, int64_t source, bool sends) {
  const int P = st.size(), me = st.rank();
  SMDDP_RETURN_IF_ERROR(LocalPart(ops, send, recv, bytes, source, me));
  return ForEachTile(1, bytes, 1, st.cap(), 1, [&](const Tile& t) -> Status {
    uint8_t* mine;
    SMDDP_RETURN_IF_ERROR(st.Begin(&mine));
    if (sends) SMDDP_RETURN_IF_ERROR(ops.Copy(mine, send + t.col, t.width));
    SMDDP_RETURN_IF_ERROR(st.Post());
    // Every peer's step is awaited and released (replayable calls clear its
    // token), whether or not this rank reads it.
    for (int k = 1; k < P; ++k) {
      const int q = (me + k) % P;
      const uint8_t* theirs;
      SMDDP_RETURN_IF_ERROR(st.Await(q, &theirs));
      if (q == source) SMDDP_RETURN_IF_ERROR(ops.Copy(recv + t.col, theirs, t.width));
      SMDDP_RETURN_IF_ERROR(st.Release(q));
    }
    return Status::Ok();
  });
}

Status RunStreamPairPermute(StreamRank& me, StreamOps& ops, const void* send_v, void* recv_v,
                            size_t bytes, int target, int source) {
  const auto* send = static_cast<const uint8_t*>(send_v);
  auto* recv = static_cast<uint8_t*>(recv_v);
  const RegionLayout& layout = me.layout;
  const int P = layout.size, r = me.rank;
  if (int(me.regions.size()) != P || r < 0 || r >= P ||
      !(me.flags.empty() || int(me.flags.size()) == P))
    return Status::Error("jax_smddp: stream communicator is not set up for this rank");
  if (target < -1 || target >= P || source < -1 || source >= P || (target == r) != (source == r))
    return Status::InvalidArgument("jax_smddp: collective_permute's peers are not a permutation");
  if (target == r) return bytes ? ops.Copy(recv, send, bytes) : Status::Ok();
  if (me.pair_sent.size() != size_t(P)) me.pair_sent.assign(P, 0);
  if (me.pair_received.size() != size_t(P)) me.pair_received.assign(P, 0);
  auto flag = [&](int owner, size_t offset) {
    return reinterpret_cast<uint32_t*>((me.flags.empty() ? me.regions[owner] : me.flags[owner]) +
                                       offset);
  };
  constexpr int kSlots = RegionLayout::kSlots;
  if (target >= 0 && me.step > 0) {
    // The group's last step may still be read out of this rank's slots.
    for (int q = 0; q < P; ++q) {
      if (q != r)
        SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(flag(r, layout.consumed_offset(q)), me.step));
    }
  }
  SMDDP_RETURN_IF_ERROR(ForEachTile(1, bytes, 1, layout.slot_bytes, 1, [&](const Tile& t) {
    if (target >= 0) {  // post the tile into slot (count % kSlots), once the target freed it
      const uint32_t c = ++me.pair_sent[target];
      if (c > uint32_t(kSlots))
        SMDDP_RETURN_IF_ERROR(
            ops.WaitAtLeast(flag(r, layout.pair_consumed_offset(target)), c - kSlots));
      SMDDP_RETURN_IF_ERROR(
          ops.Copy(me.regions[r] + layout.slot_offset(int(c % kSlots)), send + t.col, t.width));
      SMDDP_RETURN_IF_ERROR(ops.Write(flag(target, layout.pair_posted_offset(r)), c));
    }
    if (source >= 0) {  // take the source's tile once it is posted
      const uint32_t c = ++me.pair_received[source];
      SMDDP_RETURN_IF_ERROR(ops.WaitAtLeast(flag(r, layout.pair_posted_offset(source)), c));
      SMDDP_RETURN_IF_ERROR(ops.Copy(
          recv + t.col, me.regions[source] + layout.slot_offset(int(c % kSlots)), t.width));
      SMDDP_RETURN_IF_ERROR(ops.Write(flag(source, layout.pair_consumed_offset(r)), c));
    }
    return Status::Ok();
  }));
  if (target >= 0 && me.pair_sent[target] > 0)
    return ops.WaitAtLeast(flag(r, layout.pair_consumed_offset(target)), me.pair_sent[target]);
  return Status::Ok();
}

}  // namespace smddp
