#include "xla_ffi/algorithms/phase_timer.h"

namespace smddp {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kCopy:
      return "copy";
    case Phase::kReduce:
      return "reduce";
    case Phase::kWait:
      return "wait";
    case Phase::kSignal:
      return "signal";
  }
  return "?";
}

Status HostClock::Mark(int* id) {
  *id = int(marks_.size());
  marks_.push_back(std::chrono::steady_clock::now());
  return Status::Ok();
}

Status HostClock::Seconds(int from, int to, double* seconds) {
  if (from < 0 || to < 0 || size_t(from) >= marks_.size() || size_t(to) >= marks_.size())
    return Status::Error("jax_smddp: no such clock mark");
  *seconds = std::chrono::duration<double>(marks_[size_t(to)] - marks_[size_t(from)]).count();
  return Status::Ok();
}

template <typename F>
Status PhaseTimedOps::Timed(Phase phase, F&& call) {
  int start = 0, end = 0;
  SMDDP_RETURN_IF_ERROR(clock_.Mark(&start));
  SMDDP_RETURN_IF_ERROR(call());
  SMDDP_RETURN_IF_ERROR(clock_.Mark(&end));
  spans_.push_back({phase, {start, end}});
  return Status::Ok();
}

Status PhaseTimedOps::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                             size_t rows) {
  return Timed(Phase::kCopy, [&] { return inner_.Copy2D(dst, dpitch, src, spitch, width, rows); });
}

Status PhaseTimedOps::ReduceToEach(void* const* dsts, int nd, const void* const* srcs, int n,
                                   size_t count, DType dtype, ReduceOp op) {
  return Timed(Phase::kReduce,
               [&] { return inner_.ReduceToEach(dsts, nd, srcs, n, count, dtype, op); });
}

Status PhaseTimedOps::Zero(void* dst, size_t bytes) {
  return Timed(Phase::kCopy, [&] { return inner_.Zero(dst, bytes); });
}

Status PhaseTimedOps::Reduce(void* dst, size_t dpitch, const void* const* srcs, int n,
                             size_t spitch, size_t count, size_t rows, DType dtype, ReduceOp op) {
  return Timed(Phase::kReduce,
               [&] { return inner_.Reduce(dst, dpitch, srcs, n, spitch, count, rows, dtype, op); });
}

Status PhaseTimedOps::WaitAtLeast(const uint32_t* flag, uint32_t value) {
  return Timed(Phase::kWait, [&] { return inner_.WaitAtLeast(flag, value); });
}

Status PhaseTimedOps::Write(uint32_t* flag, uint32_t value) {
  return Timed(Phase::kSignal, [&] { return inner_.Write(flag, value); });
}

Status PhaseTimedOps::WaitAllAtLeast(const uint32_t* const* flags, int n, uint32_t value) {
  return Timed(Phase::kWait, [&] { return inner_.WaitAllAtLeast(flags, n, value); });
}

Status PhaseTimedOps::WriteAll(uint32_t* const* flags, int n, uint32_t value) {
  return Timed(Phase::kSignal, [&] { return inner_.WriteAll(flags, n, value); });
}

Status PhaseTimedOps::Totals(PhaseTotals* out) {
  *out = PhaseTotals{};
  if (spans_.empty()) return Status::Ok();
  // The last mark first: on a GPU that waits once for the whole stream.
  SMDDP_RETURN_IF_ERROR(
      clock_.Seconds(spans_.front().second.first, spans_.back().second.second, &out->total_s));
  for (const auto& [phase, span] : spans_) {
    double s = 0;
    SMDDP_RETURN_IF_ERROR(clock_.Seconds(span.first, span.second, &s));
    out->calls[int(phase)] += 1;
    out->seconds[int(phase)] += s;
  }
  return Status::Ok();
}

}  // namespace smddp
