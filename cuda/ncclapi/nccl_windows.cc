#include "cuda/ncclapi/nccl_windows.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/buffer_ipc.h"
#include "cuda/device_scope.h"
#include "cuda/gpu_communicator.h"
#include "cuda/ncclapi/real_nccl.h"
#include "xla_ffi/algorithms/stream_algorithms.h"
#include "xla_ffi/common/hashing.h"
#include "xla_ffi/common/timeout.h"
#include "xla_ffi/engine/buffer_exchange.h"
#include "xla_ffi/transports/link.h"
#include "xla_ffi/transports/shared_block.h"
#include "xla_ffi/transports/world.h"

namespace smddp {
namespace nccl {

// A peer's allocation as this process maps it (SharedMapping).
struct Mapping {
  cuda::BufferIpc ipc;
  BufferExchange::Handle handle;
};

// A registration as one rank sees it.
struct Window {
  int64_t index = -1;
  int ordinal = -1;  // -1: a communicator across hosts (no call uses it)
  uint8_t* mine = nullptr;
  size_t bytes = 0;
  bool usable = false;                   // every rank's window is addressable here
  std::vector<uint8_t*> bases;           // every rank's window, as this rank addresses it
  std::unique_ptr<cuda::BufferIpc> ipc;  // this rank's export of its window
  // The peers' allocations it maps, shared with every window of this process
  // that maps one of them (SharedMapping): unmapped with the last.
  std::vector<std::shared_ptr<Mapping>> mapped;
  std::atomic<bool> freed{false};  // its memory went (ncclMemFree)
};

// A communicator's windows (Comm::windows): used by its rank's thread.
struct WindowState {
  std::mutex mu;  // the list (a deregistration may come from another thread)
  int64_t next_index = 0;
  std::vector<std::unique_ptr<Window>> windows;
  std::vector<uint8_t*> rings;  // every rank's window log, as this process addresses it
  uint64_t calls = 0;           // calls logged
};

namespace {

using Clock = std::chrono::steady_clock;

std::mutex mu;                                // everything below
std::map<uintptr_t, size_t>& Allocations() {  // served ncclMemAlloc's
  static auto* a = new std::map<uintptr_t, size_t>;
  return *a;
}
std::set<Window*>& LiveWindows() {
  static auto* w = new std::set<Window*>;
  return *w;
}
std::atomic<uint64_t> registered{0}, windowed{0}, usual{0};

// The window logs: per rank, kRingEntries entries of 8 words (w[0]: the
// call + 1 once the rest is written). Kept for the process's life: a peer
// of this process may read its ring for as long as its communicator lives.
constexpr size_t kRingEntries = 64;
struct RingEntry {
  std::atomic<uint64_t> w[8];
};
static_assert(sizeof(RingEntry) == 64, "one cache line per entry");
constexpr size_t kRingBytes = kRingEntries * sizeof(RingEntry);

struct Logs {
  std::vector<uint8_t*> rings;     // by rank, as this process addresses them
  std::vector<std::string> names;  // this process's ranks' shared blocks
  std::vector<std::unique_ptr<SharedBlock>> blocks;
  std::vector<std::unique_ptr<uint64_t[]>> heap;
};
Logs& LogsOf(const Comm& comm) {  // under mu
  static auto* all = new std::map<std::pair<uint64_t, uint64_t>, Logs>;
  Logs& l = (*all)[{comm.nonce[0], comm.nonce[1]}];
  if (l.rings.empty()) {
    l.rings.assign(size_t(comm.nranks), nullptr);
    l.names.assign(size_t(comm.nranks), "");
  }
  return l;
}

// What a rank tells its peers when it registers (phase 1) or deregisters
// (phase 2) a window.
constexpr uint64_t kMagic = 0x776f646e69776e73ull;
struct Entry {
  uint64_t magic;
  int64_t index;
  int32_t phase;
  int32_t rank;
  uint64_t bytes;
  uint64_t offset;   // of the window in its allocation
  uint64_t unique;   // the allocation's buffer id (never reused in its process)
  uint64_t address;  // the window, as its own process addresses it
  int32_t process;
  uint32_t shareable;  // its handle maps in other processes
  BufferExchange::Handle handle;
  char ring[64];  // its window log's shared block ("": within one process)
  char why[160];  // why it is not shareable
};

// One meeting's entries of this process's ranks.
struct Board {
  std::vector<Entry> entries;
  std::vector<bool> have;
  int taken = 0;
};
std::map<std::tuple<uint64_t, uint64_t, int64_t, int>, Board>& Boards() {  // under mu
  static auto* b = new std::map<std::tuple<uint64_t, uint64_t, int64_t, int>, Board>;
  return *b;
}

// A peer's allocation mapped once per process, whichever windows map it
// (XLA registers one allocation with each communicator that uses it, and a
// legacy CUDA IPC handle opens once per device and process): by its
// process and buffer id, mapped through the handle it first came with (a
// cuMem descriptor's handle differs per export).
std::shared_ptr<Mapping> SharedMapping(int process, uint64_t unique,
                                       const BufferExchange::Handle& handle) {
  static auto* all = new std::map<std::pair<int, uint64_t>, std::weak_ptr<Mapping>>;
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Mapping>& slot = (*all)[{process, unique}];
  std::shared_ptr<Mapping> m = slot.lock();
  if (!m) {
    m = std::make_shared<Mapping>();
    m->handle = handle;
    slot = m;
  }
  return m;
}

int ProcessOf(const Comm& comm, int rank) {
  return comm.process_of.empty() ? -1 : comm.process_of[size_t(rank)];
}
bool SpansProcesses(const Comm& comm) {
  for (int q = 0; q < comm.nranks; ++q)
    if (ProcessOf(comm, q) != ProcessOf(comm, comm.rank)) return true;
  return false;
}

std::string Who(const Comm& comm, int q) {
  return "rank " + std::to_string(q) + " (process " + std::to_string(ProcessOf(comm, q)) + ")";
}

uint64_t TagOf(const Comm& comm, int64_t index, int phase, int from, int to) {
  uint64_t t = MixTag(MixTag(0x6e63636c2d77696eull, comm.nonce[0]), comm.nonce[1]);
  t = MixTag(MixTag(t, uint64_t(index)), uint64_t(phase));
  return MixTag(MixTag(t, uint64_t(from)), uint64_t(to));
}

// Every rank's entry for `mine.index` and `mine.phase`: the host waits for
// them (once per registration), its own process's from the board, the
// others' over the world's links.
Status Meet(const Comm& comm, const Entry& mine, const char* function, std::vector<Entry>* all) {
  const int n = comm.nranks, me = comm.rank;
  const int here = ProcessOf(comm, me);
  auto world = comm.world.lock();
  const auto deadline = Clock::now() + Timeout();
  all->assign(size_t(n), Entry{});
  (*all)[size_t(me)] = mine;
  std::vector<bool> have(size_t(n), false);
  have[size_t(me)] = true;
  struct Pending {
    Link* link;
    int q;
    bool recv;
    Request req;
  };
  std::vector<std::unique_ptr<Pending>> pending;
  int locals = 0;
  for (int q = 0; q < n; ++q) {
    if (ProcessOf(comm, q) == here) {
      locals++;
      continue;
    }
    Link* link = world ? world->link(ProcessOf(comm, q)) : nullptr;
    if (!link)
      return Status::Error("jax_smddp NCCL front end: " + std::string(function) + ": no link to " +
                           Who(comm, q));
    auto r = std::make_unique<Pending>();
    r->link = link, r->q = q, r->recv = true;
    link->Recv(TagOf(comm, mine.index, mine.phase, q, me), &(*all)[size_t(q)], sizeof(Entry),
               &r->req);
    pending.push_back(std::move(r));
    auto s = std::make_unique<Pending>();
    s->link = link, s->q = q, s->recv = false;
    link->Send(TagOf(comm, mine.index, mine.phase, me, q), &mine, sizeof(Entry), &s->req);
    pending.push_back(std::move(s));
  }
  const auto key = std::make_tuple(comm.nonce[0], comm.nonce[1], mine.index, mine.phase);
  {
    std::lock_guard<std::mutex> lock(mu);
    Board& b = Boards()[key];
    if (b.entries.empty()) b.entries.assign(size_t(n), Entry{}), b.have.assign(size_t(n), false);
    b.entries[size_t(me)] = mine;
    b.have[size_t(me)] = true;
  }
  auto cancel = [&] {
    for (auto& p : pending)
      if (!p->req.done()) p->link->Cancel(&p->req);
  };
  Status st;
  while (true) {
    bool done = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      Board& b = Boards()[key];
      for (int q = 0; q < n; ++q) {
        if (ProcessOf(comm, q) != here || have[size_t(q)]) continue;
        if (b.have[size_t(q)]) {
          (*all)[size_t(q)] = b.entries[size_t(q)];
          have[size_t(q)] = true;
        } else {
          done = false;
        }
      }
    }
    for (auto& p : pending) {
      if (p->req.done()) continue;
      p->link->Progress();
      if (!p->req.done()) {
        done = false;
        const std::string failure = p->link->PeerFailure();
        if (!failure.empty()) {
          st = Status::PeerFailed("jax_smddp NCCL front end: " + std::string(function) + ": " +
                                  Who(comm, p->q) + " failed: " + failure);
          break;
        }
        continue;
      }
      if (!p->req.status().ok()) {
        st = p->req.status();
        break;
      }
      if (p->recv) have[size_t(p->q)] = true;
    }
    if (!st.ok() || done) break;
    if (Clock::now() > deadline) {
      std::string missing;
      for (int q = 0; q < n; ++q)
        if (!have[size_t(q)]) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      st = Status::Timeout("jax_smddp NCCL front end: " + std::string(function) + " (window #" +
                           std::to_string(mine.index) + "): ranks " + missing + " of " +
                           std::to_string(n) + " did not come within " +
                           std::to_string(int(TimeoutSeconds())) +
                           " s (JAX_SMDDP_TIMEOUT_S); every rank registers and deregisters its "
                           "windows at the same point of the program, in the same order");
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (!st.ok()) cancel();
  std::lock_guard<std::mutex> lock(mu);
  if (++Boards()[key].taken == locals) Boards().erase(key);  // every local rank read it
  if (!st.ok()) return st;
  for (int q = 0; q < n; ++q) {
    const Entry& e = (*all)[size_t(q)];
    if (e.magic != kMagic || e.rank != q || e.index != mine.index || e.phase != mine.phase)
      return Status::Protocol("jax_smddp NCCL front end: " + std::string(function) + ": " +
                              Who(comm, q) + " sent a malformed window entry");
  }
  return Status::Ok();
}

// This rank's window log (made at its first registration) into `name`.
Status OwnRing(const Comm& comm, char name[64]) {
  std::lock_guard<std::mutex> lock(mu);
  Logs& l = LogsOf(comm);
  const size_t me = size_t(comm.rank);
  if (!l.rings[me]) {
    if (SpansProcesses(comm)) {
      std::set<int> others;
      for (int q = 0; q < comm.nranks; ++q)
        if (ProcessOf(comm, q) != ProcessOf(comm, comm.rank)) others.insert(ProcessOf(comm, q));
      std::unique_ptr<SharedBlock> block;
      SMDDP_RETURN_IF_ERROR(SharedBlock::Create(kRingBytes, int(others.size()), &block));
      l.rings[me] = block->data();
      l.names[me] = block->name();
      l.blocks.push_back(std::move(block));
    } else {
      l.heap.emplace_back(new uint64_t[kRingBytes / 8]());  // zeroed
      l.rings[me] = reinterpret_cast<uint8_t*>(l.heap.back().get());
    }
  }
  if (l.names[me].size() >= 64) return Status::Error("jax_smddp: shared block name too long");
  std::memset(name, 0, 64);
  std::memcpy(name, l.names[me].data(), l.names[me].size());
  return Status::Ok();
}

// Every rank's window log, once every rank made its own: the other
// processes' opened once per process.
Status AllRings(const Comm& comm, const std::vector<Entry>& all, std::vector<uint8_t*>* rings) {
  std::lock_guard<std::mutex> lock(mu);
  Logs& l = LogsOf(comm);
  for (int q = 0; q < comm.nranks; ++q) {
    if (l.rings[size_t(q)]) continue;
    const Entry& e = all[size_t(q)];
    if (ProcessOf(comm, q) == ProcessOf(comm, comm.rank) || !e.ring[0]) continue;  // not yet
    std::unique_ptr<SharedBlock> block;
    const std::string name(e.ring, strnlen(e.ring, sizeof(e.ring)));
    SMDDP_RETURN_IF_ERROR(SharedBlock::Open(name, kRingBytes, &block));
    l.rings[size_t(q)] = block->data();
    l.blocks.push_back(std::move(block));
  }
  for (int q = 0; q < comm.nranks; ++q)
    if (!l.rings[size_t(q)])
      return Status::Error("jax_smddp NCCL front end: " + Who(comm, q) +
                           " has no window log after the registration; report this as a bug");
  *rings = l.rings;
  return Status::Ok();
}

// A call's use of the windows, as logged: (window index + 1, offset) of its
// input and, for all_reduce, its output (0, 0: not in a window).
struct Use {
  uint64_t kind = 0;
  uint64_t in_window = 0, in_offset = 0, out_window = 0, out_offset = 0;
  bool operator==(const Use& o) const {
    return kind == o.kind && in_window == o.in_window && in_offset == o.in_offset &&
           out_window == o.out_window && out_offset == o.out_offset;
  }
};

std::string Describe(const Use& u) {
  auto one = [](const char* what, uint64_t window, uint64_t offset) {
    if (!window) return std::string(what) + " in no window";
    return std::string(what) + " at offset " + std::to_string(offset) + " of window #" +
           std::to_string(window - 1);
  };
  std::string out = one("its input", u.in_window, u.in_offset);
  if (u.out_window || u.out_offset) out += " and " + one("its output", u.out_window, u.out_offset);
  return out;
}

// Records this rank's use for `call` and compares it with the peers' entries
// for that call already there (as CallLog::RecordAndCheck does the plans):
// of two ranks that differ, the one that records second sees it.
Status LogAndCheck(const Comm& comm, WindowState& ws, const char* op, const Use& mine) {
  const uint64_t call = ws.calls++;
  const size_t slot = size_t(call % kRingEntries);
  const uint64_t words[5] = {mine.kind, mine.in_window, mine.in_offset, mine.out_window,
                             mine.out_offset};
  auto* own = reinterpret_cast<RingEntry*>(ws.rings[size_t(comm.rank)]) + slot;
  own->w[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (int k = 0; k < 5; ++k) own->w[k + 1].store(words[k], std::memory_order_relaxed);
  own->w[0].store(call + 1, std::memory_order_seq_cst);
  for (int q = 0; q < comm.nranks; ++q) {
    if (q == comm.rank) continue;
    const auto* e = reinterpret_cast<const RingEntry*>(ws.rings[size_t(q)]) + slot;
    if (e->w[0].load(std::memory_order_seq_cst) != call + 1) continue;  // not there yet
    uint64_t theirs[5];
    for (int k = 0; k < 5; ++k) theirs[k] = e->w[k + 1].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e->w[0].load(std::memory_order_relaxed) != call + 1) continue;  // rewritten meanwhile
    const Use other{theirs[0], theirs[1], theirs[2], theirs[3], theirs[4]};
    if (other == mine) continue;
    return Status::Mismatch(
               "jax_smddp NCCL front end: the ranks disagree on symmetric memory in call #" +
               std::to_string(call) + " since the first window (" + op +
               "): " + Who(comm, comm.rank) + " runs it with " + Describe(mine) + ", but " +
               Who(comm, q) + " with " + Describe(other) +
               ". A call on window memory must use the same offset in every rank's window (the "
               "same buffer of XLA's collective memory space on every rank); no rank reads a "
               "peer at another offset. Later calls of this communicator fail too.")
        .SetPeers({q}, {});
  }
  return Status::Ok();
}

// The registered, live window of `ws` holding [p, p + bytes), or null.
Window* Find(WindowState& ws, const void* p, size_t bytes, size_t* offset) {
  const auto* at = static_cast<const uint8_t*>(p);
  for (const auto& w : ws.windows) {
    if (!w->usable || w->freed.load(std::memory_order_acquire)) continue;
    if (at >= w->mine && at + bytes <= w->mine + w->bytes) {
      *offset = size_t(at - w->mine);
      return w.get();
    }
  }
  return nullptr;
}

// Fails the group for good: this process's ranks through the exchange
// failure, the other processes' through the watch.
Status FailGroup(gpu::LocalRank& rank, const Status& st) {
  const Status failure = rank.exchange_failure->Set(st);
  if (rank.watch) rank.watch->Fail(failure);
  return failure;
}

bool Serving() {
  if (RealLibrary().empty()) return true;
  std::string why;
  const int version = RealVersion(&why);
  return version == 0 || KnownVersion(version);  // as InitRank decides
}

}  // namespace

Status MemAlloc(void** ptr, size_t size, bool* served) {
  *served = Serving();
  if (!*served) return Status::Ok();
  int device = -1;
  cudaGetDevice(&device);
  const cudaError_t err = cudaMalloc(ptr, std::max<size_t>(size, 1));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Error("jax_smddp NCCL front end: ncclMemAlloc of " + std::to_string(size) +
                         " bytes on device " + std::to_string(device) + ": " +
                         cudaGetErrorString(err));
  }
  std::lock_guard<std::mutex> lock(mu);
  Allocations()[uintptr_t(*ptr)] = size;
  return Status::Ok();
}

Status MemFree(void* ptr, bool* served) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = Allocations().find(uintptr_t(ptr));
    *served = it != Allocations().end();
    if (!*served) return Status::Ok();
    size = it->second;
    Allocations().erase(it);
    // A window still registered over it is no window from now on.
    const auto* p = static_cast<const uint8_t*>(ptr);
    for (Window* w : LiveWindows())
      if (w->mine >= p && w->mine < p + size) w->freed.store(true, std::memory_order_release);
  }
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Error(std::string("jax_smddp NCCL front end: ncclMemFree: ") +
                         cudaGetErrorString(err));
  }
  return Status::Ok();
}

