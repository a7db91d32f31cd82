#include "xla_ffi/transports/world.h"

#include <unistd.h>

#include <map>
#include <mutex>

#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/fabric_link.h"
#include "xla_ffi/transports/peer_watch.h"
#include "xla_ffi/transports/shm_link.h"
#include "xla_ffi/transports/striped_link.h"

namespace smddp {

namespace {

// The world being built by the bootstrap steps.
struct Pending {
  int process = -1;
  std::vector<World::Peer> peers;
  struct Shm {
    std::string name;
    std::shared_ptr<ShmSegment> segment;
    bool creator = false;
    bool unlinked = false;
  };
  std::map<int, Shm> shm;
  // One endpoint per NIC (WorldOpenFabric's nodes, in order); shared with the world.
  std::shared_ptr<std::vector<std::unique_ptr<FabricEndpoint>>> fabric;
  std::string fabric_provider, fabric_node;
  std::unique_ptr<PeerWatch> watch;
  bool oversubscribed = false;
};

constexpr double kConnectTimeoutS = 300;

std::mutex g_mu;
std::shared_ptr<const World> g_world;
std::unique_ptr<Pending> g_pending;
// The current world's watch connections (peer -> a duplicate of the descriptor its link
// watches), for WorldFarewell.
std::map<int, int> g_farewell_fds;

void CloseFarewellFdsLocked() {
  for (auto& [peer, fd] : g_farewell_fds) close(fd);
  g_farewell_fds.clear();
}

Status NotBegun() {
  return Status::InvalidArgument(
      "jax_smddp: bootstrap step before WorldBegin (call jax_smddp.initialize())");
}

Status CheckPeer(const Pending& p, int peer) {
  if (peer < 0 || peer >= int(p.peers.size()) || peer == p.process)
    return Status::InvalidArgument("jax_smddp: bootstrap names process " + std::to_string(peer) +
                                   ", which is not a peer of process " + std::to_string(p.process));
  return Status::Ok();
}

}  // namespace

namespace {
std::atomic<WorldSource> g_source{nullptr};  // another module's world, when handed over
}  // namespace

std::shared_ptr<const World> CurrentWorld() {
  if (WorldSource source = g_source.load(std::memory_order_acquire)) {
    std::shared_ptr<const World> world;
    source(&world);
    return world;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  return g_world;
}

std::shared_ptr<const World> CountingWorld() {
  if (auto world = CurrentWorld()) return world;
  // Made once, kept for the process's life: its counts run from the first call.
  static const auto* alone = new std::shared_ptr<const World>(
      std::make_shared<World>(0, std::vector<World::Peer>(1), nullptr));
  return *alone;
}

std::vector<std::tuple<std::string, uint64_t, uint64_t>> CallCounts(const World& world) {
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> out;
  for (int c = 0; c < int(World::Caller::kCount); ++c) {
    const auto caller = World::Caller(c);
    if (world.calls(caller))
      out.emplace_back(World::CallerName(caller), world.calls(caller), world.call_bytes(caller));
  }
  return out;
}

void CopyCurrentWorld(std::shared_ptr<const World>* out) { *out = CurrentWorld(); }

void UseWorldOf(WorldSource source) {
  if (source != &CopyCurrentWorld) g_source.store(source, std::memory_order_release);
}

Status WorldBegin(int process, int processes) {
  if (processes < 1 || process < 0 || process >= processes)
    return Status::InvalidArgument("jax_smddp: process " + std::to_string(process) + " of " +
                                   std::to_string(processes) + " is not a valid process index");
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_pending) {
    for (auto& [peer, shm] : g_pending->shm)
      if (shm.creator && !shm.unlinked) UnlinkShmSegment(shm.name);
  }
  g_pending = std::make_unique<Pending>();
  g_pending->process = process;
  g_pending->peers.resize(processes);
  return Status::Ok();
}

Status WorldSetPeer(int process, int pid, const std::string& host) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  if (process < 0 || process >= int(g_pending->peers.size()))
    return Status::InvalidArgument("jax_smddp: no process " + std::to_string(process));
  g_pending->peers[process].pid = pid;
  g_pending->peers[process].host = host;
  return Status::Ok();
}

