#include "cuda/gpu_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include <cuda_runtime_api.h>

#include "cuda/buffer_ipc.h"
#include "cuda/device_scope.h"
#include "cuda/gpu_registry.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/engine/call_log.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/transports/process_liveness.h"

namespace smddp {
namespace gpu {
namespace {

using cuda::CudaError;
using cuda::DeviceScope;

std::mutex registry_mu;
int process_index = 0;

// What a rank publishes to the group's other processes.
struct RankHandle {
  cudaIpcMemHandle_t region;
  int32_t process;        // jax.process_index() of its process
  int32_t pid;            // for the watchdog
  uint64_t start_time;    // of that pid, per /proc (0: unknown)
  uint32_t flag_memory;   // FlagMemory
  uint32_t direct_reads;  // JAX_SMDDP_GPU_DIRECT_READS
  int32_t
      descriptor_probe;  // with direct reads: a descriptor peers try to copy (cuda/buffer_ipc.h)
  int32_t ordinal;       // its device, as its process numbers them (for messages)
  char block[60];        // its shared block's name (groups across processes)
};

// A rank's shared block: its step flags (used with host flag memory), then
// its call log, then its buffer table (direct reads).
size_t CallLogOffset(const RegionLayout& layout) {
  return (layout.flag_bytes() + 4095) / 4096 * 4096;
}
size_t BufferTableOffset(const RegionLayout& layout) {
  return CallLogOffset(layout) + CallLog::kBytes;
}
size_t SharedBlockBytes(const RegionLayout& layout) {
  return BufferTableOffset(layout) + BufferExchange::Bytes();
}

const char* FlagMemoryName(FlagMemory m) { return m == FlagMemory::kHost ? "host" : "device"; }

// Registers a shared block with CUDA (every device, every context of the
// process); returns the address of its flags on the GPUs.
Status RegisterFlagBlock(const SharedBlock& block, std::vector<void*>* registered,
                         uint8_t** device_flags) {
  cudaError_t err = cudaHostRegister(block.mapping(), block.mapping_bytes(),
                                     cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err != cudaSuccess) return CudaError("registering a flag block (cudaHostRegister)", err);
  registered->push_back(block.mapping());
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, block.mapping(), 0);
  if (err != cudaSuccess) return CudaError("mapping a flag block", err);
  *device_flags = static_cast<uint8_t*>(device) + SharedBlock::kHeaderBytes;
  return Status::Ok();
}

// Why a group cannot run where two of its devices have no peer to peer
// access: jax_smddp's GPU engine reads and signals peers' memory from each
// device (there is no staging through host memory).
Status NoPeerToPeer(const std::string& pair) {
  return Status::Unsupported(
      "jax_smddp (GPU): " + pair +
      " have no peer to peer access (PCIe without P2P, or P2P turned off): jax_smddp's GPU "
      "collectives need it between every two GPUs of a group on one host; run such jobs with "
      "XLA's own collectives (jax.lax, and JAX_SMDDP_COLLECTIVES unset), or enable P2P");
}

std::string MembersText(const std::vector<int64_t>& members) {
  std::string s = "[";
  for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : "") + std::to_string(members[i]);
  return s + "]";
}

}  // namespace

std::mutex& RegistryMutex() { return registry_mu; }

std::map<uint64_t, std::unique_ptr<GpuCommunicator>>& Registry() {
  static auto* r = new std::map<uint64_t, std::unique_ptr<GpuCommunicator>>();
  return *r;
}

Status GroupFailure(const LocalRank& rank) {
  return rank.watch && rank.watch->failed() ? rank.watch->error() : Status::Ok();
}

