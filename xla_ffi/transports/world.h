// The processes of a multi-process job, as this process sees them: its own
// index, and a link to every peer process that a communicator may span
// (shared memory to peers on the same host, libfabric to the others).
//
// Built by jax_smddp.initialize() from what the processes publish in the
// jax.distributed key-value store (the bootstrap steps below); released by
// jax_smddp.shutdown(). Calls in flight keep the world they started with
// alive, so shutdown never pulls a link from under a running collective.
#ifndef JAX_SMDDP_TRANSPORTS_WORLD_H_
#define JAX_SMDDP_TRANSPORTS_WORLD_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_ffi/common/collective.h"
#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/link.h"

namespace smddp {

class World {
 public:
  struct Peer {
    std::unique_ptr<Link> link;  // null for this process and unconnected peers
    int pid = 0;
    std::string host;
  };

  // `endpoint` keeps what the links share (the libfabric endpoint) alive
  // until after the links are gone.
  World(int process, std::vector<Peer> peers, std::shared_ptr<void> endpoint)
      : endpoint_(std::move(endpoint)),
        process_(process),
        peers_(std::move(peers)),
        sent_(new std::atomic<uint64_t>[peers_.size()]()),
        received_(new std::atomic<uint64_t>[peers_.size()]()) {
    if (process_ >= 0 && process_ < processes())
      for (const Peer& p : peers_) local_processes_ += p.host == peers_[process_].host;
  }

  int process() const { return process_; }
  int processes() const { return int(peers_.size()); }
  // The job's processes on this process's host (equal host ids, JAX_SMDDP_HOST_ID), itself
  // included: those that share its cores (the engine's helpers' default, CpuHelpers).
  int local_processes() const { return std::max(local_processes_, 1); }
  // The link to `process`, or null (itself, or a process it has no link to).
  Link* link(int process) const {
    return process >= 0 && process < processes() ? peers_[process].link.get() : nullptr;
  }
  const Peer& peer(int process) const { return peers_[process]; }
  // The libfabric provider and local address the links to other hosts use
  // ("" when none): what other endpoints of this process must match.
  const std::string& fabric_provider() const { return fabric_provider_; }
  const std::string& fabric_node() const { return fabric_node_; }
  void set_fabric(std::string provider, std::string node) {  // before it is shared
    fabric_provider_ = std::move(provider);
    fabric_node_ = std::move(node);
  }
  // Whether the job's processes on this machine outnumber the cores this
  // process may use (initialize() finds it): waiting calls then poll less
  // (algorithms/wait_polls.h).
  bool oversubscribed() const { return oversubscribed_; }
  void set_oversubscribed(bool value) { oversubscribed_ = value; }  // before it is shared

  // Bytes this process sent to / received from `process` over its link, since
  // the world started (what the benchmark and tests read to see the routes).
  void CountSent(int process, uint64_t bytes) const {
    sent_[process].fetch_add(bytes, std::memory_order_relaxed);
  }
  void CountReceived(int process, uint64_t bytes) const {
    received_[process].fetch_add(bytes, std::memory_order_relaxed);
  }
  uint64_t sent(int process) const { return sent_[process].load(std::memory_order_relaxed); }
  uint64_t received(int process) const {
    return received_[process].load(std::memory_order_relaxed);
  }

