// The process-wide registry of GPU groups, private to cuda/: the groups within
// a host (gpu_communicator.cc) and the groups across hosts built on them
// (gpu_hierarchy.cc) share one lock, so that a hierarchy is prepared on a
// communicator that cannot be released meanwhile.
#ifndef JAX_SMDDP_CUDA_GPU_REGISTRY_H_
#define JAX_SMDDP_CUDA_GPU_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "cuda/gpu_communicator.h"

namespace smddp {
namespace gpu {

std::mutex& RegistryMutex();
// Under RegistryMutex(): the groups within a host, by GroupKey.
std::map<uint64_t, std::unique_ptr<GpuCommunicator>>& Registry();
// Under RegistryMutex(): drops every group across hosts (gpu_hierarchy.cc),
// before the communicators whose ranks they use.
void ReleaseHierarchiesLocked();
// CloseCommunicatorsAtExit's network side (gpu_hierarchy.cc): once the
// network proxy is idle, closes what the groups across hosts hold of libfabric.
bool CloseNetworkAtExit();

}  // namespace gpu
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_GPU_REGISTRY_H_