Status CheckCall(LocalRank& rank, const char* op, const Plan& plan) {
  SMDDP_RETURN_IF_ERROR(GroupFailure(rank));
  if (!rank.watch || rank.call_logs.empty()) return Status::Ok();
  const Status st =
      CallLog::RecordAndCheck(rank.call_logs, rank.view.rank, rank.calls++, op, plan, [&](int q) {
        return "rank " + std::to_string(q) + " (process " + std::to_string((*rank.process_of)[q]) +
               ")";
      });
  if (st.ok()) return st;
  const Status failure =
      st.WithMessage("jax_smddp (GPU): " + st.message() + " Later calls of this group fail too.");
  rank.watch->Fail(failure);  // the ranks' step counters no longer agree
  return failure;
}

Status ExchangeBuffers(LocalRank& rank, const Plan& plan, const void* send, void* recv) {
  // Between processes the call log numbers the calls (CheckCall); within one
  // process every call exchanges, so the exchanges number them.
  const bool logged = !rank.call_logs.empty();
  if (rank.exchange_failure->failed()) return rank.exchange_failure->error();
  if (!rank.exchange || (logged && rank.calls == 0)) {
    rank.view.inputs.clear();
    rank.view.outputs.clear();
    return Status::Ok();
  }
  const uint64_t call = logged ? rank.calls - 1 : rank.exchanges;
  const Status st = rank.exchange->Exchange(
      rank.exchanges++, call, send, DirectReadsNeedOutputs(plan.kind) ? recv : nullptr,
      TimeoutSeconds(), &rank.view.inputs, &rank.view.outputs);
  if (st.ok()) return st;
  rank.view.inputs.clear();
  rank.view.outputs.clear();
  // A local peer's failure reached this rank through the check: said once, as it was.
  if (rank.exchange_failure->failed()) return rank.exchange_failure->error();
  const Status failure = rank.exchange_failure->Set(
      st.WithMessage(st.message() + "; later calls of this group fail too"));
  if (rank.watch) rank.watch->Fail(failure);  // the peers may have gone on reading in place
  return failure;
}

// (ReadSetting gives the registry's default when the setting is unset.)
Status DirectReadsFromEnvironment(bool* out, bool* set) {
  std::string v;
  bool given = false;
  SMDDP_RETURN_IF_ERROR(ReadSetting("JAX_SMDDP_GPU_DIRECT_READS", &v, &given));
  *out = v == "1";
  if (set) *set = given;
  return Status::Ok();
}

Status GraphsFromEnvironment(bool* out) {
  std::string v;
  SMDDP_RETURN_IF_ERROR(ReadSetting("JAX_SMDDP_GPU_GRAPHS", &v));
  *out = v == "1";
  return Status::Ok();
}

Status FlagMemoryFromEnvironment(FlagMemory* out) {
  std::string v;
  SMDDP_RETURN_IF_ERROR(ReadSetting("JAX_SMDDP_GPU_FLAG_MEMORY", &v));
  *out = v == "host" ? FlagMemory::kHost : FlagMemory::kDevice;
  return Status::Ok();
}

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
  stop_mapper_.store(true, std::memory_order_release);
  if (mapper_.joinable()) mapper_.join();
  MarkClosed();
  if (watch_) Unwatch(watch_.get());
  for (void* p : registered_) cudaHostUnregister(p);
  for (const auto& [ordinal, p] : opened_) {
    DeviceScope scope(ordinal);
    cudaIpcCloseMemHandle(p);
  }
  for (auto& l : local_) {
    if (l && l->own) {
      DeviceScope scope(l->ordinal);
      cudaFree(l->own);
    }
    if (l) {
      DeviceScope scope(l->ordinal);
      for (uint8_t* b : l->bounces) cudaFree(b);
    }
  }
  if (device_tables_) cudaFreeHost(device_tables_);
}