  // The calls this process's devices made on the engine since the world
  // started, by what made them: jax_smddp's custom calls, by collective, and
  // XLA's own collectives through the MPI ABI library (xla_ffi/mpiabi, CPU)
  // or the NCCL API front end (cuda/ncclapi, GPUs), by function. Per call of one device: the bytes
  // the call delivers into that device's output (for MPI_Sendrecv and MPI_Irecv, its receive
  // buffer). What jax_smddp.distributed.traffic_by_op() reads: which library moved each
  // collective's bytes.
  enum class Caller : int {
    // kCustomCalls + k: jax_smddp's custom calls of Collective k
    // (xla_ffi/common/collective.h; CustomCall).
    kCustomCalls = 0,
    kMpiAllgather = kCollectives,
    kMpiAllreduce,
    kMpiReduceScatter,
    kMpiSendrecv,
    kMpiIrecv,
    kNcclAllGather,
    kNcclReduceScatter,
    kNcclAllReduce,
    kNcclAlltoAll,
    kNcclPermute,  // a group of ncclSend/ncclRecv that forms a permutation
    kCount
  };
  static Caller CustomCall(Collective c) { return Caller(int(Caller::kCustomCalls) + int(c)); }
  // "all_gather", ..., "MPI_Allgather", ...: as traffic_by_op() names them.
  static const char* CallerName(Caller c) {
    if (int(c) < kCollectives) return CollectiveName(Collective(int(c)));
    static const char* const kNames[] = {"MPI_Allgather",     "MPI_Allreduce", "MPI_Reduce_scatter",
                                         "MPI_Sendrecv",      "MPI_Irecv",     "ncclAllGather",
                                         "ncclReduceScatter", "ncclAllReduce", "ncclAlltoAll",
                                         "ncclSend/ncclRecv"};
    static_assert(sizeof(kNames) / sizeof(kNames[0]) + kCollectives == size_t(Caller::kCount),
                  "a name each");
    return kNames[int(c) - kCollectives];
  }
  void CountCall(Caller c, uint64_t bytes) const {
    calls_[int(c)].fetch_add(1, std::memory_order_relaxed);
    call_bytes_[int(c)].fetch_add(bytes, std::memory_order_relaxed);
  }
  uint64_t calls(Caller c) const { return calls_[int(c)].load(std::memory_order_relaxed); }
  uint64_t call_bytes(Caller c) const {
    return call_bytes_[int(c)].load(std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<void> endpoint_;  // declared first: destroyed after the links
  int process_;
  std::vector<Peer> peers_;
  std::unique_ptr<std::atomic<uint64_t>[]> sent_, received_;
  mutable std::atomic<uint64_t> calls_[int(Caller::kCount)] = {};
  mutable std::atomic<uint64_t> call_bytes_[int(Caller::kCount)] = {};
  std::string fabric_provider_, fabric_node_;
  bool oversubscribed_ = false;
  int local_processes_ = 0;
};

// The current world; null before initialize() and after shutdown().
std::shared_ptr<const World> CurrentWorld();
// Where a call counts itself (CountCall): the current world, or where there is none (a
// one-process job, before initialize()) this engine copy's world of this process alone,
// which is never current and has no links: it only counts, so that traffic_by_op() reads
// a one-process job's calls as a multi-process job's.
std::shared_ptr<const World> CountingWorld();
// `world`'s counted calls, per caller that made any: (CallerName, calls, bytes delivered), as
// the modules' world_calls hand them to traffic_by_op().
std::vector<std::tuple<std::string, uint64_t, uint64_t>> CallCounts(const World& world);

// Each extension module (_smddp_cpu, _smddp_cuda) links its own copy of the
// engine. The world is built by _smddp_cpu's copy; the CUDA module reads it
// through that copy's CopyCurrentWorld, handed over once at import
// (UseWorldOf), so both see one world. Both copies are built from the same
// sources by the same build, so the World they share has one layout.
using WorldSource = void (*)(std::shared_ptr<const World>* out);
void CopyCurrentWorld(std::shared_ptr<const World>* out);
void UseWorldOf(WorldSource source);

// Bootstrap, in the order initialize() calls it. Each step names what failed.
Status WorldBegin(int process, int processes);
Status WorldSetPeer(int process, int pid, const std::string& host);
Status WorldSetOversubscribed(bool oversubscribed);
// Same host: the lower-numbered process creates the segment and publishes its
// name; the other maps it; the creator unlinks the name once both have.
Status WorldCreateShm(int peer, std::string* name);
Status WorldOpenShm(int peer, const std::string& name);
Status WorldUnlinkShm(int peer);
// Other hosts: one libfabric endpoint per NIC of this process (`nodes`: each
// NIC's local address, or "domain:<name>" for a libfabric domain such as an
// EFA device; "" = the provider's default); their addresses, in that order,
// are published.
Status WorldOpenFabric(const std::string& provider, const std::vector<std::string>& nodes,
                       std::vector<std::string>* addresses, std::string* chosen_provider);
Status WorldOpenFabric(const std::string& provider, const std::string& node, std::string* address,
                       std::string* chosen_provider);  // one NIC
// The link to `peer` over the NIC pairs `stripes`: {this process's NIC (an
// index into WorldOpenFabric's nodes), the peer NIC's published address}.
// Several pairs make a striped link (striped_link.h); both processes must
// list the same pairs in the same order.
Status WorldConnectFabric(int peer, const std::vector<std::pair<int, std::string>>& stripes);
Status WorldConnectFabric(int peer, const std::string& address);  // NIC 0 to one address
// Other hosts: a TCP connection per pair, idle, to notice a peer's exit at
// once (peer_watch.h). Higher-numbered processes connect to lower ones.
Status WorldWatchListen(const std::string& node, std::string* address);
Status WorldWatchConnect(int peer, const std::string& address);
Status WorldWatchAccept(const std::vector<int>& peers);
// Makes the world current.
Status WorldStart();
// Before WorldShutdown when this process's program ends normally: says farewell to every
// process on another host and waits until each has said it too or exited, at most the
// collective timeout (peer_watch.h's Farewell), so that no peer still finishing a collective
// loses what this process sent. Returns the processes that did neither in time.
std::vector<int> WorldFarewell();
// Drops the current world (and any half-built one): links close once no call uses them.
void WorldShutdown();

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_WORLD_H_