Status RegisterWindow(Comm& comm, void* buffer, size_t bytes, const char* function, void** handle) {
  if (!comm.windows) comm.windows = std::make_shared<WindowState>();
  WindowState& ws = *comm.windows;
  auto w = std::make_unique<Window>();
  {
    std::lock_guard<std::mutex> lock(ws.mu);
    w->index = ws.next_index++;  // never reused: a new registration of any memory is a new window
  }
  w->mine = static_cast<uint8_t*>(buffer);
  w->bytes = bytes;
  if (comm.local && !comm.port) {
    w->ordinal = comm.local->ordinal;
    w->ipc = std::make_unique<cuda::BufferIpc>();
    Entry mine{};
    mine.magic = kMagic;
    mine.index = w->index;
    mine.phase = 1;
    mine.rank = comm.rank;
    mine.bytes = bytes;
    mine.address = uintptr_t(buffer);
    mine.process = ProcessOf(comm, comm.rank);
    mine.shareable = 1;
    if (SpansProcesses(comm)) {
      uintptr_t base = 0;
      uint64_t unique = 0;
      Status st = w->ipc->FindAllocation(w->ordinal, buffer, &base, &unique);
      if (st.ok()) st = w->ipc->Export(w->ordinal, base, &mine.handle);
      mine.offset = uintptr_t(buffer) - base;
      mine.unique = unique;
      if (!st.ok()) {
        mine.shareable = 0;
        std::strncpy(mine.why, st.message().c_str(), sizeof(mine.why) - 1);
      }
    }
    SMDDP_RETURN_IF_ERROR(OwnRing(comm, mine.ring));
    std::vector<Entry> all;
    SMDDP_RETURN_IF_ERROR(Meet(comm, mine, function, &all));
    for (int q = 0; q < comm.nranks; ++q)
      if (all[size_t(q)].bytes != bytes)
        return Status::Mismatch(
            "jax_smddp NCCL front end: " + std::string(function) + " (window #" +
            std::to_string(w->index) + "): " + Who(comm, q) + " registered " +
            std::to_string(all[size_t(q)].bytes) + " bytes and " + Who(comm, comm.rank) + " " +
            std::to_string(bytes) +
            " bytes; windows are symmetric: every rank registers the same size");
    if (ws.rings.empty()) SMDDP_RETURN_IF_ERROR(AllRings(comm, all, &ws.rings));
    w->usable = true;
    w->bases.assign(size_t(comm.nranks), nullptr);
    for (int q = 0; q < comm.nranks; ++q) {
      const Entry& e = all[size_t(q)];
      if (e.process == mine.process) {  // this process's devices reach it as it is
        w->bases[size_t(q)] = reinterpret_cast<uint8_t*>(uintptr_t(e.address));
      } else if (!e.shareable) {
        w->usable = false;  // every rank sees it alike: its calls go the usual way
        std::fprintf(stderr,
                     "WARNING jax_smddp NCCL front end: %s of %s cannot be shared (%s); calls on "
                     "window #%lld go the usual way\n",
                     function, Who(comm, q).c_str(), e.why, (long long)w->index);
      } else {
        uint8_t* base = nullptr;
        w->mapped.push_back(SharedMapping(e.process, e.unique, e.handle));
        const Status st = w->mapped.back()->ipc.Map(w->ordinal, w->mapped.back()->handle, &base);
        if (!st.ok())
          return Status::Error("jax_smddp NCCL front end: " + std::string(function) + " (window #" +
                               std::to_string(w->index) + "): mapping " + Who(comm, q) +
                               "'s window: " + st.message());
        w->bases[size_t(q)] = base + e.offset;
      }
    }
  }
  *handle = w.get();
  std::lock_guard<std::mutex> lock(ws.mu);
  {
    std::lock_guard<std::mutex> global(mu);
    LiveWindows().insert(w.get());
  }
  ws.windows.push_back(std::move(w));
  registered.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status DeregisterWindow(Comm& comm, void* handle, const char* function, bool* known) {
  *known = false;
  if (!comm.windows) return Status::Ok();
  WindowState& ws = *comm.windows;
  std::unique_ptr<Window> w;
  {
    std::lock_guard<std::mutex> lock(ws.mu);
    for (auto it = ws.windows.begin(); it != ws.windows.end(); ++it) {
      if (it->get() != handle) continue;
      w = std::move(*it);
      ws.windows.erase(it);
      break;
    }
  }
  if (!w) return Status::Ok();
  *known = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    LiveWindows().erase(w.get());
  }
  Status st;
  if (w->ordinal >= 0) {
    // This rank's reads of its peers' windows end first; the meeting then
    // says every rank's did, so each owner may free its memory after.
    {
      cuda::DeviceScope scope(w->ordinal);
      const cudaError_t err = cudaDeviceSynchronize();
      if (err != cudaSuccess)
        st = Status::Error("jax_smddp NCCL front end: " + std::string(function) +
                           ": synchronizing device " + std::to_string(w->ordinal) + ": " +
                           cudaGetErrorString(err));
    }
    Entry mine{};
    mine.magic = kMagic;
    mine.index = w->index;
    mine.phase = 2;
    mine.rank = comm.rank;
    mine.process = ProcessOf(comm, comm.rank);
    std::vector<Entry> all;
    const Status met = Meet(comm, mine, function, &all);
    if (st.ok()) st = met;
  }
  w.reset();  // unmaps the peers' windows (BufferIpc)
  return st;
}

