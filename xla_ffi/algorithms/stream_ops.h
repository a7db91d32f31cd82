// What a stream-ordered collective asks of the memory it runs on: copies,
// reductions and 32-bit flags that peers can read and write. On a GPU every
// call only enqueues work on the caller's stream and returns
// (cuda/cuda_stream_ops.h); the host implementation (tests/native/host_stream_ops.h) runs
// each call at once, so the same algorithms (stream_algorithms.h) are tested
// on CPU threads.
#ifndef JAX_SMDDP_ALGORITHMS_STREAM_OPS_H_
#define JAX_SMDDP_ALGORITHMS_STREAM_OPS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla_ffi/common/dtype.h"
#include "xla_ffi/common/status.h"

namespace smddp {

// Step flags compare as CUDA's stream memory operations compare them
// (CU_STREAM_WAIT_VALUE_GEQ): cyclically, (int32_t)(flag - value) >= 0, so
// that the counters may wrap. UINT32_MAX is therefore not "largest": a flag
// is released (no stream waits on it) by moving it kReleaseDistance ahead of
// the steps its group reached, far past any step a peer can wait for and
// far short of looking behind them.
inline bool FlagReached(uint32_t flag, uint32_t value) { return int32_t(flag - value) >= 0; }
constexpr uint32_t kReleaseDistance = 1u << 30;
inline uint32_t ReleasedFlag(uint32_t step_reached) { return step_reached + kReleaseDistance; }
// Tokens (0 or 1, waited for as >= 1: stream_algorithms.h) are released to
// this, reached from 0 and 1 alike whatever steps the group reached.
constexpr uint32_t kReleasedToken = kReleaseDistance;
// Whether a step flag was released past `step` (a watchdog of any process of
// the group moved it kReleaseDistance ahead), not merely reached.
inline bool ReleasedPast(uint32_t flag, uint32_t step) {
  return int32_t(flag - step) >= int32_t(kReleaseDistance / 2);
}

class StreamOps {
 public:
  virtual ~StreamOps() = default;

  // `rows` rows of `width` bytes: dst + i * dpitch <- src + i * spitch.
  // Either side may be a peer's memory.
  virtual Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                        size_t rows) = 0;

