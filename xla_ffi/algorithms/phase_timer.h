// Where a stream-ordered collective's time goes: a StreamOps decorator that
// marks the stream before and after every call it passes on, so that each
// call's span is charged to its phase (data copies, reductions, waits for a
// peer's flag, flag writes). On host threads the marks are clock readings
// (HostClock: the operations run at once); on a GPU they are CUDA events
// (cuda/event_clock.h), read once the stream has passed them. A wait's span
// is how long the stream stood still for a peer: the hand-off's cost plus
// the peer's lateness.
#ifndef JAX_SMDDP_ALGORITHMS_PHASE_TIMER_H_
#define JAX_SMDDP_ALGORITHMS_PHASE_TIMER_H_

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "xla_ffi/algorithms/stream_ops.h"

namespace smddp {

enum class Phase : uint8_t { kCopy, kReduce, kWait, kSignal };
constexpr int kPhases = 4;
const char* PhaseName(Phase phase);

// Points on a stream's timeline.
class StreamClock {
 public:
  virtual ~StreamClock() = default;
  // Enqueues a mark; *id names it.
  virtual Status Mark(int* id) = 0;
  // Seconds from mark `from` to mark `to`, once the stream has passed both
  // (a GPU clock waits for that).
  virtual Status Seconds(int from, int to, double* seconds) = 0;
};

// Clock readings: for StreamOps that run each call before returning.
class HostClock : public StreamClock {
 public:
  Status Mark(int* id) override;
  Status Seconds(int from, int to, double* seconds) override;

 private:
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

struct PhaseTotals {
  uint64_t calls[kPhases] = {};
  double seconds[kPhases] = {};
  double total_s = 0;  // first mark to last: the phases plus what ran between them
};

class PhaseTimedOps : public StreamOps {
 public:
  PhaseTimedOps(StreamOps& inner, StreamClock& clock) : inner_(inner), clock_(clock) {}

  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                size_t rows) override;
  Status Reduce(void* dst, size_t dpitch, const void* const* srcs, int n, size_t spitch,
                size_t count, size_t rows, DType dtype, ReduceOp op) override;
  Status ReduceToEach(void* const* dsts, int nd, const void* const* srcs, int n, size_t count,
                      DType dtype, ReduceOp op) override;
  Status Zero(void* dst, size_t bytes) override;
  Status WaitAtLeast(const uint32_t* flag, uint32_t value) override;
  Status Write(uint32_t* flag, uint32_t value) override;
  Status WaitAllAtLeast(const uint32_t* const* flags, int n, uint32_t value) override;
  Status WriteAll(uint32_t* const* flags, int n, uint32_t value) override;

  // Every call's phase and span so far, summed per phase (waits on a GPU
  // clock until the stream has passed the last mark).
  Status Totals(PhaseTotals* out);

 private:
  template <typename F>
  Status Timed(Phase phase, F&& call);

  StreamOps& inner_;
  StreamClock& clock_;
  std::vector<std::pair<Phase, std::pair<int, int>>> spans_;  // phase, (start mark, end mark)
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_PHASE_TIMER_H_
