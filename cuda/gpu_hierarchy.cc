#include "cuda/gpu_hierarchy.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>

#include <cuda_runtime_api.h>

#include "cuda/device_scope.h"
#include "cuda/gdrcopy.h"
#include "cuda/gpu_registry.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/fabric_rail.h"
#include "xla_ffi/transports/world.h"

namespace smddp {
namespace gpu {
namespace {

using cuda::CudaError;
using cuda::DeviceScope;

std::map<uint64_t, std::unique_ptr<GpuHierarchy>>& Hierarchies() {
  static auto* r = new std::map<uint64_t, std::unique_ptr<GpuHierarchy>>();
  return *r;
}

// The process's network proxies, one per rail (a rank's index on its host),
// each started with the first hierarchical group that uses its rail; each
// step's deadline is the timeout current when it runs. One per rail, not one
// per process: a process with several GPUs serves several rails, and one
// proxy running their steps one after another, in the order this process's
// threads enqueued them, can wait on a peer process that runs the other
// rail's step first, each for the other until both time out (found on the
// mock node: 2 hosts x 1 process x 2 GPUs, tests/native/test_gpu_node_mock.py).
// A rail's steps come in the same order everywhere (its ranks run the same
// calls in the same order).
std::mutex proxies_mu;
std::map<int, NetworkProxy*>& Proxies() {
  static auto* proxies = new std::map<int, NetworkProxy*>();
  return *proxies;
}
NetworkProxy* Proxy(int rail) {
  std::lock_guard<std::mutex> lock(proxies_mu);
  NetworkProxy*& proxy = Proxies()[rail];
  if (!proxy) proxy = new NetworkProxy();
  return proxy;
}

// Device memory's libfabric interface. The tests' mock CUDA runtime
// (tests/native/mock_node) hands out host memory as "device memory".
#ifdef SMDDP_MOCK_CUDA_RUNTIME
constexpr MemoryIface kDeviceIface = MemoryIface::kHost;
#else
constexpr MemoryIface kDeviceIface = MemoryIface::kCuda;
#endif

// Whether `provider` moves registered device memory by DMA (GPUDirect RDMA)
// rather than by CUDA copies on its progress thread, which the proxy calls
// while streams wait on it.
bool MovesDeviceMemoryByDma(const std::string& provider) {
  return provider.rfind("efa", 0) == 0 || provider.find("verbs") != std::string::npos;
}

// This process's rail for network slots in device memory (FI_HMEM), once
// OpenDeviceRail succeeded; never closed (like the proxy).
std::mutex rail_mu;
FabricRail* device_rail = nullptr;

// Whether the NIC's writes into `ordinal`'s memory must be flushed before the
// GPU reads them (`*flush`), or an error when they can be neither relied on
// nor flushed.
Status RdmaWriteOrdering(int ordinal, bool* flush) {
  int ordering = 0, options = 0;
  cudaError_t err =
      cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, ordinal);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, ordinal);
  if (err != cudaSuccess) return CudaError("querying GPUDirect RDMA write ordering", err);
  *flush = ordering < cudaGPUDirectRDMAWritesOrderingOwner;
  if (*flush && !(options & cudaFlushGPUDirectRDMAWritesOptionHost))
    return Status::Unsupported(
        "jax_smddp (GPU): GPU " + std::to_string(ordinal) +
        " neither orders GPUDirect RDMA writes nor can flush them, so data the "
        "NIC writes into its memory could be read stale");
  return Status::Ok();
}

// Zeroed pinned host memory the current device can address (`device`).
Status MappedHostAlloc(size_t bytes, const char* what, void** host, void** device) {
  cudaError_t err = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) return CudaError(std::string("allocating the ") + what, err);
  std::memset(*host, 0, bytes);
  err = cudaHostGetDevicePointer(device, *host, 0);
  if (err != cudaSuccess) return CudaError(std::string("mapping the ") + what, err);
  return Status::Ok();
}

}  // namespace

void ReleaseHierarchiesLocked() { Hierarchies().clear(); }

bool CloseNetworkAtExit() {
  bool network;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    network = !Hierarchies().empty();
  }
  // Not under the registry's lock: the steps being waited for may need it.
  // Briefly: a process leaving on an error must not sit out a step's whole
  // deadline (its endpoints then stay open, as the OS would leave them).
  constexpr double kExitWaitSeconds = 10;
  std::vector<NetworkProxy*> proxies;
  {
    std::lock_guard<std::mutex> lock(proxies_mu);
    for (const auto& [rail, proxy] : Proxies()) proxies.push_back(proxy);
  }
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(std::min(TimeoutSeconds(), kExitWaitSeconds));
  for (NetworkProxy* proxy : proxies) {
    const double left =
        std::chrono::duration<double>(until - std::chrono::steady_clock::now()).count();
    if (network && !proxy->Shut(std::max(left, 0.0),
                                "jax_smddp (GPU): this process is exiting; its network links to "
                                "other hosts are closed"))
      return false;
  }
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (auto& [key, h] : Hierarchies()) h->CloseNetwork();
  }
  std::lock_guard<std::mutex> lock(rail_mu);
  delete device_rail;  // its endpoint closes now that no link or region holds it
  device_rail = nullptr;
  return true;
}