Status GpuCommunicator::Prepare(const std::vector<std::pair<int, int>>& local, int processes,
                                std::vector<std::pair<int, std::string>>* handles,
                                Preferences preferred) {
  SMDDP_RETURN_IF_ERROR(FlagMemoryFromEnvironment(&flag_memory_));
  bool graphs = false;
  SMDDP_RETURN_IF_ERROR(GraphsFromEnvironment(&graphs));
  bool asked = false;
  SMDDP_RETURN_IF_ERROR(DirectReadsFromEnvironment(&direct_reads_, &asked));
  // Peers keep XLA's allocations mapped, and CUDA leaves freeing an exported
  // allocation that is still mapped undefined: only an allocator that keeps
  // its regions (XLA's BFC, the default) is safe.
  const char* allocator = std::getenv("XLA_PYTHON_CLIENT_ALLOCATOR");
  const std::string kind = allocator ? allocator : "";
  if (direct_reads_ && !(kind.empty() || kind == "default" || kind == "bfc")) {
    static bool told = false;
    if (!told && asked)  // the default quietly stages
      std::fprintf(stderr,
                   "jax_smddp (GPU): JAX_SMDDP_GPU_DIRECT_READS=1 is ignored with "
                   "XLA_PYTHON_CLIENT_ALLOCATOR=%s: direct reads need XLA's BFC allocator, which "
                   "keeps the allocations peers map; calls stage through the slots\n",
                   kind.c_str());
    told = true;
    direct_reads_ = false;
  }
  // A group inside one process has nobody to watch or to check its calls
  // against: no shared blocks, its flags stay with the data.
  const bool shared = processes > 1;
  const bool host_flags = shared && flag_memory_ == FlagMemory::kHost;
  for (const auto& [rank, ordinal] : local) {
    if (rank < 0 || rank >= size()) return Status::Error("jax_smddp (GPU): rank out of range");
    if (!local_[rank]) {
      auto l = std::make_unique<LocalRank>();
      l->ordinal = ordinal;
      l->exchange_failure = exchange_failure_;  // one per group in this process
      DeviceScope scope(ordinal);
      if (scope.error() != cudaSuccess)
        return CudaError("selecting device " + std::to_string(ordinal), scope.error());
      void* region = nullptr;
      cudaError_t err = cudaMalloc(&region, layout_.total_bytes);
      l->own = static_cast<uint8_t*>(region);
      if (err != cudaSuccess)
        return CudaError("allocating " + std::to_string(layout_.total_bytes) +
                             " bytes of staging on device " + std::to_string(ordinal) +
                             " (lower JAX_SMDDP_GPU_SLOT_BYTES or XLA_PYTHON_CLIENT_MEM_FRACTION)",
                         err);
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
      l->view.drain_each_call = preferred.capturable || graphs;
      l->view.regions.assign(size(), nullptr);
      l->view.regions[rank] = l->own;
      if (shared)
        SMDDP_RETURN_IF_ERROR(
            SharedBlock::Create(SharedBlockBytes(layout_), processes - 1, &l->block));
      if (host_flags) {
        l->view.flags.assign(size(), nullptr);
        SMDDP_RETURN_IF_ERROR(RegisterFlagBlock(*l->block, &registered_, &l->view.flags[rank]));
      }
      local_[rank] = std::move(l);
    }
    RankHandle handle{};
    const cudaError_t err = cudaIpcGetMemHandle(&handle.region, local_[rank]->own);
    if (err != cudaSuccess) return CudaError("exporting a CUDA IPC handle", err);
    handle.process = ProcessIndex();
    handle.pid = int32_t(::getpid());
    handle.start_time = ProcessStartTime(::getpid());
    handle.flag_memory = uint32_t(flag_memory_);
    handle.direct_reads = direct_reads_ ? 1 : 0;
    handle.descriptor_probe = direct_reads_ ? cuda::DescriptorProbe() : -1;
    handle.ordinal = int32_t(local_[rank]->ordinal);
    if (local_[rank]->block) {
      const std::string& name = local_[rank]->block->name();
      if (name.size() >= sizeof(handle.block))
        return Status::Error("jax_smddp (GPU): shared block name too long");
      std::memcpy(handle.block, name.c_str(), name.size() + 1);
    }
    handles->emplace_back(rank,
                          std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
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
  if (first_local < 0)
    return Status::Error("jax_smddp (GPU): no rank of this process was prepared");
  // Other processes' regions: mapped once per local device, in its own
  // context (a mapping opened on one device is not accessible from the
  // others: their peer access to the owner, in another process, cannot be
  // enabled from here).
  std::map<int, std::vector<uint8_t*>> mapped;  // by local ordinal, then rank
  for (const auto& l : local_) {
    if (l) mapped[l->ordinal].assign(size(), nullptr);
  }
  std::vector<uint8_t*> flags_device(size(), nullptr), blocks(size(), nullptr);
  std::vector<const SharedBlock*> block_of(size(), nullptr);
  std::map<int, std::pair<RankHandle, std::vector<int>>> peers;  // by process: a handle, its ranks
  const bool shared = bool(local_[first_local]->block);
  const bool host_flags = shared && flag_memory_ == FlagMemory::kHost;
  bool logs = shared;  // every rank's shared block is mapped here
  process_of_.assign(size(), ProcessIndex());
  std::set<int32_t> probed;  // peer processes whose descriptors this process tried to copy
  for (const auto& [rank, bytes] : remote) {
    if (rank < 0 || rank >= size() || local_[rank]) continue;
    if (bytes.size() != sizeof(RankHandle))
      return Status::Error("jax_smddp (GPU): malformed staging handle from rank " +
                           std::to_string(rank) + " (processes from different jax_smddp builds?)");
    RankHandle handle;
    std::memcpy(&handle, bytes.data(), sizeof(handle));
    if (handle.flag_memory != uint32_t(flag_memory_))
      return Status::Mismatch(
          std::string("jax_smddp (GPU): processes disagree on where step flags live: "
                      "JAX_SMDDP_GPU_FLAG_MEMORY is '") +
          FlagMemoryName(flag_memory_) + "' here and '" +
          FlagMemoryName(FlagMemory(handle.flag_memory)) + "' in process " +
          std::to_string(handle.process) + ": set it alike everywhere");
    if (handle.direct_reads != uint32_t(direct_reads_))
      return Status::Mismatch("jax_smddp (GPU): processes disagree on direct reads: " +
                              std::to_string(int(direct_reads_)) + " here, " +
                              std::to_string(handle.direct_reads) + " in process " +
                              std::to_string(handle.process) +
                              ": set JAX_SMDDP_GPU_DIRECT_READS "
                              "and XLA_PYTHON_CLIENT_ALLOCATOR alike everywhere");
    // XLA's memory is shared by descriptors, which some machines refuse to
    // copy between processes: then this process exports none, and the calls
    // that would need them stage in every process (the exchange's rule).
    if (direct_reads_ && handle.descriptor_probe >= 0 && handle.pid != ::getpid() &&
        probed.insert(handle.pid).second) {
      const std::string refused = cuda::CopyDescriptorRefused(handle.pid, handle.descriptor_probe);
      if (!refused.empty())
        buffer_ipc_.RefuseDescriptors("this process cannot map them: " + refused);
    }
    for (auto& [ordinal, regions] : mapped) {
      DeviceScope scope(ordinal);
      void* p = nullptr;
      const cudaError_t err =
          cudaIpcOpenMemHandle(&p, handle.region, cudaIpcMemLazyEnablePeerAccess);
      if (err == cudaErrorPeerAccessUnsupported) {
        cudaGetLastError();
        return NoPeerToPeer(
            "device " + std::to_string(ordinal) + " of process " + std::to_string(ProcessIndex()) +
            " (here) and device " + std::to_string(handle.ordinal) + " of process " +
            std::to_string(handle.process) + " (rank " + std::to_string(rank) + ")");
      }
      if (err != cudaSuccess)
        return CudaError("mapping rank " + std::to_string(rank) +
                             "'s staging (CUDA IPC; the group "
                             "must be on one node)",
                         err);
      regions[rank] = static_cast<uint8_t*>(p);
      opened_.emplace_back(ordinal, regions[rank]);
    }
    process_of_[rank] = handle.process;
    auto& peer = peers[handle.process];
    peer.first = handle;
    peer.second.push_back(rank);
    if (shared) {
      handle.block[sizeof(handle.block) - 1] = '\0';
      std::unique_ptr<SharedBlock> block;
      Status st = SharedBlock::Open(handle.block, SharedBlockBytes(layout_), &block);
      if (!st.ok() && !host_flags && !direct_reads_) {
        // Only the call check needs it with device flags: go on without.
        std::fprintf(stderr,
                     "jax_smddp (GPU): %s; calls of group %s are not checked for "
                     "agreement between processes\n",
                     st.message().c_str(), MembersText(members_).c_str());
        logs = false;
        continue;
      }
      SMDDP_RETURN_IF_ERROR(st);
      if (host_flags)
        SMDDP_RETURN_IF_ERROR(RegisterFlagBlock(*block, &registered_, &flags_device[rank]));
      blocks[rank] = block->data();
      block_of[rank] = block.get();
      opened_blocks_.push_back(std::move(block));
    }
  }
  for (int r = 0; r < size(); ++r) {
    if (!local_[r] && !mapped[local_[first_local]->ordinal][r])
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
            return NoPeerToPeer("devices " + std::to_string(l->ordinal) + " and " +
                                std::to_string(local_[q]->ordinal) + " of this process");
          const cudaError_t err = cudaDeviceEnablePeerAccess(local_[q]->ordinal, 0);
          if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled)
            return CudaError("enabling peer access", err);
          cudaGetLastError();
        }
      } else {
        l->view.regions[q] = mapped[l->ordinal][q];
      }
    }
  }
  std::vector<uint8_t*> rings(size(), nullptr);  // call logs
  if (shared) {
    for (int q = 0; q < size(); ++q) {
      if (local_[q]) {
        blocks[q] = local_[q]->block->data();
        if (host_flags) flags_device[q] = local_[q]->view.flags[q];
      }
      if (blocks[q]) rings[q] = blocks[q] + CallLogOffset(layout_);
    }
    for (auto& l : local_) {
      if (!l) continue;
      if (host_flags) l->view.flags = flags_device;
      if (logs) l->call_logs = rings;
      l->process_of = &process_of_;
    }
  }
  if (direct_reads_) SMDDP_RETURN_IF_ERROR(StartDirectReads(logs, blocks));
  if (!peers.empty()) {
    watch_ = std::make_shared<WatchedGroup>("GPU group " + MembersText(members_));
    for (const auto& [process, peer] : peers) {
      const int pid = peer.first.pid;
      std::string who = peer.second.size() > 1 ? "ranks" : "rank";
      for (size_t i = 0; i < peer.second.size(); ++i)
        who += (i ? ", " : " ") + std::to_string(peer.second[i]);
      who += " (process " + std::to_string(process) + ", pid " + std::to_string(pid) + ")";
      // A pid from another pid namespace (another container) cannot be watched.
      if (peer.first.start_time == 0 || ProcessStartTime(pid) != peer.first.start_time) {
        std::fprintf(stderr,
                     "jax_smddp (GPU): cannot watch %s of %s: its pid is not visible "
                     "here (another pid namespace?); a dead peer will not be detected\n",
                     who.c_str(), MembersText(members_).c_str());
        continue;
      }
      WatchedPeer watched;
      watched.pid = pid;
      watched.start_time = peer.first.start_time;
      watched.who = who;
      for (int rank : peer.second) {
        if (block_of[rank]) watched.blocks.push_back(block_of[rank]);
        if (logs) watched.call_logs.push_back(rings[rank]);
      }
      watch_->AddPeer(std::move(watched));
    }
    std::vector<SharedBlock*> own_blocks;
    for (auto& l : local_) {
      if (l && l->block) own_blocks.push_back(l->block.get());
    }
    watch_->SetOwnBlocks(std::move(own_blocks));
    if (host_flags) {
      std::vector<uint32_t*> flags = AllFlags(layout_, blocks);
      // The device exchange's released word first: a stream that passes a
      // released flag then skips what it would have read (StreamOps::Resolve).
      if (released_) flags.insert(flags.begin(), released_);
      watch_->SetAllFlags(std::move(flags), AllTokens(layout_, blocks), [this] {
        uint32_t reached = 0;  // the furthest step: steps wrap, so compared cyclically
        bool any = false;
        for (const auto& l : local_) {
          if (!l) continue;
          const uint32_t step = __atomic_load_n(&l->view.step, __ATOMIC_RELAXED);
          if (!any || !FlagReached(reached, step)) reached = step;
          any = true;
        }
        return reached;
      });
    }
    if (logs) {
      std::vector<const uint8_t*> own;
      for (int q = 0; q < size(); ++q) {
        if (local_[q]) own.push_back(rings[q]);
      }
      watch_->SetOwnCallLogs(std::move(own));
    }
    Watch(watch_);
    for (auto& l : local_) {
      if (l) l->watch = watch_;
    }
  }
  connected_ = true;
  return Status::Ok();
}

