#include "cuda/ncclapi/nccl_comm.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include <cuda_runtime_api.h>

#include "cuda/gpu_hierarchy.h"
#include "cuda/ncclapi/nccl_joining.h"
#include "cuda/ncclapi/real_nccl.h"
#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/settings.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/transports/link.h"

namespace smddp {
namespace nccl {
namespace {
constexpr uint64_t kIdMagic = 0x01434e7064646d73ull;  // "smddpNC\x01"

// The front end's part of an id, after the real library's.
struct IdTail {
  uint64_t magic;
  uint64_t nonce[2];
  int32_t root;    // the process that made the id (-1: no world)
  uint32_t flags;  // none yet
  uint64_t reserved;
};
static_assert(kRealIdBytes + sizeof(IdTail) == NCCL_UNIQUE_ID_BYTES, "the id is full");

}  // namespace

// A real library's id for a new communicator, when the library is there and
// its id fits the front end's (the bytes past kRealIdBytes are zero).
bool NewRealId(uint8_t out[kRealIdBytes]) {
  std::string why;
  using Fn = ncclResult_t (*)(ncclUniqueId*);
  auto fn = reinterpret_cast<Fn>(RealSymbol("ncclGetUniqueId", &why));
  if (!fn) return false;
  ncclUniqueId real;
  std::memset(&real, 0, sizeof(real));
  if (fn(&real) != ncclSuccess) return false;
  for (size_t i = kRealIdBytes; i < sizeof(real.internal); ++i)
    if (real.internal[i] != 0) return false;
  std::memcpy(out, real.internal, kRealIdBytes);
  return true;
}

uint64_t Tag(const uint64_t nonce[2], uint64_t what, uint64_t a, uint64_t b) {
  return MixTag(MixTag(MixTag(MixTag(MixTag(0x6e63636c2d6a6f69ull, nonce[0]), nonce[1]), what), a),
                b);
}

// Waits for `req` on `link` (to `peer`) within the deadline.
Status Await(const World& world, int peer, Request& req, const std::string& what,
             Clock::time_point deadline) {
  Link* link = world.link(peer);
  while (!req.done()) {
    const uint32_t seen = link->Activity();
    link->Progress();
    if (req.done()) break;
    const std::string failure = link->PeerFailure();
    if (!failure.empty()) {
      link->Cancel(&req);
      return Status::WithCode(link->PeerFailureCode(), "jax_smddp NCCL front end: " + what +
                                                           ": process " + std::to_string(peer) +
                                                           " failed: " + failure);
    }
    if (Clock::now() > deadline) {
      link->Cancel(&req);
      return Status::Timeout("jax_smddp NCCL front end: " + what + ": process " +
                             std::to_string(peer) + " did not answer within " +
                             std::to_string(int(TimeoutSeconds())) + " s (JAX_SMDDP_TIMEOUT_S)");
    }
    link->AwaitActivity(seen, 1000);
  }
  return req.status();
}

namespace {
std::mutex joins_mu;
std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Joining>>& Joins() {
  static auto* joins = new std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Joining>>;
  return *joins;
}

}  // namespace

std::shared_ptr<Joining> JoiningOf(const uint64_t nonce[2]) {
  std::lock_guard<std::mutex> lock(joins_mu);
  auto& j = Joins()[{nonce[0], nonce[1]}];
  if (!j) j = std::make_shared<Joining>();
  return j;
}

namespace {

std::string Missing(const std::vector<Entry>& table, const std::vector<bool>& have) {
  std::string out;
  int listed = 0;
  for (size_t r = 0; r < have.size(); ++r) {
    if (have[r]) continue;
    if (listed++ == 8) return out + ", ...";
    out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  (void)table;
  return out;
}

// The root's side: every entry, from this process's ranks (added under the
// lock by their threads) and from join messages of any other process.
Status Collect(const World& world, const uint64_t nonce[2], int nranks, Joining& j,
               std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
  const int me = world.process();
  struct Pending {
    Request req;
    Entry entry{};
    uint64_t seq = 0;
    bool posted = false;
  };
  std::vector<std::unique_ptr<Pending>> pending(world.processes());
  auto post = [&](int q) {
    Pending& p = *pending[q];
    p.req.Reset();
    world.link(q)->Recv(Tag(nonce, kJoin, uint64_t(q), p.seq), &p.entry, sizeof(Entry), &p.req);
    p.posted = true;
  };
  for (int q = 0; q < world.processes(); ++q) {
    if (q == me || !world.link(q)) continue;
    pending[q] = std::make_unique<Pending>();
    post(q);
  }
  auto cancel_all = [&] {
    for (int q = 0; q < world.processes(); ++q)
      if (pending[q] && pending[q]->posted && !pending[q]->req.done())
        world.link(q)->Cancel(&pending[q]->req);
  };
  std::vector<bool> have(nranks, false);
  for (int r = 0; r < nranks; ++r) have[r] = j.table[r].nranks != 0;
  while (true) {
    int complete = 0;
    for (int r = 0; r < nranks; ++r) complete += have[r] = have[r] || j.table[r].nranks != 0;
    if (complete == nranks) break;
    if (Clock::now() > deadline) {
      cancel_all();
      // The processes that joined wait for a table: they get one that says so.
      std::set<int> joined;
      for (const Entry& e : j.table)
        if (e.nranks != 0 && e.process != me) joined.insert(e.process);
      std::vector<Entry> failed(nranks, Entry{-1, -1, -1, -1, 0, 0});
      lock.unlock();
      for (int q : joined) {
        Request req;
        world.link(q)->Send(Tag(nonce, kTable, uint64_t(q), 0), failed.data(),
                            sizeof(Entry) * failed.size(), &req);
        Await(world, q, req, "telling a joined process", Clock::now() + std::chrono::seconds(2));
      }
      lock.lock();
      return Status::Timeout("jax_smddp NCCL front end: ncclCommInitRank: ranks " +
                             Missing(j.table, have) + " of " + std::to_string(nranks) +
                             " never joined within " + std::to_string(int(TimeoutSeconds())) +
                             " s (JAX_SMDDP_TIMEOUT_S); is every process of the clique running?");
    }
    lock.unlock();
    bool moved = false;
    for (int q = 0; q < world.processes(); ++q) {
      if (!pending[q]) continue;
      Pending& p = *pending[q];
      world.link(q)->Progress();
      if (!p.req.done()) continue;
      if (!p.req.status().ok()) {
        lock.lock();
        cancel_all();
        return p.req.status();
      }
      moved = true;
      const Entry e = p.entry;
      lock.lock();
      if (e.rank < 0 || e.rank >= nranks || e.nranks != nranks || e.process != q) {
        cancel_all();
        return Status::InvalidArgument("jax_smddp NCCL front end: process " + std::to_string(q) +
                                       " joined a communicator of " + std::to_string(nranks) +
                                       " ranks as rank " + std::to_string(e.rank) + " of " +
                                       std::to_string(e.nranks) +
                                       " (the processes disagree on the clique)");
      }
      j.table[e.rank] = e;
      lock.unlock();
      p.seq++;
      post(q);
    }
    if (!moved) std::this_thread::sleep_for(std::chrono::microseconds(200));
    lock.lock();
  }
  cancel_all();
  // Every member process but this one gets the table.
  std::set<int> members;
  for (const Entry& e : j.table) members.insert(e.process);
  lock.unlock();
  Status st;
  for (int q : members) {
    if (q == me) continue;
    Request req;
    world.link(q)->Send(Tag(nonce, kTable, uint64_t(q), 0), j.table.data(),
                        sizeof(Entry) * j.table.size(), &req);
    st = Await(world, q, req, "sending the communicator's table", deadline);
    if (!st.ok()) break;
  }
  lock.lock();
  return st;
}

// Every rank's entry, as the table the root made. `root` < 0: no world, all
// ranks are threads of this process.
Status Join(const uint64_t nonce[2], int root, int nranks, const Entry& mine,
            const std::shared_ptr<const World>& world, std::vector<Entry>* table,
            std::shared_ptr<Joining>* joining) {
  const auto deadline = Clock::now() + Timeout();
  auto j = JoiningOf(nonce);
  *joining = j;
  const int me = world ? world->process() : -1;
  const bool at_root = root < 0 || root == me;
  if (root >= 0 && (!world || root >= world->processes() || (!at_root && !world->link(root))))
    return Status::InvalidArgument(
        "jax_smddp NCCL front end: the communicator's id was made by process " +
        std::to_string(root) +
        ", which this process has no link to (is jax_smddp initialized in every process?)");
  std::unique_lock<std::mutex> lock(j->mu);
  if (j->table.empty()) j->table.assign(nranks, Entry{});
  if (int(j->table.size()) != nranks)
    return Status::InvalidArgument(
        "jax_smddp NCCL front end: two ranks of this process disagree "
        "on the communicator's size");
  if (at_root) {
    if (j->table[mine.rank].nranks != 0)
      return Status::InvalidArgument("jax_smddp NCCL front end: rank " + std::to_string(mine.rank) +
                                     " joined twice");
    j->table[mine.rank] = mine;
  } else {
    const uint64_t seq = uint64_t(j->sent++);
    lock.unlock();
    Request req;
    world->link(root)->Send(Tag(nonce, kJoin, uint64_t(me), seq), &mine, sizeof(Entry), &req);
    const Status st = Await(*world, root, req, "joining a communicator", deadline);
    lock.lock();
    if (!st.ok()) return st;
  }
  j->cv.notify_all();
  if (!j->working && !j->done) {
    j->working = true;
    Status st;
    if (at_root) {
      if (world) {
        st = Collect(*world, nonce, nranks, *j, lock, deadline);
      } else {
        while (true) {  // threads of this process only
          int complete = 0;
          for (const Entry& e : j->table) complete += e.nranks != 0;
          if (complete == nranks) break;
          if (j->cv.wait_until(lock, deadline) == std::cv_status::timeout) {
            st = Status::Timeout(
                "jax_smddp NCCL front end: ncclCommInitRank: " + std::to_string(complete) + " of " +
                std::to_string(nranks) + " ranks joined within the deadline");
            break;
          }
        }
      }
    } else {
      std::vector<Entry> got(nranks);
      lock.unlock();
      Request req;
      world->link(root)->Recv(Tag(nonce, kTable, uint64_t(me), 0), got.data(),
                              sizeof(Entry) * got.size(), &req);
      // The root gives up at its deadline and says so: wait a little longer.
      st = Await(*world, root, req, "receiving the communicator's table",
                 deadline + std::chrono::seconds(3));
      lock.lock();
      if (st.ok() && got[0].nranks == -1)
        st = Status::Timeout(
            "jax_smddp NCCL front end: ncclCommInitRank: ranks of the "
            "communicator never joined within " +
            std::to_string(int(TimeoutSeconds())) + " s (process " + std::to_string(root) +
            ", its root, gave up waiting; JAX_SMDDP_TIMEOUT_S)");
      if (st.ok()) j->table = got;
    }
    j->status = st;
    j->done = true;
    j->cv.notify_all();
  }
  while (!j->done) {
    if (j->cv.wait_until(lock, deadline + std::chrono::seconds(5)) == std::cv_status::timeout &&
        !j->done)
      return Status::Timeout(
          "jax_smddp NCCL front end: ncclCommInitRank: the communicator's "
          "table never came");
  }
  if (!j->status.ok()) return j->status;
  *table = j->table;
  return Status::Ok();
}

// The member ids of the GPU communicator: distinct per communicator and rank.
std::vector<int64_t> MembersOf(const uint64_t nonce[2], int nranks) {
  std::vector<int64_t> members(nranks);
  for (int r = 0; r < nranks; ++r)
    members[r] = int64_t(MixTag(MixTag(nonce[0], nonce[1]), uint64_t(r)) & 0x3fffffffffffffffull);
  return members;
}

void PutU64(std::string* out, uint64_t v) { out->append(reinterpret_cast<const char*>(&v), 8); }

// This process's part of the GPU communicator's set-up, once per process:
// prepare its ranks, trade handles with every other member process, connect.
Status SetUpGpu(const uint64_t nonce[2], const std::vector<int64_t>& members,
                const std::vector<Entry>& table, const std::shared_ptr<const World>& world,
                Joining& j) {
  std::unique_lock<std::mutex> lock(j.mu);
  if (j.set_up) return j.set_up_status;
  if (j.setting_up) {
    while (!j.set_up) j.cv.wait(lock);
    return j.set_up_status;
  }
  j.setting_up = true;
  lock.unlock();
  const int me = world ? world->process() : -1;
  const int nranks = int(table.size());
  std::vector<std::pair<int, int>> local;
  std::set<int> processes;
  for (const Entry& e : table) {
    processes.insert(e.process);
    if (e.process == me) local.emplace_back(e.rank, e.ordinal);
  }
  const auto deadline = Clock::now() + Timeout();
  std::vector<std::pair<int, std::string>> handles, remote;
  Status st =
      gpu::PrepareCommunicator(members, size_t(IntSetting("JAX_SMDDP_GPU_SLOT_BYTES")), local,
                               int(processes.size()), &handles, gpu::NcclFrontEndPreferences());
  if (st.ok() && processes.size() > 1) {
    std::string payload;
    for (const auto& [rank, bytes] : handles) {
      PutU64(&payload, uint64_t(rank));
      PutU64(&payload, bytes.size());
      payload += bytes;
    }
    const uint64_t size = payload.size();
    // Post every receive first, then send: no order between processes needed.
    struct Incoming {
      Request size_req, data_req;
      uint64_t size = 0;
      std::string data;
    };
    std::map<int, Incoming> in;
    for (int q : processes) {
      if (q == me) continue;
      Incoming& inc = in[q];
      world->link(q)->Recv(Tag(nonce, kHandleSize, uint64_t(q), uint64_t(me)), &inc.size, 8,
                           &inc.size_req);
    }
    for (int q : processes) {
      if (q == me || !st.ok()) continue;
      Request a, b;
      world->link(q)->Send(Tag(nonce, kHandleSize, uint64_t(me), uint64_t(q)), &size, 8, &a);
      st = Await(*world, q, a, "sending GPU handles", deadline);
      if (!st.ok()) break;
      world->link(q)->Send(Tag(nonce, kHandles, uint64_t(me), uint64_t(q)), payload.data(),
                           payload.size(), &b);
      st = Await(*world, q, b, "sending GPU handles", deadline);
    }
    for (auto& [q, inc] : in) {
      if (!st.ok()) {
        world->link(q)->Cancel(&inc.size_req);
        continue;
      }
      st = Await(*world, q, inc.size_req, "receiving GPU handles", deadline);
      if (!st.ok()) continue;
      if (inc.size > (64u << 20)) {
        st = Status::Error("jax_smddp NCCL front end: process " + std::to_string(q) +
                           " sent malformed GPU handles");
        continue;
      }
      inc.data.resize(inc.size);
      world->link(q)->Recv(Tag(nonce, kHandles, uint64_t(q), uint64_t(me)), inc.data.data(),
                           inc.data.size(), &inc.data_req);
      st = Await(*world, q, inc.data_req, "receiving GPU handles", deadline);
      size_t at = 0;
      while (st.ok() && at + 16 <= inc.data.size()) {
        uint64_t rank, len;
        std::memcpy(&rank, inc.data.data() + at, 8);
        std::memcpy(&len, inc.data.data() + at + 8, 8);
        at += 16;
        if (rank >= uint64_t(nranks) || at + len > inc.data.size()) {
          st = Status::Error("jax_smddp NCCL front end: process " + std::to_string(q) +
                             " sent malformed GPU handles");
          break;
        }
        remote.emplace_back(int(rank), inc.data.substr(at, len));
        at += len;
      }
    }
  }
  if (st.ok()) st = gpu::ConnectCommunicator(members, remote);
  lock.lock();
  j.set_up_status = st;
  j.set_up = true;
  j.cv.notify_all();
  return st;
}

Status CurrentOrdinal(int* ordinal) {
  const cudaError_t err = cudaGetDevice(ordinal);
  if (err != cudaSuccess)
    return Status::Error(std::string("jax_smddp NCCL front end: cudaGetDevice failed: ") +
                         cudaGetErrorString(err));
  return Status::Ok();
}

// A communicator across hosts (equal ranks per host, as the hierarchical
// bodies need): this host's ranks form an intra-host GPU communicator (set
// up as one inside a host, under a nonce of its own), then the group's
// network ports over the world's links (staged through host memory). Every
// process decides alike from the same table.
Status BuildAcrossHosts(const uint64_t nonce[2], const std::vector<Entry>& table, int rank,
                        const std::shared_ptr<const World>& world, Comm* comm) {
  const int n = int(table.size());
  std::vector<std::string> order;  // hosts by first appearance in rank order
  std::vector<int> host_of(n), process_of(n);
  for (int r = 0; r < n; ++r) {
    const std::string& host = world->peer(table[r].process).host;
    auto it = std::find(order.begin(), order.end(), host);
    host_of[r] = int(it - order.begin());
    if (it == order.end()) order.push_back(host);
    process_of[r] = table[r].process;
  }
  std::vector<int> per_host(order.size(), 0);
  for (int h : host_of) per_host[h]++;
  for (int c : per_host)
    if (c != per_host[0]) {
      comm->forwarded_because = "the communicator's hosts hold different numbers of its ranks";
      return Status::Ok();
    }
  const int mine = host_of[rank];
  std::vector<int64_t> intra_members;
  std::vector<Entry> intra_table;
  std::vector<std::pair<int, int>> local;
  for (int r = 0; r < n; ++r) {
    if (table[r].process == world->process()) local.emplace_back(r, table[r].ordinal);
    if (host_of[r] != mine) continue;
    Entry e = table[r];
    e.rank = int32_t(intra_table.size());
    e.nranks = per_host[mine];
    intra_table.push_back(e);
    intra_members.push_back(comm->members[r]);
  }
  const uint64_t intra_nonce[2] = {MixTag(nonce[0], 0x686f7374ull + uint64_t(mine)),
                                   MixTag(nonce[1], uint64_t(mine))};
  SMDDP_RETURN_IF_ERROR(
      SetUpGpu(intra_nonce, intra_members, intra_table, world, *JoiningOf(intra_nonce)));
  bool gdrcopy = false, rail = false;
  SMDDP_RETURN_IF_ERROR(
      gpu::PrepareHierarchy(comm->members, host_of, process_of, local, intra_members,
                            size_t(IntSetting("JAX_SMDDP_GPU_SLOT_BYTES")), {}, &gdrcopy, &rail));
  gpu::GpuHierarchy* hierarchy = gpu::FindHierarchy(gpu::GroupKey(comm->members.data(), n));
  gpu::GpuHierarchy::Member* member = hierarchy ? hierarchy->Find(rank) : nullptr;
  if (!member || !member->local || !member->port)
    return Status::Error("jax_smddp NCCL front end: rank " + std::to_string(rank) +
                         " has no network port after the set-up");
  comm->local = member->local;
  comm->port = member->port;
  comm->rank_of = &hierarchy->rank_of();
  comm->hosts = int(order.size());
  comm->served = true;
  return Status::Ok();
}

// Creates the Comm of `me` from the complete table: served inside one host,
// forwarded (with the reason) across hosts.
Status Build(const uint64_t nonce[2], const std::vector<Entry>& table, int rank,
             const std::shared_ptr<const World>& world, const std::shared_ptr<Joining>& j,
             Comm* comm) {
  comm->nranks = int(table.size());
  comm->rank = rank;
  comm->nonce[0] = nonce[0];
  comm->nonce[1] = nonce[1];
  comm->world = world;
  comm->process_of.resize(table.size());
  std::set<std::string> hosts;
  for (size_t r = 0; r < table.size(); ++r) {
    comm->process_of[r] = table[r].process;
    if (world && table[r].process >= 0) hosts.insert(world->peer(table[r].process).host);
  }
  comm->members = MembersOf(nonce, comm->nranks);
  if (hosts.size() > 1) return BuildAcrossHosts(nonce, table, rank, world, comm);
  SMDDP_RETURN_IF_ERROR(SetUpGpu(nonce, comm->members, table, world, *j));
  gpu::GpuCommunicator* gpu_comm =
      gpu::FindCommunicator(gpu::GroupKey(comm->members.data(), comm->nranks));
  comm->local = gpu_comm ? gpu_comm->Local(rank) : nullptr;
  if (!comm->local)
    return Status::Error("jax_smddp NCCL front end: rank " + std::to_string(rank) +
                         " has no GPU region after the set-up");
  comm->served = true;
  return Status::Ok();
}

void RandomNonce(uint64_t nonce[2]) {
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  bool ok = false;
  if (fd >= 0) {
    ok = ::read(fd, nonce, 16) == 16;
    ::close(fd);
  }
  if (!ok) {
    std::random_device rd;
    nonce[0] = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(Clock::now().time_since_epoch().count());
    nonce[1] = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(::getpid());
  }
}

// The caller's ncclConfig_t as it came (empty for none).
std::vector<unsigned char> ConfigBytes(const ncclConfig_t* config) {
  if (!config) return {};
  const auto* bytes = reinterpret_cast<const unsigned char*>(config);
  return std::vector<unsigned char>(bytes, bytes + std::min<size_t>(config->size, 4096));
}

}  // namespace

namespace {
std::mutex live_mu;
std::set<const Comm*>& Live() {  // guarded by live_mu
  static auto* live = new std::set<const Comm*>;
  return *live;
}
}  // namespace

Comm* AsComm(ncclComm_t handle) {
  auto* comm = reinterpret_cast<Comm*>(handle);
  std::lock_guard<std::mutex> lock(live_mu);
  return Live().count(comm) ? comm : nullptr;
}

ncclComm_t Publish(Comm* comm) {
  std::lock_guard<std::mutex> lock(live_mu);
  Live().insert(comm);
  return reinterpret_cast<ncclComm_t>(comm);
}

Comm* WrapReal(ncclComm_t real, const std::string& why) {
  auto* c = new Comm;
  c->real = real;
  c->forwarded_because = why;
  using Query = ncclResult_t (*)(const ncclComm_t, int*);
  std::string missing;
  if (auto fn = reinterpret_cast<Query>(RealSymbol("ncclCommCount", &missing)))
    fn(real, &c->nranks);
  if (auto fn = reinterpret_cast<Query>(RealSymbol("ncclCommUserRank", &missing)))
    fn(real, &c->rank);
  if (auto fn = reinterpret_cast<Query>(RealSymbol("ncclCommCuDevice", &missing)))
    fn(real, &c->ordinal);
  return c;
}

void Retire(Comm* comm) {
  {
    std::lock_guard<std::mutex> lock(live_mu);
    Live().erase(comm);
  }
  delete comm;
}

std::string UnknownConfig(const ncclConfig_t* config) {
  if (!config) return "";
  if (config->magic != kConfigMagic)
    return "its ncclConfig_t was not initialized with NCCL_CONFIG_INITIALIZER";
  const int v = int(config->version);
  if (!KnownVersion(v) || config->size < sizeof(ncclConfigHead))
    return "its ncclConfig_t is of NCCL " + std::to_string(v / 10000) + "." +
           std::to_string(v / 100 % 100) + ", which this front end does not know (it knows " +
           std::to_string(kOldestKnownVersion / 10000) + "." +
           std::to_string(kOldestKnownVersion / 100 % 100) + " to " +
           std::to_string(kNewestKnownVersion / 10000) + "." +
           std::to_string(kNewestKnownVersion / 100 % 100) + ")";
  return "";
}

Status MakeUniqueId(ncclUniqueId* out) {
  std::memset(out, 0, sizeof(*out));
  IdTail tail{};
  tail.magic = kIdMagic;
  RandomNonce(tail.nonce);
  auto world = CurrentWorld();
  tail.root = world ? world->process() : -1;
  // No real id yet: one is agreed at the communicator's first forwarded call
  // (AgreeRealId), as most communicators never forward one.
  std::memcpy(out->internal + kRealIdBytes, &tail, sizeof(tail));
  return Status::Ok();
}

Status InitRank(int nranks, const ncclUniqueId& id, int rank, const ncclConfig_t* config,
                Comm** out) {
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return Status::InvalidArgument("jax_smddp NCCL front end: rank " + std::to_string(rank) +
                                   " of " + std::to_string(nranks));
  IdTail tail;
  std::memcpy(&tail, id.internal + kRealIdBytes, sizeof(tail));
  auto comm = std::make_unique<Comm>();
  comm->config = ConfigBytes(config);
  SMDDP_RETURN_IF_ERROR(CurrentOrdinal(&comm->ordinal));
  comm->nranks = nranks;
  comm->rank = rank;
  if (tail.magic != kIdMagic) {
    // An id the real library made: the communicator is the real library's.
    comm->forwarded_because = "its id came from another NCCL library";
    std::memcpy(comm->real_id.internal, id.internal, sizeof(id.internal));
    comm->have_real_id = true;
    *out = comm.release();
    return Status::Ok();
  }
  comm->real_id_later = true;
  std::shared_ptr<const World> world = CurrentWorld();
  if (world) gpu::SetProcessIndex(world->process());  // what the GPU handles and watches name
  if (tail.root >= 0 && !world)
    return Status::InvalidArgument(
        "jax_smddp NCCL front end: this process has no jax_smddp world but the communicator's id "
        "was made in a multi-process job; jax_smddp sets the world up as JAX creates its GPU "
        "client (JAX_SMDDP_COLLECTIVES=xla before Python starts)");
  std::string unknown = UnknownConfig(config);
  if (unknown.empty() && !RealLibrary().empty()) {
    std::string why;
    const int version = RealVersion(&why);
    if (version && !KnownVersion(version))
      unknown = "the real NCCL library is version " + std::to_string(version) +
                ", which this front end does not know";
  }
  Entry mine{rank, nranks, world ? world->process() : -1, comm->ordinal, 0, 0};
  std::vector<Entry> table;
  std::shared_ptr<Joining> joining;
  SMDDP_RETURN_IF_ERROR(Join(tail.nonce, tail.root, nranks, mine, world, &table, &joining));
  if (!unknown.empty()) {
    comm->nonce[0] = tail.nonce[0];
    comm->nonce[1] = tail.nonce[1];
    comm->world = world;
    for (const Entry& e : table) comm->process_of.push_back(e.process);
    comm->forwarded_because = unknown;
  } else {
    SMDDP_RETURN_IF_ERROR(Build(tail.nonce, table, rank, world, joining, comm.get()));
  }
  *out = comm.release();
  return Status::Ok();
}

namespace {

// The real side of a split: ncclCommSplit on the parent's real communicator
// (every rank of the parent calls it, NCCL_SPLIT_NOCOLOR ones too: it is
// collective). *real stays null for kNoColor.
Status RealSplit(ncclComm_t parent, int color, int key, std::vector<unsigned char>* config,
                 ncclComm_t* real) {
  *real = nullptr;
  using Fn = ncclResult_t (*)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
  std::string why;
  auto fn = reinterpret_cast<Fn>(RealSymbol("ncclCommSplit", &why));
  if (!fn) return Status::Error("jax_smddp NCCL front end: " + why);
  const ncclResult_t rc =
      fn(parent, color, key, real,
         config->empty() ? nullptr : reinterpret_cast<ncclConfig_t*>(config->data()));
  if (rc != ncclSuccess)
    return Status::Error("jax_smddp NCCL front end: the real ncclCommSplit failed (" +
                         std::to_string(int(rc)) + ")");
  return Status::Ok();
}

// A parent whose calls all go to the real library: its child is the real
// split's, forwarded too. The parent's real communicator is made now if no
// call made it yet (every rank of the parent is in this split).
Status SplitForwarded(Comm& parent, int color, int key, const ncclConfig_t* config, Comm** out) {
  ncclComm_t parent_real = nullptr;
  SMDDP_RETURN_IF_ERROR(RealComm(parent, &parent_real));
  std::vector<unsigned char> bytes = ConfigBytes(config);
  ncclComm_t real = nullptr;
  SMDDP_RETURN_IF_ERROR(RealSplit(parent_real, color, key, &bytes, &real));
  if (!real) return Status::Ok();  // no color
  *out = WrapReal(real, parent.forwarded_because);
  (*out)->config = std::move(bytes);
  return Status::Ok();
}

}  // namespace

Status Split(Comm& parent, int color, int key, const ncclConfig_t* config, Comm** out) {
  *out = nullptr;
  if (!parent.served) return SplitForwarded(parent, color, key, config, out);
  uint64_t nonce[2] = {MixTag(parent.nonce[0], 0x73706c6974ull + parent.splits),
                       MixTag(parent.nonce[1], parent.splits)};
  parent.splits++;
  // Whether the parent has a real communicator is alike in every rank (each
  // made it at the same forwarded call): with one, the real side splits it;
  // without, each child agrees on a real id at its first forwarded call.
  ncclComm_t parent_real = nullptr;
  {
    std::lock_guard<std::mutex> lock(parent.real_mu);
    parent_real = parent.real;
  }
  auto world = parent.world.lock();
  Entry mine{parent.rank, parent.nranks, world ? world->process() : -1, parent.ordinal, color, key};
  std::vector<Entry> all;
  std::shared_ptr<Joining> joining;
  SMDDP_RETURN_IF_ERROR(Join(nonce, parent.process_of.empty() ? -1 : parent.process_of[0],
                             parent.nranks, mine, world, &all, &joining));
  if (color == kNoColor) {
    if (!parent_real) return Status::Ok();
    std::vector<unsigned char> bytes = ConfigBytes(config);
    ncclComm_t none = nullptr;
    return RealSplit(parent_real, color, key, &bytes, &none);
  }
  std::vector<Entry> group;
  for (const Entry& e : all)
    if (e.color == color) group.push_back(e);
  std::stable_sort(group.begin(), group.end(), [](const Entry& a, const Entry& b) {
    return a.key != b.key ? a.key < b.key : a.rank < b.rank;
  });
  int rank = -1;
  for (size_t r = 0; r < group.size(); ++r) {
    if (group[r].rank == parent.rank) rank = int(r);
    group[r].rank = int32_t(r);
    group[r].nranks = int32_t(group.size());
  }
  uint64_t child[2] = {MixTag(nonce[0], uint64_t(uint32_t(color))),
                       MixTag(nonce[1], 0x636f6c6f72ull)};
  auto comm = std::make_unique<Comm>();
  comm->config = ConfigBytes(config);
  comm->ordinal = parent.ordinal;
  const std::string unknown = UnknownConfig(config);
  if (!unknown.empty()) {
    comm->nranks = int(group.size());
    comm->rank = rank;
    comm->nonce[0] = child[0];
    comm->nonce[1] = child[1];
    comm->world = world;
    for (const Entry& e : group) comm->process_of.push_back(e.process);
    comm->forwarded_because = unknown;
  } else {
    SMDDP_RETURN_IF_ERROR(Build(child, group, rank, world, JoiningOf(child), comm.get()));
  }
  if (parent_real) {
    ncclComm_t real = nullptr;
    const Status st = RealSplit(parent_real, color, key, &comm->config, &real);
    if (st.ok()) {
      comm->real = real;
    } else {
      comm->real_failure = st;
    }
  } else {
    comm->real_id_later = true;
  }
  *out = comm.release();
  return Status::Ok();
}

}  // namespace nccl
}  // namespace smddp