// Network port memory of one rank: the mailbox in mapped pinned host memory,
// the signals in GDRCopy-mapped device memory or mapped pinned host memory,
// the slots after the mailbox's flags (staging) or in device memory
// registered with the process's rail.
struct GpuHierarchy::PortMemory {
  void* mailbox_host = nullptr;
  void* signals_host = nullptr;    // pinned host signals (no GDRCopy)
  void* signals_device = nullptr;  // device signals (GDRCopy)
  void* slots_device = nullptr;    // rail: slots the NIC reads and writes
  std::unique_ptr<FabricRail::Region> slots_region;
  cudaStream_t poison_stream = nullptr;
  cuda::GdrMapping mapping;
  int ordinal = 0;
  ~PortMemory() {
    slots_region.reset();  // deregistered before it is freed
    if (slots_device || poison_stream) {
      DeviceScope scope(ordinal);
      if (slots_device) cudaFree(slots_device);
      if (poison_stream) cudaStreamDestroy(poison_stream);
    }
    if (mailbox_host) cudaFreeHost(mailbox_host);
    if (signals_host) cudaFreeHost(signals_host);
    if (signals_device) {
      mapping = cuda::GdrMapping();
      DeviceScope scope(ordinal);
      cudaFree(signals_device);
    }
  }
};

GpuHierarchy::GpuHierarchy(std::vector<int64_t> members, std::vector<int> rank_of)
    : members_(std::move(members)), rank_of_(std::move(rank_of)), by_rank_(members_.size()) {}

GpuHierarchy::~GpuHierarchy() = default;

void GpuHierarchy::CloseNetwork() {
  for (auto& port : ports_) {
    port->links.assign(port->links.size(), nullptr);
    port->world = nullptr;
  }
  rail_links_.clear();
  for (auto& mem : memory_) mem->slots_region.reset();
  world_.reset();
}

GpuHierarchy::Member* GpuHierarchy::Find(int rank) {
  return rank >= 0 && size_t(rank) < by_rank_.size() && by_rank_[rank].port ? &by_rank_[rank]
                                                                            : nullptr;
}