Status EnqueueWindowed(Comm& comm, const char* op, int64_t op_id, const Plan& plan, StreamOps& ops,
                       const void* send, void* recv, bool captured, bool* done) {
  *done = false;
  if (captured || !comm.windows || !comm.local || comm.port || comm.windows->rings.empty())
    return Status::Ok();
  WindowState& ws = *comm.windows;
  gpu::LocalRank& rank = *comm.local;
  auto located = [&](const Status& st) {
    return st.WithMessage(std::string(op) + " (op " + std::to_string(op_id) + "): " + st.message());
  };
  auto fail = [&](const Status& st) {
    *done = true;
    // Peers may have enqueued reads that wait on this rank.
    ReleaseEveryoneWaitingOn(rank.view, ops);
    return located(st);
  };
  if (rank.exchange_failure->failed()) return fail(rank.exchange_failure->error());
  if (const Status st = gpu::GroupFailure(rank); !st.ok()) return fail(st);
  size_t in = 0, out = 0;
  CallBytes(plan, comm.nranks, &in, &out);
  const bool outputs = DirectReadsNeedOutputs(plan.kind);
  Use use;
  use.kind = uint64_t(plan.kind) + 1;
  Window *win_in = nullptr, *win_out = nullptr;
  size_t in_offset = 0, out_offset = 0;
  {
    std::lock_guard<std::mutex> lock(ws.mu);
    win_in = Find(ws, send, in, &in_offset);
    if (outputs) win_out = Find(ws, recv, out, &out_offset);
  }
  // Where the group reads in place (JAX_SMDDP_GPU_DIRECT_READS) and every
  // buffer a peer reads is in a window.
  const bool on_windows = rank.exchange && comm.nranks > 1 && win_in && (!outputs || win_out);
  if (on_windows) {
    use.in_window = uint64_t(win_in->index) + 1;
    use.in_offset = in_offset;
    if (outputs) use.out_window = uint64_t(win_out->index) + 1, use.out_offset = out_offset;
  }
  if (const Status st = LogAndCheck(comm, ws, op, use); !st.ok()) {
    const Status failure = FailGroup(rank, st);
    return fail(failure);
  }
  if (!on_windows) {
    usual.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
  *done = true;
  // The call log between processes (and its numbering of the calls) as every call has it.
  if (const Status st = gpu::CheckCall(rank, op, plan); !st.ok()) return located(st);
  const size_t P = size_t(comm.nranks);
  rank.view.device.active = false;
  rank.view.inputs.resize(P);
  for (size_t q = 0; q < P; ++q) rank.view.inputs[q] = win_in->bases[q] + in_offset;
  rank.view.outputs.resize(outputs ? P : 0);
  for (size_t q = 0; outputs && q < P; ++q) rank.view.outputs[q] = win_out->bases[q] + out_offset;
  const Status st = RunStreamPlan(plan, rank.view, ops, send, recv);
  rank.view.inputs.clear();
  rank.view.outputs.clear();
  if (!st.ok()) return located(st);
  windowed.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

WindowCounts CountWindows() {
  WindowCounts c;
  c.registered = registered.load(std::memory_order_relaxed);
  c.windowed = windowed.load(std::memory_order_relaxed);
  c.usual = usual.load(std::memory_order_relaxed);
  return c;
}

int64_t WindowIndex(void* handle) {
  std::lock_guard<std::mutex> lock(mu);
  auto* w = static_cast<Window*>(handle);
  return LiveWindows().count(w) ? w->index : -1;
}

}  // namespace nccl
}  // namespace smddp
