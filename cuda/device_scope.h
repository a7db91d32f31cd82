// Small CUDA runtime helpers shared by the host-side GPU code.
#ifndef JAX_SMDDP_CUDA_DEVICE_SCOPE_H_
#define JAX_SMDDP_CUDA_DEVICE_SCOPE_H_

#include <string>

#include <cuda_runtime_api.h>

#include "xla_ffi/common/status.h"

namespace smddp {
namespace cuda {

// A driver API entry point, through the runtime (no link-time dependency on
// libcuda; the tests' mock runtime offers some); null if this driver lacks it.
template <class Fn>
Fn Driver(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // a failed lookup must not poison later calls
    return nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

inline Status CudaError(const std::string& what, cudaError_t err) {
  return Status::Error("jax_smddp (GPU): " + what + ": " + cudaGetErrorString(err));
}

// Runs a block on `ordinal` and restores the caller's current device.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    err_ = cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return err_; }

 private:
  int saved_ = -1;
  cudaError_t err_;
};

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_DEVICE_SCOPE_H_
