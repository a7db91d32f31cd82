// A StreamClock (xla_ffi/algorithms/phase_timer.h) of CUDA events on one
// stream: a mark is an event recorded there, read once the stream has passed
// it. For diagnosing where a collective's time goes on the GPU; each mark
// costs an event record on the stream.
#ifndef JAX_SMDDP_CUDA_EVENT_CLOCK_H_
#define JAX_SMDDP_CUDA_EVENT_CLOCK_H_

#include <vector>

#include <cuda_runtime_api.h>

#include "xla_ffi/algorithms/phase_timer.h"

namespace smddp {
namespace cuda {

class EventClock : public StreamClock {
 public:
  explicit EventClock(cudaStream_t stream) : stream_(stream) {}
  ~EventClock() override;
  EventClock(const EventClock&) = delete;
  EventClock& operator=(const EventClock&) = delete;

  Status Mark(int* id) override;
  Status Seconds(int from, int to, double* seconds) override;

 private:
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
};

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_EVENT_CLOCK_H_