  // For each of `rows` rows of `count` elements:
  //   dst[row] = op(srcs[0][row], ..., srcs[n - 1][row])
  // combined in source order; row i of source k starts at srcs[k] + i * spitch
  // bytes, of dst at dst + i * dpitch. Sources may be peers' memory; 16-bit
  // floats are combined in f32 and rounded once.
  virtual Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                        size_t count, size_t rows, DType dtype, ReduceOp op) = 0;

  // The same reduction of `count` contiguous elements stored into each of
  // `nd` destinations (all_reduce in one round: a rank's reduced shard into
  // every rank's output). By default one Reduce into dsts[0], then copies
  // of it; a GPU stores into them all from the one kernel.
  virtual Status ReduceToEach(void* const* dsts, int nd, const void* const* srcs, int n,
                              size_t count, DType dtype, ReduceOp op) {
    if (nd <= 0 || count == 0) return Status::Ok();
    const size_t bytes = count * ElementSize(dtype);
    SMDDP_RETURN_IF_ERROR(Reduce(dsts[0], bytes, srcs, n, bytes, count, 1, dtype, op));
    for (int d = 1; d < nd; ++d) SMDDP_RETURN_IF_ERROR(Copy(dsts[d], dsts[0], bytes));
    return Status::Ok();
  }
  // `bytes` zero bytes at `dst` (a rank that receives nothing in a permute).
  virtual Status Zero(void* dst, size_t bytes) = 0;

  // Later work waits until FlagReached(*flag, value) (the flag may be a peer's).
  virtual Status WaitAtLeast(const uint32_t* flag, uint32_t value) = 0;

  // *flag = value once all earlier work is done and visible to peers.
  virtual Status Write(uint32_t* flag, uint32_t value) = 0;
  // WaitAtLeast and Write of several flags at once, in that order (a GPU
  // enqueues them as one batch of stream memory operations).
  virtual Status WaitAllAtLeast(const uint32_t* const* flags, int n, uint32_t value) {
    for (int i = 0; i < n; ++i) SMDDP_RETURN_IF_ERROR(WaitAtLeast(flags[i], value));
    return Status::Ok();
  }
  virtual Status WriteAll(uint32_t* const* flags, int n, uint32_t value) {
    for (int i = 0; i < n; ++i) SMDDP_RETURN_IF_ERROR(Write(flags[i], value));
    return Status::Ok();
  }

  // Work that may run at once (several copy engines): after Fork(lanes),
  // Lane(i) for i < lanes is a stream of its own whose work starts once
  // everything enqueued here before Fork is done and runs in its order;
  // Join makes later work here wait for every lane. By default there is one
  // stream and every lane is this one: the same order, nothing at once.
  virtual Status Fork(int lanes) {
    (void)lanes;
    return Status::Ok();
  }
  virtual StreamOps& Lane(int i) {
    (void)i;
    return *this;
  }
  virtual Status Join() { return Status::Ok(); }

  Status Copy(void* dst, const void* src, size_t bytes) {
    return Copy2D(dst, bytes, src, bytes, bytes, 1);
  }

  // Addresses that travel on the device (stream_algorithms.h: calls whose
  // peers' buffers are not known on the host). By default unsupported.
  //
  // Writes `n` (<= kMailboxWords) 64-bit `values`, taken now, to `dst` once
  // earlier work is done (a kernel's arguments, so a captured graph's update
  // can change them).
  virtual Status WriteWords(uint64_t* dst, const uint64_t* values, int n) {
    (void)dst, (void)values, (void)n;
    return Unsupported("WriteWords");
  }
  // *out = where a peer's buffer `which` (0: input, 1: output) of this call
  // is, from the peer's mailbox entry `entry` (MailboxEntry, below), which
  // must be of call `stamp` (else the device faults: a stale entry is never
  // read; unless the group failed: `*released` set, or the peer's `posted`
  // flag released, ReleasedPast: then *out = 0). With `table` null
  // (a peer of this process) the entry's address as it is; else table[2 id + 1] + offset once
  // table[2 id] == id + 1 (the peer's allocation `id` is mapped here), or 0 if `*released` becomes
  // nonzero first (the group failed: the copies below then skip).
  virtual Status Resolve(uint64_t* out, const uint64_t* entry, uint64_t stamp, int which,
                         const uint64_t* table, const uint32_t* released, const uint32_t* posted) {
    (void)out, (void)entry, (void)stamp, (void)which, (void)table, (void)released, (void)posted;
    return Unsupported("Resolve");
  }
  // Copy2D from *src_at + src_add (read when the copy runs; 0: skipped).
  virtual Status Copy2DFrom(void* dst, size_t dpitch, const uint64_t* src_at, size_t src_add,
                            size_t spitch, size_t width, size_t rows) {
    (void)dst, (void)dpitch, (void)src_at, (void)src_add, (void)spitch, (void)width, (void)rows;
    return Unsupported("Copy2DFrom");
  }
  // ReduceToEach of `count` elements from srcs_at[k] + src_add (k < n) into
  // dsts_at[d] + dst_add (d < nd), the addresses read when it runs (any 0:
  // skipped); `rows` rows of pitches `spitch` and `dpitch` as Reduce's.
  virtual Status ReduceFrom(const uint64_t* dsts_at, int nd, size_t dst_add, size_t dpitch,
                            const uint64_t* srcs_at, int n, size_t src_add, size_t spitch,
                            size_t count, size_t rows, DType dtype, ReduceOp op) {
    (void)dsts_at, (void)nd, (void)dst_add, (void)dpitch, (void)srcs_at, (void)n, (void)src_add;
    (void)spitch, (void)count, (void)rows, (void)dtype, (void)op;
    return Unsupported("ReduceFrom");
  }

 private:
  static Status Unsupported(const char* what) {
    return Status::Unsupported(std::string("jax_smddp: these stream operations have no ") + what);
  }
};

// A rank's mailbox entry for one call (StreamOps::Resolve; words): the
// call's stamp, then per buffer (input at 1, output at 4) its allocation's
// id + 1 (0: an address of the owner's process, for peers in it), its offset
// in the allocation, and its address in the owner's process.
constexpr int kMailboxWords = 8;

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_STREAM_OPS_H_