// Direct reads need every rank's buffer table: in the shared blocks between
// processes, in memory of this process within it.
Status GpuCommunicator::StartDirectReads(bool logs, const std::vector<uint8_t*>& blocks) {
  bool remote = false;
  for (int q = 0; q < size(); ++q) remote |= !local_[q];
  // Every process must take part (Connect fails where a block cannot be mapped).
  if (remote && !logs)
    return Status::Error("jax_smddp (GPU): direct reads in group " + MembersText(members_) +
                         " need every rank's shared block");
  std::vector<uint8_t*> tables(size(), nullptr);
  std::vector<bool> local(size(), false);
  for (int q = 0; q < size(); ++q) {
    local[q] = local_[q] != nullptr;
    if (remote) {
      tables[q] = blocks[q] + BufferTableOffset(layout_);
    } else {
      heap_tables_.emplace_back(new uint64_t[BufferExchange::Bytes() / 8]());  // zeroed
      tables[q] = reinterpret_cast<uint8_t*>(heap_tables_.back().get());
    }
  }
  for (auto& l : local_) {
    if (!l) continue;
    LocalRank* rank = l.get();
    BufferExchange::Memory memory;
    const int ordinal = rank->ordinal;
    memory.find_allocation = [this, ordinal](const void* p, uintptr_t* base, uint64_t* unique) {
      return buffer_ipc_.FindAllocation(ordinal, p, base, unique);
    };
    memory.export_allocation = [this, ordinal](uintptr_t base, BufferExchange::Handle* handle) {
      return buffer_ipc_.Export(ordinal, base, handle);
    };
    memory.map_allocation = [this, rank](const BufferExchange::Handle& handle, uint8_t** base) {
      return buffer_ipc_.Map(rank->ordinal, handle, base);
    };
    auto who = [this](int q) {
      return "rank " + std::to_string(q) + " (process " + std::to_string(process_of_[q]) + ")";
    };
    auto check = [rank]() {
      if (rank->watch && rank->watch->failed()) return rank->watch->error();
      return rank->exchange_failure->failed() ? rank->exchange_failure->error() : Status::Ok();
    };
    rank->exchange = std::make_unique<BufferExchange>(rank->view.rank, tables, local,
                                                      std::move(memory), who, check);
  }
  handle_tables_ = tables;
  // Streams that wait on a dead peer must be releasable (the watchdog writes
  // host flags only): between processes, the device exchange needs host flags
  // (the default); with device flags each call meets its peers on the host.
  if (!remote || flag_memory_ == FlagMemory::kHost)
    SMDDP_RETURN_IF_ERROR(StartDeviceExchange(tables));
  return Status::Ok();
}