Status GpuHierarchy::Prepare(const std::vector<int>& host_of, const std::vector<int>& process_of,
                             const std::vector<std::pair<int, int>>& local, GpuCommunicator* intra,
                             size_t slot_bytes, const std::vector<std::string>& rail_addresses) {
  const int P = int(members_.size());
  int hosts = 0;
  for (int h : host_of) hosts = std::max(hosts, h + 1);
  if (hosts < 2 || P % hosts != 0) return Status::Unsupported("jax_smddp (GPU): uneven hosts");
  const int L = P / hosts;
  world_ = CurrentWorld();
  const World* world = world_.get();
  if (!world)
    return Status::Error(
        "jax_smddp (GPU): a group across hosts needs the multi-process world "
        "(jax_smddp.initialize())");
  NetLayout layout(hosts, slot_bytes);
  std::string why;
  gdrcopy_ = cuda::GdrCopyAvailable(&why);
  FabricRail* rail = nullptr;
  if (!rail_addresses.empty()) {
    {
      std::lock_guard<std::mutex> lock(rail_mu);
      rail = device_rail;
    }
    if (!rail || int(rail_addresses.size()) != world->processes())
      return Status::Error("jax_smddp (GPU): the group's rail is not open in this process");
    if (layout.slot_bytes > rail->max_message())  // a step's message is at most one slot
      return Status::Error("jax_smddp (GPU): libfabric (" + rail->Provider() +
                           ") carries at most " + std::to_string(rail->max_message()) +
                           " bytes per message; lower "
                           "JAX_SMDDP_GPU_SLOT_BYTES or set JAX_SMDDP_FABRIC_HMEM=0");
    rail_ = true;
  }
  for (const auto& [rank, ordinal] : local) {
    const int h = host_of[rank];
    int j = -1;
    for (int x = 0; x < L; ++x) {
      if (rank_of_[h * L + x] == rank) j = x;
    }
    if (j < 0) return Status::Error("jax_smddp (GPU): rank not on its host");
    LocalRank* lr = intra->Local(j);
    if (!lr || lr->ordinal != ordinal)
      return Status::Error("jax_smddp (GPU): intra-host rank " + std::to_string(j) +
                           " not prepared");
    auto mem = std::make_unique<PortMemory>();
    mem->ordinal = ordinal;
    DeviceScope scope(ordinal);
    void* mailbox_device = nullptr;
    // Staging: the slots follow the flags in the mailbox. Rail: flags only.
    SMDDP_RETURN_IF_ERROR(MappedHostAlloc(rail ? layout.flag_bytes : layout.mailbox_bytes,
                                          "network mailbox", &mem->mailbox_host, &mailbox_device));
    auto port = std::make_unique<NetPort>();
    port->hosts = hosts;
    port->host = h;
    port->rail = j;
    port->key = GroupKey(members_.data(), P);
    port->layout = layout;
    port->mailbox_proxy = static_cast<uint8_t*>(mem->mailbox_host);
    port->mailbox_stream = static_cast<uint8_t*>(mailbox_device);
    if (rail) {
      SMDDP_RETURN_IF_ERROR(PrepareRailSlots(rail, layout, mem.get(), port.get()));
    } else {
      port->slots_proxy = port->mailbox_proxy + layout.flag_bytes;
      port->slots_stream = port->mailbox_stream + layout.flag_bytes;
    }
    if (gdrcopy_) {
      // GDRCopy pins whole GPU pages from a page start; cudaMalloc aligns
      // small allocations less, so allocate a page more and align.
      constexpr size_t kPage = cuda::kGdrPageBytes;
      const size_t bytes = (layout.signal_bytes + kPage - 1) / kPage * kPage;
      cudaError_t err = cudaMalloc(&mem->signals_device, bytes + kPage);
      uint8_t* signals = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(mem->signals_device) + kPage - 1) / kPage * kPage);
      if (err == cudaSuccess) err = cudaMemset(signals, 0, bytes);
      if (err == cudaSuccess) err = cudaDeviceSynchronize();
      if (err != cudaSuccess) return CudaError("allocating GDRCopy signals", err);
      SMDDP_RETURN_IF_ERROR(cuda::GdrMapping::Map(signals, bytes, &mem->mapping));
      port->signals_stream = signals;
      port->signals_proxy = mem->mapping.host();
    } else {
      void* device = nullptr;
      SMDDP_RETURN_IF_ERROR(
          MappedHostAlloc(layout.signal_bytes, "network signals", &mem->signals_host, &device));
      port->signals_proxy = static_cast<uint8_t*>(mem->signals_host);
      port->signals_stream = static_cast<uint8_t*>(device);
    }
    port->links.assign(hosts, nullptr);
    port->peer_process.assign(hosts, -1);
    port->world = world;
    for (int k = 0; k < hosts; ++k) {
      if (k == h) continue;
      const int peer = process_of[rank_of_[k * L + j]];
      port->peer_process[k] = peer;
      port->links[k] = world->link(peer);
      if (!port->links[k])
        return Status::Error("jax_smddp (GPU): no link to process " + std::to_string(peer));
      if (rail) {  // the world's link still tells when that process is gone
        std::unique_ptr<Link> link;
        SMDDP_RETURN_IF_ERROR(rail->Connect(rail_addresses[peer], "process " + std::to_string(peer),
                                            port->links[k], &link));
        port->links[k] = link.get();
        rail_links_.push_back(std::move(link));
      }
    }
    port->proxy = Proxy(port->rail);
    // The host group is connected (watched, if it spans processes) before its ports exist.
    port->abandoned = [watch = lr->watch] { return watch && watch->failed(); };
    by_rank_[rank] = Member{lr, port.get()};
    ports_.push_back(std::move(port));
    memory_.push_back(std::move(mem));
  }
  (void)why;
  return Status::Ok();
}

Status GpuHierarchy::PrepareRailSlots(FabricRail* rail, const NetLayout& layout, PortMemory* mem,
                                      NetPort* port) {
  const int ordinal = mem->ordinal;
  bool flush = false;
  SMDDP_RETURN_IF_ERROR(RdmaWriteOrdering(ordinal, &flush));
  cudaError_t err = cudaMalloc(&mem->slots_device, layout.slot_area_bytes);
  if (err == cudaSuccess) err = cudaMemset(mem->slots_device, 0, layout.slot_area_bytes);
  if (err == cudaSuccess)
    err = cudaStreamCreateWithFlags(&mem->poison_stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) return CudaError("allocating network slots in device memory", err);
  SMDDP_RETURN_IF_ERROR(
      rail->Register(mem->slots_device, layout.slot_area_bytes, ordinal, &mem->slots_region));
  port->slots_proxy = port->slots_stream = static_cast<uint8_t*>(mem->slots_device);
  // After a failure the proxy poisons what never arrived; the CPU cannot
  // write device memory, so a copy engine does, on a stream of its own.
  cudaStream_t stream = mem->poison_stream;
  port->poison = [ordinal, stream](uint8_t* slot, size_t bytes) {
    DeviceScope scope(ordinal);
    if (cudaMemsetAsync(slot, 0xFF, bytes, stream) == cudaSuccess) cudaStreamSynchronize(stream);
  };
  if (flush) {  // the NIC's writes reach the GPU's readers only after a flush
    port->after_receive = [ordinal]() -> Status {
      DeviceScope scope(ordinal);
      cudaError_t e = cudaDeviceFlushGPUDirectRDMAWrites(
          cudaFlushGPUDirectRDMAWritesTargetCurrentDevice, cudaFlushGPUDirectRDMAWritesToOwner);
      return e == cudaSuccess ? Status::Ok() : CudaError("flushing GPUDirect RDMA writes", e);
    };
  }
  return Status::Ok();
}

