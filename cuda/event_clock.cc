#include "cuda/event_clock.h"

#include <string>

namespace smddp {
namespace cuda {
namespace {

Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("jax_smddp: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace

EventClock::~EventClock() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

Status EventClock::Mark(int* id) {
  cudaEvent_t e = nullptr;
  SMDDP_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&e), "cudaEventCreate"));
  events_.push_back(e);
  *id = int(events_.size()) - 1;
  return CudaStatus(cudaEventRecord(e, stream_), "cudaEventRecord");
}

Status EventClock::Seconds(int from, int to, double* seconds) {
  if (from < 0 || to < 0 || size_t(from) >= events_.size() || size_t(to) >= events_.size())
    return Status::Error("jax_smddp: no such clock mark");
  SMDDP_RETURN_IF_ERROR(
      CudaStatus(cudaEventSynchronize(events_[size_t(to)]), "cudaEventSynchronize"));
  float ms = 0;
  SMDDP_RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&ms, events_[size_t(from)], events_[size_t(to)]),
                 "cudaEventElapsedTime"));
  *seconds = double(ms) * 1e-3;
  return Status::Ok();
}

}  // namespace cuda
}  // namespace smddp
