// How the processes of one node share the device memory XLA allocated, so
// that a rank reads its peers' buffers in place (direct reads,
// JAX_SMDDP_GPU_DIRECT_READS). Two kinds of memory, two kinds of handle:
//  - cudaMalloc'd memory: a legacy CUDA IPC handle (cudaIpcGetMemHandle);
//  - cuMemCreate'd memory that allows POSIX file descriptor handles (what
//    XLA's allocators hand out, seen with jax 0.11.2 on an H100): the
//    exporter keeps a file descriptor of the allocation open and publishes
//    its pid and number; a peer copies it with pidfd_getfd (Linux 5.6+, the
//    same user; the exporter allows it under Yama's ptrace_scope=1) and maps
//    the allocation into its own address space.
// Memory pools (XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async) share neither way:
// such calls stage (FindAllocation says why).
#ifndef JAX_SMDDP_CUDA_BUFFER_IPC_H_
#define JAX_SMDDP_CUDA_BUFFER_IPC_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/common/status.h"
#include "xla_ffi/engine/buffer_exchange.h"

namespace smddp {
namespace cuda {

// A descriptor of this process that peers copy at set-up to learn whether
// they can copy descriptors from it at all (pidfd_getfd is refused by some
// seccomp profiles, by Yama's ptrace_scope 2 and 3, and before Linux 5.6);
// also allows that copy under ptrace_scope=1. Made once; -1 if it cannot be.
int DescriptorProbe();
// Whether this process can copy process `pid`'s descriptor `fd`: "" if it
// can, else why not.
std::string CopyDescriptorRefused(int pid, int fd);

// One communicator's exports and its mappings of peers' allocations, undone
// when it goes.
class BufferIpc {
 public:
  BufferIpc() = default;
  BufferIpc(const BufferIpc&) = delete;
  BufferIpc& operator=(const BufferIpc&) = delete;
  ~BufferIpc();

  // The allocation holding `p` on device `ordinal`: where it starts and its
  // buffer id (never reused within a process); an error says why it cannot
  // be shared either way.
  Status FindAllocation(int ordinal, const void* p, uintptr_t* base, uint64_t* unique);
  // Memory that only descriptors could share is not exported from now on
  // (calls that use it stage), because of `why`: some process of the group
  // cannot copy its peers' descriptors, so it could not map them.
  void RefuseDescriptors(const std::string& why);

  // A handle of the allocation starting at `base` (FindAllocation's), for
  // the peers.
  Status Export(int ordinal, uintptr_t base, BufferExchange::Handle* handle);
  // Maps a peer's allocation for device `ordinal` to read; its start here.
  // Every device that reads it must be granted access: a cuMem allocation is
  // mapped once per process and its access extended to each device that
  // asks (cuMemSetAccess); a legacy CUDA IPC handle is opened once per device,
  // in that device's context (CUDA allows one opening per device and process).
  Status Map(int ordinal, const BufferExchange::Handle& handle, uint8_t** base);
  // Peers' allocations mapped so far.
  size_t mapped();

 private:
  struct Range {
    int ordinal;
    unsigned long long address;
    size_t bytes;
  };
  Status MapOnce(int ordinal, const BufferExchange::Handle& handle, uint8_t** base);

  std::mutex mu_;  // this process's ranks export and map concurrently
  // Every mapping, by its handle, then by the device it was granted to.
  std::map<BufferExchange::Handle, std::map<int, uint8_t*>> by_handle_;
  std::vector<std::pair<int, uint8_t*>> legacy_;  // (ordinal, cudaIpcOpenMemHandle mapping)
  std::vector<Range> mapped_;                     // cuMem mappings of peers' allocations
  std::vector<int> exported_fds_;                 // kept open while peers may import them
  std::string descriptors_refused_;               // set at set-up, before any call: read unlocked
};

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_BUFFER_IPC_H_