Status OpenDeviceRail(int ordinal, std::string* address) {
  std::lock_guard<std::mutex> lock(rail_mu);
  if (!device_rail) {
    auto world = CurrentWorld();
    if (!world || world->fabric_provider().empty())
      return Status::Error("no libfabric links to other hosts in this process's world");
    if (kDeviceIface == MemoryIface::kCuda && !MovesDeviceMemoryByDma(world->fabric_provider()))
      return Status::Error(
          "libfabric's " + world->fabric_provider() +
          " provider would move device memory (FI_HMEM) "
          "with CUDA copies from its progress thread, and with memory it cannot tell is CUDA's "
          "it synchronizes the whole device (cudaDeviceSynchronize, seen with shm on an H100): "
          "that waits for the streams that wait on the network proxy, a deadlock. Device slots "
          "need a provider that moves them by DMA (efa, verbs)");
    bool flush = false;
    SMDDP_RETURN_IF_ERROR(RdmaWriteOrdering(ordinal, &flush));
    std::unique_ptr<FabricRail> rail;
    SMDDP_RETURN_IF_ERROR(
        FabricRail::Open(world->fabric_provider(), world->fabric_node(), kDeviceIface, &rail));
    // A provider may offer FI_HMEM yet fail on this machine's device memory
    // (no nvidia-peermem or dma-buf): register some before anyone relies on it.
    DeviceScope scope(ordinal);
    void* probe = nullptr;
    cudaError_t err = cudaMalloc(&probe, 2 << 20);
    if (err != cudaSuccess) return CudaError("allocating device memory to register", err);
    std::unique_ptr<FabricRail::Region> region;
    Status st = rail->Register(probe, 2 << 20, ordinal, &region);
    region.reset();
    cudaFree(probe);
    SMDDP_RETURN_IF_ERROR(st);
    device_rail = rail.release();
  }
  *address = device_rail->Address();
  return Status::Ok();
}

Status PrepareHierarchy(const std::vector<int64_t>& members, const std::vector<int>& host_of,
                        const std::vector<int>& process_of,
                        const std::vector<std::pair<int, int>>& local,
                        const std::vector<int64_t>& intra_members, size_t slot_bytes,
                        const std::vector<std::string>& rail_addresses, bool* uses_gdrcopy,
                        bool* uses_rail) {
  const int P = int(members.size());
  if (int(host_of.size()) != P || int(process_of.size()) != P)
    return Status::Error("jax_smddp (GPU): malformed hierarchical group");
  int hosts = 0;
  for (int h : host_of) hosts = std::max(hosts, h + 1);
  std::vector<std::vector<int>> on_host(hosts);
  for (int r = 0; r < P; ++r) on_host[host_of[r]].push_back(r);
  std::vector<int> rank_of;
  for (auto& ranks : on_host) {
    if (ranks.size() != on_host[0].size())
      return Status::Unsupported(
          "jax_smddp (GPU): hosts have different numbers of ranks in the group");
    rank_of.insert(rank_of.end(), ranks.begin(), ranks.end());
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  const uint64_t key = GroupKey(members.data(), P);
  auto& slot = Hierarchies()[key];
  if (slot) {
    *uses_gdrcopy = slot->uses_gdrcopy();
    *uses_rail = slot->uses_rail();
    return Status::Ok();
  }
  auto intra = Registry().find(GroupKey(intra_members.data(), int(intra_members.size())));
  if (intra == Registry().end() || !intra->second->connected())
    return Status::Error("jax_smddp (GPU): prepare this host's communicator first");
  auto h = std::make_unique<GpuHierarchy>(members, rank_of);
  Status st =
      h->Prepare(host_of, process_of, local, intra->second.get(), slot_bytes, rail_addresses);
  if (!st.ok()) return st;
  *uses_gdrcopy = h->uses_gdrcopy();
  *uses_rail = h->uses_rail();
  slot = std::move(h);
  return Status::Ok();
}

GpuHierarchy* FindHierarchy(uint64_t key) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Hierarchies().find(key);
  return it == Hierarchies().end() ? nullptr : it->second.get();
}

}  // namespace gpu
}  // namespace smddp
