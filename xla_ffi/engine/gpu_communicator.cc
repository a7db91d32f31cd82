#include "xla_ffi/engine/gpu_communicator.h"

#include <cstring>
#include <map>
#include <mutex>

#include <cuda_runtime_api.h>

namespace smddp {
namespace gpu {
namespace {

Status CudaError(const std::string& what, cudaError_t err) {
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
  cudaError_t error() const { return err_; }

 private:
  int saved_ = -1;
  cudaError_t err_;
};

std::mutex registry_mu;
std::map<uint64_t, std::unique_ptr<GpuCommunicator>>& Registry() {
  static auto* r = new std::map<uint64_t, std::unique_ptr<GpuCommunicator>>();
  return *r;
}
int process_index = 0;

}  // namespace

uint64_t GroupKey(const int64_t* members, int size) {
  uint64_t h = 1469598103934665603ull ^ uint64_t(size);
  for (int i = 0; i < size; ++i) {
    h = (h ^ uint64_t(members[i])) * 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

GpuCommunicator::GpuCommunicator(std::vector<int64_t> members, size_t slot_bytes)
    : key_(GroupKey(members.data(), int(members.size()))),
      members_(std::move(members)),
      layout_(int(members_.size()), slot_bytes),
      local_(members_.size()) {}

GpuCommunicator::~GpuCommunicator() {
  for (uint8_t* p : opened_) cudaIpcCloseMemHandle(p);
  for (auto& l : local_) {
    if (l && l->own) {
      DeviceScope scope(l->ordinal);
      cudaFree(l->own);
    }
  }
}

Status GpuCommunicator::Prepare(const std::vector<std::pair<int, int>>& local,
                                std::vector<std::pair<int, std::string>>* handles) {
  for (const auto& [rank, ordinal] : local) {
    if (rank < 0 || rank >= size()) return Status::Error("jax_smddp (GPU): rank out of range");
    if (!local_[rank]) {
      auto l = std::make_unique<LocalRank>();
      l->ordinal = ordinal;
      DeviceScope scope(ordinal);
      if (scope.error() != cudaSuccess)
        return CudaError("selecting device " + std::to_string(ordinal), scope.error());
      void* region = nullptr;
      cudaError_t err = cudaMalloc(&region, layout_.total_bytes);
      l->own = static_cast<uint8_t*>(region);
      if (err != cudaSuccess)
        return CudaError("allocating " + std::to_string(layout_.total_bytes) +
                         " bytes of staging on device " + std::to_string(ordinal) +
                         " (lower JAX_SMDDP_GPU_SLOT_BYTES or XLA_PYTHON_CLIENT_MEM_FRACTION)", err);
      // Flags start at zero before any peer can see the region.
      cudaStream_t s;
      err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      if (err == cudaSuccess) {
        err = cudaMemsetAsync(l->own, 0, layout_.total_bytes, s);
        if (err == cudaSuccess) err = cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
      if (err != cudaSuccess) return CudaError("clearing staging flags", err);
      l->view.rank = rank;
      l->view.layout = layout_;
      l->view.regions.assign(size(), nullptr);
      l->view.regions[rank] = l->own;
      local_[rank] = std::move(l);
    }
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, local_[rank]->own);
    if (err != cudaSuccess) return CudaError("exporting a CUDA IPC handle", err);
    handles->emplace_back(rank, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  }
  return Status::Ok();
}

Status GpuCommunicator::Connect(const std::vector<std::pair<int, std::string>>& remote) {
  if (connected_) return Status::Ok();
  int first_local = -1;
  for (int r = 0; r < size(); ++r) {
    if (local_[r]) {
      first_local = r;
      break;
    }
  }
  if (first_local < 0) return Status::Error("jax_smddp (GPU): no rank of this process was prepared");
  // Other processes' regions: mapped once per process (unified addressing
  // makes the mapping usable from every local device with peer access).
  std::vector<uint8_t*> mapped(size(), nullptr);
  for (const auto& [rank, bytes] : remote) {
    if (rank < 0 || rank >= size() || local_[rank]) continue;
    if (bytes.size() != sizeof(cudaIpcMemHandle_t))
      return Status::Error("jax_smddp (GPU): malformed CUDA IPC handle from rank " + std::to_string(rank));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.data(), sizeof(handle));
    DeviceScope scope(local_[first_local]->ordinal);
    void* p = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess)
      return CudaError("mapping rank " + std::to_string(rank) + "'s staging (CUDA IPC; the group "
                       "must be on one node)", err);
    mapped[rank] = static_cast<uint8_t*>(p);
    opened_.push_back(mapped[rank]);
  }
  for (int r = 0; r < size(); ++r) {
    if (!local_[r] && !mapped[r])
      return Status::Error("jax_smddp (GPU): no staging handle for rank " + std::to_string(r));
  }
  for (auto& l : local_) {
    if (!l) continue;
    for (int q = 0; q < size(); ++q) {
      if (local_[q]) {
        l->view.regions[q] = local_[q]->own;
        if (local_[q]->ordinal != l->ordinal) {
          DeviceScope scope(l->ordinal);
          int can = 0;
          cudaDeviceCanAccessPeer(&can, l->ordinal, local_[q]->ordinal);
          if (!can)
            return Status::Error("jax_smddp (GPU): device " + std::to_string(l->ordinal) +
                                 " cannot access device " + std::to_string(local_[q]->ordinal) +
                                 " (no peer access)");
          const cudaError_t err = cudaDeviceEnablePeerAccess(local_[q]->ordinal, 0);
          if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled)
            return CudaError("enabling peer access", err);
          cudaGetLastError();
        }
      } else {
        l->view.regions[q] = mapped[q];
      }
    }
  }
  connected_ = true;
  return Status::Ok();
}

LocalRank* GpuCommunicator::Local(int rank) {
  return rank >= 0 && rank < size() ? local_[rank].get() : nullptr;
}

Status PrepareCommunicator(const std::vector<int64_t>& members, size_t slot_bytes,
                           const std::vector<std::pair<int, int>>& local,
                           std::vector<std::pair<int, std::string>>* handles) {
  std::lock_guard<std::mutex> lock(registry_mu);
  const uint64_t key = GroupKey(members.data(), int(members.size()));
  auto& slot = Registry()[key];
  if (!slot) slot = std::make_unique<GpuCommunicator>(members, slot_bytes);
  if (slot->members() != members)
    return Status::Error("jax_smddp (GPU): two device groups share a key; report this as a bug");
  return slot->Prepare(local, handles);
}

Status ConnectCommunicator(const std::vector<int64_t>& members,
                           const std::vector<std::pair<int, std::string>>& remote) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(GroupKey(members.data(), int(members.size())));
  if (it == Registry().end()) return Status::Error("jax_smddp (GPU): connect before prepare");
  return it->second->Connect(remote);
}

GpuCommunicator* FindCommunicator(uint64_t key) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(key);
  return it == Registry().end() || !it->second->connected() ? nullptr : it->second.get();
}

void ReleaseCommunicators() {
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().clear();
}

void SetProcessIndex(int process) { process_index = process; }
int ProcessIndex() { return process_index; }

}  // namespace gpu
}  // namespace smddp