// Per local rank r and peer q, r's table of q's allocations starts at
// ((r * P + q) * kMaxAllocations) * 2 words; the released word follows them all.
Status GpuCommunicator::StartDeviceExchange(const std::vector<uint8_t*>& handle_tables) {
  const int P = size();
  bool remote = false;
  for (int q = 0; q < P; ++q) remote |= !local_[q];
  const size_t per = BufferExchange::kMaxAllocations * 2;
  uint64_t* device = nullptr;
  uint32_t* released = nullptr;
  if (remote) {
    const size_t words = size_t(P) * P * per;
    void* host = nullptr;
    cudaError_t err =
        cudaHostAlloc(&host, words * 8 + 64, cudaHostAllocMapped | cudaHostAllocPortable);
    void* mapped = nullptr;
    if (err == cudaSuccess) err = cudaHostGetDevicePointer(&mapped, host, 0);
    if (err != cudaSuccess)
      return Status::Error(std::string("jax_smddp (GPU): allocating the peer tables: ") +
                           cudaGetErrorString(err));
    std::memset(host, 0, words * 8 + 64);
    device_tables_ = static_cast<uint64_t*>(host);
    released_ = reinterpret_cast<uint32_t*>(device_tables_ + words);
    device = static_cast<uint64_t*>(mapped);
    released = reinterpret_cast<uint32_t*>(device + words);
  }
  for (auto& l : local_) {
    if (!l) continue;
    l->device_exchange = true;
    l->view.device.tables.assign(P, nullptr);
    for (int q = 0; q < P; ++q) {
      if (!local_[q]) l->view.device.tables[q] = device + (size_t(l->view.rank) * P + q) * per;
    }
    l->view.device.released = released;
    // Started by the first call that goes by it (the group is watched by then).
    if (remote)
      l->start_mapper = [this] {
        std::call_once(mapper_once_, [this] { mapper_ = std::thread([this] { MapperLoop(); }); });
      };
  }
  (void)handle_tables;  // the mapper thread starts once the group is watched (Connect)
  return Status::Ok();
}