Status WorldSetOversubscribed(bool oversubscribed) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  g_pending->oversubscribed = oversubscribed;
  return Status::Ok();
}

Status WorldCreateShm(int peer, std::string* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  SMDDP_RETURN_IF_ERROR(CheckPeer(*g_pending, peer));
  Pending::Shm shm;
  shm.creator = true;
  SMDDP_RETURN_IF_ERROR(CreateShmSegment(DefaultShmRingBytes(), &shm.name, &shm.segment));
  *name = shm.name;
  g_pending->peers[peer].link = MakeShmLink(shm.segment, true, g_pending->peers[peer].pid);
  g_pending->shm[peer] = std::move(shm);
  return Status::Ok();
}

Status WorldOpenShm(int peer, const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  SMDDP_RETURN_IF_ERROR(CheckPeer(*g_pending, peer));
  Pending::Shm shm;
  shm.name = name;
  SMDDP_RETURN_IF_ERROR(OpenShmSegment(name, &shm.segment));
  g_pending->peers[peer].link = MakeShmLink(shm.segment, false, g_pending->peers[peer].pid);
  g_pending->shm[peer] = std::move(shm);
  return Status::Ok();
}

Status WorldUnlinkShm(int peer) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  auto it = g_pending->shm.find(peer);
  if (it == g_pending->shm.end() || !it->second.creator)
    return Status::Error("jax_smddp: no shared-memory segment created for process " +
                         std::to_string(peer));
  it->second.unlinked = true;
  return UnlinkShmSegment(it->second.name);
}

Status WorldOpenFabric(const std::string& provider, const std::vector<std::string>& nodes,
                       std::vector<std::string>* addresses, std::string* chosen_provider) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  std::string why;
  if (!FabricAvailable(&why))
    return Status::Unsupported(
        "jax_smddp: processes on other hosts need libfabric, which is not usable "
        "here: " +
        why);
  if (nodes.empty()) return Status::InvalidArgument("jax_smddp: WorldOpenFabric with no NIC");
  auto endpoints = std::make_shared<std::vector<std::unique_ptr<FabricEndpoint>>>();
  const std::string chosen = ChooseFabricProvider(provider);
  addresses->clear();
  for (const std::string& node : nodes) {
    std::unique_ptr<FabricEndpoint> ep;
    Status st = FabricEndpoint::Open(chosen, node, &ep);
    if (!st.ok())
      return Status::WithCode(st.code(), "jax_smddp: the libfabric endpoint of NIC " +
                                             std::to_string(endpoints->size()) + " (" + node +
                                             "): " + st.message());
    addresses->push_back(ep->Address());
    endpoints->push_back(std::move(ep));
  }
  *chosen_provider = (*endpoints)[0]->Provider();
  g_pending->fabric = std::move(endpoints);
  g_pending->fabric_provider = *chosen_provider;
  g_pending->fabric_node = nodes[0];
  return Status::Ok();
}

Status WorldOpenFabric(const std::string& provider, const std::string& node, std::string* address,
                       std::string* chosen_provider) {
  std::vector<std::string> addresses;
  SMDDP_RETURN_IF_ERROR(
      WorldOpenFabric(provider, std::vector<std::string>{node}, &addresses, chosen_provider));
  *address = addresses[0];
  return Status::Ok();
}

