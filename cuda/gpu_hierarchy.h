// Groups of GPUs that span hosts (the hierarchical bodies of
// stream_algorithms.h): the ranks on each host form an intra-host
// GpuCommunicator (gpu_communicator.h), and each rank has a network port
// (net_port.h) that the process's network proxy drives over libfabric.
#ifndef JAX_SMDDP_CUDA_GPU_HIERARCHY_H_
#define JAX_SMDDP_CUDA_GPU_HIERARCHY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/gpu_communicator.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/common/status.h"

namespace smddp {
class FabricRail;
class World;
namespace gpu {

// A group that spans hosts (the hierarchical all_gather, reduce_scatter and all_to_all):
// equal ranks per host; the ranks on this host form an intra-host
// GpuCommunicator (the rails' local exchange), and each of this process's
// ranks has a network port: a mailbox of mapped pinned host memory and
// signals in device memory mapped by GDRCopy (mapped pinned host memory
// without it), driven by the process's network proxy. The port's slots are
// either host memory that the world's libfabric links copy through
// (staging), or device memory registered with the process's rail
// (OpenDeviceRail, FI_HMEM), which the NIC reads and writes itself.
class GpuHierarchy {
 public:
  struct Member {
    LocalRank* local = nullptr;  // in the intra-host communicator
    NetPort* port = nullptr;
  };
  GpuHierarchy(std::vector<int64_t> members, std::vector<int> rank_of);
  ~GpuHierarchy();

  // `host_of` / `process_of`: per group rank; `local`: (group rank, ordinal)
  // of this process's ranks; `intra`: this host's communicator (ready).
  // `rail_addresses`: every process's rail address (by process index), or
  // empty to stage through host memory.
  Status Prepare(const std::vector<int>& host_of, const std::vector<int>& process_of,
                 const std::vector<std::pair<int, int>>& local, GpuCommunicator* intra,
                 size_t slot_bytes, const std::vector<std::string>& rail_addresses);
  const std::vector<int>& rank_of() const { return rank_of_; }
  Member* Find(int rank);
  bool uses_gdrcopy() const { return gdrcopy_; }
  bool uses_rail() const { return rail_; }
  // Drops the libfabric side (rail links, registrations, the world) once the
  // proxy runs no more steps for it (CloseCommunicatorsAtExit).
  void CloseNetwork();

 private:
  struct PortMemory;
  Status PrepareRailSlots(FabricRail* rail, const NetLayout& layout, PortMemory* mem,
                          NetPort* port);
  std::vector<int64_t> members_;
  std::vector<int> rank_of_;  // host g's j-th rank -> group rank, at g * L + j
  std::vector<Member> by_rank_;
  std::vector<std::unique_ptr<NetPort>> ports_;
  std::vector<std::unique_ptr<PortMemory>> memory_;
  std::shared_ptr<const World> world_;             // keeps the ports' links alive
  std::vector<std::unique_ptr<Link>> rail_links_;  // after world_: closed before it
  bool gdrcopy_ = false;
  bool rail_ = false;
};

Status PrepareHierarchy(const std::vector<int64_t>& members, const std::vector<int>& host_of,
                        const std::vector<int>& process_of,
                        const std::vector<std::pair<int, int>>& local,
                        const std::vector<int64_t>& intra_members, size_t slot_bytes,
                        const std::vector<std::string>& rail_addresses, bool* uses_gdrcopy,
                        bool* uses_rail);
// Opens (once) this process's rail for network slots in device memory: the
// world's libfabric provider with FI_HMEM, checked by registering memory of
// GPU `ordinal`. Its address in `*address`; an error says why not (the groups
// then stage through host memory).
Status OpenDeviceRail(int ordinal, std::string* address);
GpuHierarchy* FindHierarchy(uint64_t key);

}  // namespace gpu
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_GPU_HIERARCHY_H_
