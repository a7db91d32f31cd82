// Communicators of the GPU backend: per group of devices, one registered
// region (stream_algorithms.h) per rank in device memory, mapped by every
// peer once: CUDA IPC between processes, peer access between devices of one
// process. Set up outside any XLA execution (at lowering, by
// jax_smddp/gpu.py); the handlers only look them up.
//
// Groups with ranks in several processes are watched (stream_watchdog.h):
// when a peer process exits, every later call fails naming it; and each
// rank's calls are logged where its peers check them (call_log.h). Where the
// step flags live decides whether the streams waiting on it are released
// too: JAX_SMDDP_GPU_FLAG_MEMORY=host (default) puts each rank's flags in a
// shared-memory block of its host that every GPU of the group addresses
// (cudaHostRegister), which the watchdog releases; =device keeps them in the
// regions (device memory: fastest to poll, but the host cannot write them, so
// those streams stay blocked, and direct calls between processes meet their
// peers on the host instead of through the device exchange).
//
// Groups that span hosts are built on these (cuda/gpu_hierarchy.h).
#ifndef JAX_SMDDP_CUDA_GPU_COMMUNICATOR_H_
#define JAX_SMDDP_CUDA_GPU_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/buffer_ipc.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/common/status.h"
#include "xla_ffi/engine/buffer_exchange.h"
#include "xla_ffi/engine/stream_watchdog.h"
#include "xla_ffi/transports/shared_block.h"

namespace smddp {
namespace gpu {

// Why a buffer exchange of a group failed, shared by the group's ranks in
// this process: a group inside one process has no watch to carry it, and a
// local peer that went on would wait out its deadline in the next exchange
// for a rank that no longer publishes.
class ExchangeFailure {
 public:
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // The first failure is kept (its code too); returns it.
  Status Set(const Status& failure) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = failure;
      failed_.store(true, std::memory_order_release);
    }
    return failure_;
  }
  Status error() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_.load(std::memory_order_relaxed) ? failure_ : Status::Ok();
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  Status failure_;
};

// A rank of this process: its device and its view of every rank's region.
struct LocalRank {
  int ordinal = -1;
  uint8_t* own = nullptr;  // this rank's region (cudaMalloc on `ordinal`)
  // Groups across processes: the rank's shared block (its step flags with
  // host flag memory, then its call log), every rank's call log, and the
  // watch on the group's peer processes (null: a group inside one process).
  std::unique_ptr<SharedBlock> block;
  std::vector<uint8_t*> call_logs;
  std::shared_ptr<WatchedGroup> watch;
  const std::vector<int>* process_of = nullptr;  // each rank's process
  uint64_t calls = 0;                            // calls enqueued on the group (host side)
  StreamRank view;
  // Direct reads (JAX_SMDDP_GPU_DIRECT_READS=1): where the peers' buffers of
  // each call are (null: this group stages every call).
  std::unique_ptr<BufferExchange> exchange;
  uint64_t exchanges = 0;  // exchanges so far
  // Direct reads by the device exchange (stream_algorithms.h: DeviceExchange;
  // its tables in view.device): no host waits for a peer. `bounce`: device
  // memory of this rank that can be shared, where a call whose buffers cannot
  // be is staged (grown as needed; earlier ones kept: peers may map them).
  bool device_exchange = false;
  std::function<void()> start_mapper;  // at the first such call of the process (idempotent)
  uint8_t* bounce = nullptr;
  size_t bounce_bytes = 0;
  std::vector<uint8_t*> bounces;
  // Why an exchange of the group failed in this process: every later call fails.
  std::shared_ptr<ExchangeFailure> exchange_failure = std::make_shared<ExchangeFailure>();
};

// Before a call of `op` is enqueued for `rank`: in a group across
// processes, fails once a peer process died or disagreed on a call
// (stream_watchdog.h); else logs this call where the peers check it, and
// checks theirs (call_log.h). A disagreement fails the group for good.
Status CheckCall(LocalRank& rank, const char* op, const Plan& plan);

