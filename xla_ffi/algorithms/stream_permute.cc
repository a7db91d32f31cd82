// collective_permute's stream bodies (stream_algorithms.h): rank r's output is
// the input of rank sources[r] (zeros where it is -1). Every rank of the group
// runs every step, as in the other bodies, so the flags and step counters stay
// alike across ranks; only the copy from the source moves data.
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

}  // namespace smddp