Status WorldConnectFabric(int peer, const std::vector<std::pair<int, std::string>>& stripes) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  SMDDP_RETURN_IF_ERROR(CheckPeer(*g_pending, peer));
  if (!g_pending->fabric)
    return Status::Error("jax_smddp: no libfabric endpoint open (WorldOpenFabric first)");
  if (stripes.empty())
    return Status::InvalidArgument("jax_smddp: no NIC pair to reach process " +
                                   std::to_string(peer));
  std::vector<std::unique_ptr<Link>> links;
  for (const auto& [nic, address] : stripes) {
    if (nic < 0 || nic >= int(g_pending->fabric->size()))
      return Status::InvalidArgument("jax_smddp: NIC " + std::to_string(nic) +
                                     " of this process does not exist (it opened " +
                                     std::to_string(g_pending->fabric->size()) + ")");
    std::unique_ptr<Link> link;
    SMDDP_RETURN_IF_ERROR(
        (*g_pending->fabric)[nic]->Connect(address, "process " + std::to_string(peer), &link));
    links.push_back(std::move(link));
  }
  g_pending->peers[peer].link =
      StripedLink(std::move(links), size_t(IntSetting("JAX_SMDDP_FABRIC_STRIPE_BYTES")));
  return Status::Ok();
}

Status WorldConnectFabric(int peer, const std::string& address) {
  return WorldConnectFabric(peer, std::vector<std::pair<int, std::string>>{{0, address}});
}

Status WorldWatchListen(const std::string& node, std::string* address) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  SMDDP_RETURN_IF_ERROR(PeerWatch::Listen(node, &g_pending->watch));
  *address = g_pending->watch->Address();
  return Status::Ok();
}

Status WorldWatchConnect(int peer, const std::string& address) {
  PeerWatch* watch;
  int self;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_pending) return NotBegun();
    SMDDP_RETURN_IF_ERROR(CheckPeer(*g_pending, peer));
    if (!g_pending->watch) return Status::Error("jax_smddp: WorldWatchListen first");
    watch = g_pending->watch.get();
    self = g_pending->process;
  }
  return watch->Connect(self, peer, address, kConnectTimeoutS);
}

Status WorldWatchAccept(const std::vector<int>& peers) {
  PeerWatch* watch;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_pending) return NotBegun();
    if (!g_pending->watch) return Status::Error("jax_smddp: WorldWatchListen first");
    watch = g_pending->watch.get();
  }
  return watch->AcceptFrom(peers, kConnectTimeoutS);
}

Status WorldStart() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_pending) return NotBegun();
  CloseFarewellFdsLocked();  // a previous world's, if it was never shut down
  if (g_pending->watch) {
    for (int p = 0; p < int(g_pending->peers.size()); ++p) {
      const int fd = g_pending->watch->TakeFd(p);
      if (fd < 0) continue;
      auto& link = g_pending->peers[p].link;
      if (!link) {
        close(fd);
        continue;
      }
      const int farewell_fd = dup(fd);
      if (farewell_fd >= 0) g_farewell_fds[p] = farewell_fd;
      link = WatchLink(std::move(link), fd, "process " + std::to_string(p));
    }
    g_pending->watch.reset();
  }
  for (auto& [peer, shm] : g_pending->shm) {
    if (shm.creator && !shm.unlinked) {
      UnlinkShmSegment(shm.name);
      shm.unlinked = true;
    }
  }
  auto world = std::make_shared<World>(g_pending->process, std::move(g_pending->peers),
                                       std::shared_ptr<void>(g_pending->fabric));
  if (g_pending->fabric) world->set_fabric(g_pending->fabric_provider, g_pending->fabric_node);
  world->set_oversubscribed(g_pending->oversubscribed);
  g_world = std::move(world);
  g_pending.reset();
  return Status::Ok();
}

std::vector<int> WorldFarewell() {
  std::map<int, int> fds;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    fds.swap(g_farewell_fds);
  }
  std::vector<int> silent = Farewell(fds, Timeout());
  for (auto& [peer, fd] : fds) close(fd);
  return silent;
}

void WorldShutdown() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_pending) {
    for (auto& [peer, shm] : g_pending->shm)
      if (shm.creator && !shm.unlinked) UnlinkShmSegment(shm.name);
    g_pending.reset();
  }
  CloseFarewellFdsLocked();
  g_world.reset();
}

}  // namespace smddp