// Maps each peer's allocations in the order it published them, for every
// device of this process that reads them, and fills the tables; once the
// group failed, sets the released word (streams resolving stop waiting).
void GpuCommunicator::MapperLoop() {
  const int P = size();
  const size_t per = BufferExchange::kMaxAllocations * 2;
  std::vector<uint64_t> next(P, 0);
  int idle = 0;
  while (!stop_mapper_.load(std::memory_order_acquire)) {
    if ((watch_ && watch_->failed()) || exchange_failure_->failed())
      __atomic_store_n(released_, 1u, __ATOMIC_RELEASE);
    bool any = false;
    for (int q = 0; q < P; ++q) {
      if (local_[q]) continue;
      BufferExchange::Handle handle;
      while (next[q] < BufferExchange::kMaxAllocations &&
             BufferExchange::ReadHandle(handle_tables_[q], next[q], &handle)) {
        const uint64_t id = next[q]++;
        any = true;
        for (auto& l : local_) {
          if (!l) continue;
          uint8_t* base = nullptr;
          const Status st = buffer_ipc_.Map(l->ordinal, handle, &base);
          if (!st.ok()) {
            const Status failure = exchange_failure_->Set(
                Status::Error("jax_smddp (GPU): mapping rank " + std::to_string(q) + " (process " +
                              std::to_string(process_of_[q]) + ")'s buffer: " + st.message() +
                              "; later calls of this group fail too"));
            if (watch_) watch_->Fail(failure);
            __atomic_store_n(released_, 1u, __ATOMIC_RELEASE);
            continue;
          }
          uint64_t* slot = device_tables_ + (size_t(l->view.rank) * P + q) * per + 2 * id;
          slot[1] = uint64_t(reinterpret_cast<uintptr_t>(base));
          __atomic_store_n(slot, id + 1, __ATOMIC_RELEASE);  // the "mapped" flag, after the base
        }
      }
    }
    if (any) {
      idle = 0;
    } else if (++idle > 64) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
}

Status PublishBuffers(LocalRank& rank, const Plan& plan, StreamOps& ops, const void** send,
                      void** recv, size_t* copy_back) {
  *copy_back = 0;
  rank.view.inputs.clear();
  rank.view.outputs.clear();
  rank.view.device.active = false;
  if (rank.exchange_failure->failed()) return rank.exchange_failure->error();
  if (rank.start_mapper) rank.start_mapper();
  const bool outputs = DirectReadsNeedOutputs(plan.kind);
  Status st = rank.exchange->Publish(*send, outputs ? *recv : nullptr, rank.view.device.entry);
  if (!st.ok()) {  // staged in this rank's own memory that can be shared, decided here alone
    size_t in = 0, out = 0;
    CallBytes(plan, rank.view.layout.size, &in, &out);
    const size_t in_room = (in + 255) / 256 * 256, need = in_room + (outputs ? out : 0);
    if (rank.bounce_bytes < need) {
      DeviceScope scope(rank.ordinal);
      void* p = nullptr;
      const size_t bytes = std::max<size_t>(need, size_t(1) << 20);
      const cudaError_t err = cudaMalloc(&p, bytes);
      if (err != cudaSuccess)
        return Status::Error(std::string("jax_smddp (GPU): allocating staging memory: ") +
                             cudaGetErrorString(err));
      rank.bounces.push_back(static_cast<uint8_t*>(p));
      rank.bounce = static_cast<uint8_t*>(p);
      rank.bounce_bytes = bytes;
    }
    uint8_t* b_in = rank.bounce;
    uint8_t* b_out = rank.bounce + in_room;
    const Status again =
        rank.exchange->Publish(b_in, outputs ? b_out : nullptr, rank.view.device.entry);
    if (!again.ok()) {
      const Status failure = rank.exchange_failure->Set(Status::Error(
          "jax_smddp (GPU): rank " + std::to_string(rank.view.rank) +
          " can share neither its buffers (" + st.message() + ") nor staging memory (" +
          again.message() +
          ") with its peers; run with JAX_SMDDP_GPU_DIRECT_READS=0. Later calls of this group "
          "fail too"));
      if (rank.watch) rank.watch->Fail(failure);
      return failure;
    }
    if (in) SMDDP_RETURN_IF_ERROR(ops.Copy(b_in, *send, in));
    *send = b_in;
    if (outputs) {
      *recv = b_out;
      *copy_back = out;
    }
  }
  rank.view.device.active = true;
  return Status::Ok();
}

size_t GpuCommunicator::mapped_buffers() { return buffer_ipc_.mapped(); }

bool GpuCommunicator::direct_reads() const {
  for (const auto& l : local_) {
    if (l && l->exchange) return true;
  }
  return false;
}

void GpuCommunicator::MarkClosed() {
  for (auto& l : local_) {
    if (l && l->block) l->block->MarkClosed();
  }
}

LocalRank* GpuCommunicator::Local(int rank) {
  return rank >= 0 && rank < size() ? local_[rank].get() : nullptr;
}

Status PrepareCommunicator(const std::vector<int64_t>& members, size_t slot_bytes,
                           const std::vector<std::pair<int, int>>& local, int processes,
                           std::vector<std::pair<int, std::string>>* handles,
                           Preferences preferred) {
  std::lock_guard<std::mutex> lock(registry_mu);
  const uint64_t key = GroupKey(members.data(), int(members.size()));
  auto& slot = Registry()[key];
  if (!slot) slot = std::make_unique<GpuCommunicator>(members, slot_bytes);
  if (slot->members() != members)
    return Status::Error("jax_smddp (GPU): two device groups share a key; report this as a bug");
  return slot->Prepare(local, processes, handles, preferred);
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

void MarkCommunicatorsClosed() {
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto& [key, comm] : Registry()) comm->MarkClosed();
}

void ReleaseCommunicators() {
  std::lock_guard<std::mutex> lock(registry_mu);
  ReleaseHierarchiesLocked();  // first: they use the communicators' ranks
  Registry().clear();
}

bool CloseCommunicatorsAtExit() {
  MarkCommunicatorsClosed();
  return CloseNetworkAtExit();  // the groups across hosts (gpu_hierarchy.cc)
}

void SetProcessIndex(int process) { process_index = process; }
int ProcessIndex() { return process_index; }

}  // namespace gpu
}  // namespace smddp