// The group's failure, if it failed (a dead peer, a disagreement): for a
// call that is not logged (one captured into a CUDA graph: a rank captures
// again alone when XLA records its command buffer anew for other buffers,
// so captures cannot be numbered alike on every rank).
Status GroupFailure(const LocalRank& rank);

// Before enqueuing a call that CheckCall passed, with direct reads: learns
// where every peer's buffers of this call are (buffer_exchange.h; the host
// waits for the peers' hosts) and sets `rank.view.inputs` (and for all_reduce
// `outputs`), or clears them (the call stages: no direct reads in this group,
// or a rank that could not share its buffers). A failure fails the group for
// good; the caller then releases whoever waits on this rank
// (ReleaseEveryoneWaitingOn): its peers may already read in place.
Status ExchangeBuffers(LocalRank& rank, const Plan& plan, const void* send, void* recv);

// Instead of ExchangeBuffers where the rank's group reads in place by the
// device exchange: publishes this call's buffers (exporting new allocations;
// no peer is waited for) and sets rank.view.device. A buffer that cannot be
// shared is staged: `*send` (and for all_reduce `*recv`) then point into the
// rank's bounce memory, the input's copy there is enqueued on `ops`, and
// `*copy_back` is the output bytes the caller copies from `*recv` to the
// real output after the call (0: none). Returns at once otherwise.
Status PublishBuffers(LocalRank& rank, const Plan& plan, StreamOps& ops, const void** send,
                      void** recv, size_t* copy_back);

// Whether groups read peers' buffers in place (JAX_SMDDP_GPU_DIRECT_READS:
// 1: yes, groups inside one host; 0: they stage); `set`, if given, says
// whether the setting was (else the registry's default).
Status DirectReadsFromEnvironment(bool* out, bool* set = nullptr);

// Where a communicator's step flags live (JAX_SMDDP_GPU_FLAG_MEMORY).
enum class FlagMemory : uint32_t { kDevice = 0, kHost = 1 };
Status FlagMemoryFromEnvironment(FlagMemory* out);

// Whether the custom calls may be captured into CUDA graphs
// (JAX_SMDDP_GPU_GRAPHS): their handlers then say so to XLA, and their
// communicators are prepared as a front end's with `capturable`.
Status GraphsFromEnvironment(bool* out);

// How a front end's communicators differ from the custom calls' (both take
// JAX_SMDDP_GPU_FLAG_MEMORY and JAX_SMDDP_GPU_DIRECT_READS from the registry).
struct Preferences {
  // Calls may be captured into CUDA graphs (StreamRank::drain_each_call),
  // whatever JAX_SMDDP_GPU_GRAPHS says.
  bool capturable = false;
};

// The NCCL API front end's: calls that CUDA graphs may capture (those stage,
// replayable; ran on the H200, 2026-11-28).
inline Preferences NcclFrontEndPreferences() {
  Preferences p;
  p.capturable = true;
  return p;
}

class GpuCommunicator {
 public:
  GpuCommunicator(std::vector<int64_t> members, size_t slot_bytes);
  ~GpuCommunicator();

  uint64_t key() const { return key_; }
  int size() const { return int(members_.size()); }
  const std::vector<int64_t>& members() const { return members_; }
  size_t slot_bytes() const { return layout_.slot_bytes; }

  // Allocates (zeroed) the regions of this process's ranks, given as
  // (rank, device ordinal), and with host flag memory their flag blocks,
  // which the other `processes` - 1 processes of the group will map; returns
  // (rank, handle bytes) for each: CUDA IPC handle, process, flag block.
  Status Prepare(const std::vector<std::pair<int, int>>& local, int processes,
                 std::vector<std::pair<int, std::string>>* handles, Preferences preferred = {});
  // Maps every other process's regions (and flag blocks) from their handles
  // (rank, bytes) and starts watching their processes.
  Status Connect(const std::vector<std::pair<int, std::string>>& remote);
  bool connected() const { return connected_; }
  FlagMemory flag_memory() const { return flag_memory_; }
  // Whether this process's ranks read their peers' buffers in place.
  bool direct_reads() const;
  // Peers' buffer allocations mapped here (once each, whichever local rank asked).
  size_t mapped_buffers();
  // Tells the peers this process is done with the group (an orderly exit,
  // not a death: stream_watchdog.h).
  void MarkClosed();

