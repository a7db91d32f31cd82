// libsmddp_nccl.so's own parts: served calls enqueue on CUDA streams, and
// the entry points jax_smddp (Python) uses to configure and read it.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "cuda/cuda_stream_ops.h"
#include "cuda/gpu_communicator.h"
#include "cuda/ncclapi/nccl_calls.h"
#include "cuda/ncclapi/real_nccl.h"
#include "xla_ffi/transports/world.h"

namespace {

const smddp::cuda::GpuSettings& Settings() {
  static const smddp::cuda::GpuSettings settings = smddp::cuda::GpuSettings::FromEnvironment();
  return settings;
}

smddp::Status RunOnStream(void* stream, smddp::nccl::StreamBackend::Body body, void* context) {
  smddp::cuda::CudaStreamOps ops(static_cast<cudaStream_t>(stream), Settings());
  return body(ops, context);
}

bool Capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

struct InstallBackend {
  InstallBackend() { smddp::nccl::SetStreamBackend({&RunOnStream, &Capturing}); }
} install_backend;

}  // namespace

// Called by jax_smddp as JAX creates its GPU client, after jax_smddp's world
// exists: the world (the CPU module's, see world.h), this process's index,
// and the real NCCL library to forward to ("" to leave it unset).
extern "C" __attribute__((visibility("default"))) void smddp_nccl_configure(
    uintptr_t world_source, int process, const char* real_library) {
  if (world_source) smddp::UseWorldOf(reinterpret_cast<smddp::WorldSource>(world_source));
  smddp::gpu::SetProcessIndex(process);
  if (real_library && *real_library) smddp::nccl::SetRealLibrary(real_library);
}

// What the front end did so far, as JSON (the doctor and tests read it):
// calls served and forwarded by function, the reasons for forwarding, and
// the real library.
extern "C" __attribute__((visibility("default"))) const char* smddp_nccl_describe() {
  static thread_local std::string text;
  std::string d = smddp::nccl::Describe();
  std::string library = smddp::nccl::RealLibrary();
  std::string why;
  const int version = library.empty() ? 0 : smddp::nccl::RealVersion(&why);
  const std::string escaped = smddp::nccl::JsonEscaped(library);
  d.pop_back();  // the closing brace
  text = d + ", \"library\": \"" + escaped + "\", \"version\": " + std::to_string(version) + "}";
  return text.c_str();
}

// At exit (jax_smddp's atexit hook), as the FFI path's (jax_smddp/gpu.py):
// the front end's GPU communicators tell their peers this process ends in
// order (it did not die), and the groups across hosts close their libfabric
// objects and let go of the world. False: network steps still ran, nothing
// closed.
extern "C" __attribute__((visibility("default"))) bool smddp_nccl_close_at_exit() {
  return smddp::gpu::CloseCommunicatorsAtExit();
}