  LocalRank* Local(int rank);

 private:
  Status StartDirectReads(bool logs, const std::vector<uint8_t*>& blocks);
  // The device exchange's tables (mapped host memory) and mapper thread,
  // which maps the peers' allocations as their handles appear.
  Status StartDeviceExchange(const std::vector<uint8_t*>& handle_tables);
  void MapperLoop();

  uint64_t key_;
  std::vector<int64_t> members_;
  RegionLayout layout_;
  std::vector<std::unique_ptr<LocalRank>> local_;  // by rank; null for other processes'
  std::vector<std::pair<int, uint8_t*>> opened_;   // IPC mappings to close (on their devices)
  cuda::BufferIpc buffer_ipc_;  // peers' XLA buffers mapped, this process's exported
  std::vector<std::unique_ptr<SharedBlock>> opened_blocks_;  // peers' shared blocks
  std::vector<int> process_of_;                              // by rank
  std::vector<void*> registered_;                            // host memory registered with CUDA
  std::shared_ptr<WatchedGroup> watch_;
  std::shared_ptr<ExchangeFailure> exchange_failure_ = std::make_shared<ExchangeFailure>();
  FlagMemory flag_memory_ = FlagMemory::kDevice;
  bool direct_reads_ = false;  // asked for (JAX_SMDDP_GPU_DIRECT_READS)
  std::vector<std::unique_ptr<uint64_t[]>>
      heap_tables_;  // buffer tables of a group inside one process
  bool connected_ = false;
  // The device exchange: every rank's handle table; per local rank and peer,
  // its table of that peer's allocations (id + 1, base) and the released word
  // after them; the thread that fills them.
  std::vector<uint8_t*> handle_tables_;
  uint64_t* device_tables_ = nullptr;
  uint32_t* released_ = nullptr;
  std::thread mapper_;
  std::once_flag mapper_once_;
  std::atomic<bool> stop_mapper_{false};
};

// Names a group of devices (partition ids in rank order) alike everywhere.
uint64_t GroupKey(const int64_t* members, int size);

// Process-wide registry. Prepare creates (or returns) the group's communicator.
Status PrepareCommunicator(const std::vector<int64_t>& members, size_t slot_bytes,
                           const std::vector<std::pair<int, int>>& local, int processes,
                           std::vector<std::pair<int, std::string>>* handles,
                           Preferences preferred = {});
Status ConnectCommunicator(const std::vector<int64_t>& members,
                           const std::vector<std::pair<int, std::string>>& remote);
GpuCommunicator* FindCommunicator(uint64_t key);
void ReleaseCommunicators();
// At exit: MarkClosed on every communicator (frees nothing).
void MarkCommunicatorsClosed();
// At exit (jax_smddp/gpu.py's atexit hook): MarkCommunicatorsClosed, then,
// once the network proxy finished the steps already enqueued (waiting at most
// 10 s, or jax_smddp's timeout if shorter), closes every libfabric object the GPU groups hold:
// the rail links, the device memory registrations, the rail, and their hold
// on the world (whose links then close with it). Device memory stays mapped
// (a stream may still wait on it; the process is ending). Later network
// steps fail. Returns false, closing nothing, if the proxy did not go idle.
bool CloseCommunicatorsAtExit();

// This process's index in the job (set by jax_smddp/gpu.py; 0 alone).
void SetProcessIndex(int process);
int ProcessIndex();

}  // namespace gpu
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_GPU_COMMUNICATOR_H_
