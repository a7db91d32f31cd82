// The mock node's CUDA runtime (cuda_runtime_api.h beside this file says
// what it enforces); the kernels of cuda/kernels.h, as stream operations that
// run on the host, are in mock_kernels.cc (mock_node.h: what they share).
#include "mock_node.h"
#include "cuda.h"
#include "cuda_runtime_api.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "xla_ffi/algorithms/reduce.h"
#include "xla_ffi/algorithms/stream_ops.h"

namespace mock_node {

const Clock::time_point kStart = Clock::now();
constexpr int kMaxDevices = 16;

double Number(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atof(v) : fallback;
}

const Config& Cfg() {
  static const Config c = [] {
    Config c;
    const char* list = std::getenv("JAX_SMDDP_MOCK_DEVICES");
    if (list && *list) {
      for (const char* p = list; *p;) {
        c.devices.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      for (int d = 0; d < 8; ++d) c.devices.push_back(d);
    }
    const char* topo = std::getenv("JAX_SMDDP_MOCK_TOPOLOGY");
    const std::string t = topo ? topo : "nvlink";
    c.p2p = t != "pcie_nop2p";
    c.bytes_per_us = Number("JAX_SMDDP_MOCK_COPY_GBPS", 2) * 1000 / (t == "nvlink" ? 1 : 3);
    c.latency_us = Number("JAX_SMDDP_MOCK_COPY_US", 20);
    c.wait_s = Number("JAX_SMDDP_MOCK_WAIT_S", 30);
    return c;
  }();
  return c;
}

int LocalOf(int node_device) {
  const auto& d = Cfg().devices;
  for (size_t i = 0; i < d.size(); ++i)
    if (d[i] == node_device) return int(i);
  return -1;
}

enum class Kind { kDevice, kIpc, kCuMem, kHost };
struct Alloc {
  Kind kind;
  size_t bytes;
  int device;             // kDevice: its local ordinal; kIpc: the ordinal it was opened on
  int home;               // node device id of the memory (-1: host)
  std::set<int> granted;  // kCuMem: ordinals cuMemSetAccess named
  char name[64];          // kDevice: its shared memory
  unsigned long long id;  // never reused in the process, as CUDA's buffer ids
};

std::mutex mu;  // allocations, peer access, faults, schedule
std::map<uintptr_t, Alloc> allocs;
bool peer_enabled[kMaxDevices][kMaxDevices];
std::string faults[kMaxDevices];
std::vector<CopyRecord> schedule;
unsigned long long next_id = 1;
int allocations = 0;
// Count(): what the code under test asked (atomics: asked from any thread).
std::atomic<uint64_t> n_ipc_exports{0}, n_ipc_opens{0}, n_cumem_exports{0}, n_imports{0}, n_maps{0},
    n_grants{0}, n_attribute_queries{0};
void Bump(std::atomic<uint64_t>& n) { n.fetch_add(1, std::memory_order_relaxed); }
thread_local int current = 0;

// The allocation holding [p, p + n), or null.
const Alloc* Find(uintptr_t p, size_t n, uintptr_t* base) {
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) return nullptr;
  --it;
  if (p + n > it->first + it->second.bytes) return nullptr;
  *base = it->first;
  return &it->second;
}

// Whether device `dev` (local ordinal) may touch [p, p + n); `plain_host`:
// memory CUDA does not know is allowed (copies of pageable host memory).
bool Allowed(int dev, uintptr_t p, size_t n, bool plain_host, std::string* why) {
  uintptr_t base = 0;
  const Alloc* a = Find(p, n, &base);
  char text[256];
  if (!a) {
    if (plain_host) return true;
    std::snprintf(text, sizeof(text), "%#lx (+%zu) is no memory CUDA knows", (unsigned long)p, n);
    *why = text;
    return false;
  }
  bool ok = false;
  const char* kind = "";
  switch (a->kind) {
    case Kind::kHost:
      return true;
    case Kind::kDevice:
      ok = a->device == dev || peer_enabled[dev][a->device];
      kind = "cudaMalloc'd memory";
      break;
    case Kind::kIpc: {
      const int owner = LocalOf(a->home);
      ok = a->device == dev || (owner >= 0 && (owner == dev || peer_enabled[dev][owner]));
      kind = "a CUDA IPC mapping opened on another device";
      break;
    }
    case Kind::kCuMem:
      ok = a->granted.count(dev) > 0;
      kind = "a cuMem mapping whose access was not granted to it";
      break;
  }
  if (ok) return true;
  std::snprintf(text, sizeof(text), "%#lx (+%zu): %s of node device %d (%s)", (unsigned long)p, n,
                kind, a->home, a->kind == Kind::kDevice ? "no peer access enabled to it" : "");
  *why = text;
  return false;
}

bool Faulted(int dev) {
  std::lock_guard<std::mutex> lock(mu);
  return !faults[dev].empty();
}

void Poison(int dev, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu);
  if (!faults[dev].empty()) return;
  faults[dev] = why;
  std::fprintf(stderr, "mock CUDA: node device %d (ordinal %d): illegal address: %s\n",
               NodeDevice(dev), dev, why.c_str());
  std::fflush(stderr);
}

// Checks every range for `dev`; poisons its context on the first refused.
bool Touch(int dev, const char* what, std::initializer_list<std::pair<const void*, size_t>> ranges,
           bool plain_host) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [p, n] : ranges) {
      if (n == 0) continue;
      if (!Allowed(dev, uintptr_t(p), n, plain_host, &why)) break;
    }
  }
  if (why.empty()) return true;
  Poison(dev, std::string(what) + " touched " + why);
  return false;
}

bool ReadsPeer(int dev, const void* src, size_t n) {
  std::lock_guard<std::mutex> lock(mu);
  uintptr_t base;
  const Alloc* a = Find(uintptr_t(src), n, &base);
  return a && a->home >= 0 && a->home != NodeDevice(dev);
}

double Now() { return std::chrono::duration<double, std::micro>(Clock::now() - kStart).count(); }

}  // namespace mock_node

struct CUevent_st {
  std::atomic<uint64_t> recorded{0}, completed{0};
};

namespace mock_node {

void Work(CUstream_st* s) {
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock<std::mutex> lock(s->m);
      s->cv.wait(lock, [&] { return s->stop || !s->q.empty(); });
      if (s->q.empty()) return;
      op = std::move(s->q.front());
      s->q.pop_front();
      s->busy = true;
    }
    if (!Faulted(s->device)) op();
    std::lock_guard<std::mutex> lock(s->m);
    s->busy = false;
    if (s->q.empty()) s->idle.notify_all();
  }
}

CUstream_st* NewStream(int dev) {
  auto* s = new CUstream_st;
  s->device = dev;
  s->worker = std::thread(Work, s);
  return s;
}

CUstream_st* DefaultStream(int dev) {
  static std::mutex m;
  static CUstream_st* streams[kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(m);
  if (!streams[dev]) streams[dev] = NewStream(dev);
  return streams[dev];
}

CUstream_st* Of(cudaStream_t s) { return s ? s : DefaultStream(current); }

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> op) {
  CUstream_st* s = Of(stream);
  if (Faulted(s->device)) return cudaErrorIllegalAddress;
  if (s->capturing) {
    s->captured.push_back(std::move(op));
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(s->m);
  s->q.push_back(std::move(op));
  s->cv.notify_one();
  return cudaSuccess;
}

// Moves rows x width bytes in four pieces spread over the copy's time.
void TimedCopy(int dev, uint8_t* dst, size_t dpitch, const uint8_t* src, size_t spitch,
               size_t width, size_t rows) {
  const size_t total = width * rows;
  const bool peer = ReadsPeer(dev, src, (rows - 1) * spitch + width);
  const auto t0 = Clock::now();
  const double start = Now();
  const double us = Cfg().latency_us + double(total) / Cfg().bytes_per_us;
  constexpr int kPieces = 4;
  for (int k = 0; k < kPieces; ++k) {
    std::this_thread::sleep_until(
        t0 + std::chrono::duration<double, std::micro>(us * (k + 1) / kPieces));
    for (size_t i = total * k / kPieces, end = total * (k + 1) / kPieces; i < end;) {
      const size_t row = i / width, col = i % width, n = std::min(end - i, width - col);
      std::memcpy(dst + row * dpitch + col, src + row * spitch + col, n);
      i += n;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  schedule.push_back(CopyRecord{NodeDevice(dev), peer, start, Now(), total});
}

cudaError_t Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                   size_t rows, cudaStream_t stream, const char* what) {
  if (width == 0 || rows == 0) return cudaSuccess;
  const int dev = Of(stream)->device;
  return Enqueue(stream, [=] {
    if (!Touch(dev, what, {{dst, (rows - 1) * dpitch + width}, {src, (rows - 1) * spitch + width}},
               true))
      return;
    TimedCopy(dev, static_cast<uint8_t*>(dst), dpitch, static_cast<const uint8_t*>(src), spitch,
              width, rows);
  });
}

bool Reached(const uint32_t* flag, uint32_t value) {
  return int32_t(__atomic_load_n(flag, __ATOMIC_ACQUIRE) - value) >= 0;
}

cudaError_t WaitValue(cudaStream_t stream, const uint32_t* flag, uint32_t value, const char* what) {
  const int dev = Of(stream)->device;
  return Enqueue(stream, [=] {
    if (!Touch(dev, what, {{flag, 4}}, false)) return;
    const auto deadline = Clock::now() + std::chrono::duration<double>(Cfg().wait_s);
    // Polled every 50 us, backing off to 1 ms after 10 ms of waiting: the
    // many waiting streams of a late peer's group must not starve the hosts.
    const auto patient = Clock::now() + std::chrono::milliseconds(10);
    while (!Reached(flag, value)) {
      if (Clock::now() > deadline) {
        char text[160];
        std::snprintf(text, sizeof(text), "%s waited %.0f s for %u at %p (it holds %u)", what,
                      Cfg().wait_s, value, static_cast<const void*>(flag),
                      __atomic_load_n(flag, __ATOMIC_ACQUIRE));
        Poison(dev, text);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(Clock::now() > patient ? 1000 : 50));
    }
  });
}

cudaError_t WriteValue(cudaStream_t stream, uint32_t* flag, uint32_t value, const char* what) {
  const int dev = Of(stream)->device;
  return Enqueue(stream, [=] {
    if (Touch(dev, what, {{flag, 4}}, false)) __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  });
}

// The driver entry points the code under test asks for.
int StreamWaitValue32(CUstream_st* s, unsigned long long flag, uint32_t value, unsigned) {
  return WaitValue(s, reinterpret_cast<const uint32_t*>(flag), value, "cuStreamWaitValue32");
}
int StreamWriteValue32(CUstream_st* s, unsigned long long flag, uint32_t value, unsigned) {
  return WriteValue(s, reinterpret_cast<uint32_t*>(flag), value, "cuStreamWriteValue32");
}
// Its waits and writes in order, as the driver runs a batch.
int StreamBatchMemOp(CUstream_st* s, unsigned count, CUstreamBatchMemOpParams* p, unsigned) {
  for (unsigned i = 0; i < count; ++i) {
    int r = 1;
    if (p[i].operation == CU_STREAM_MEM_OP_WAIT_VALUE_32)
      r = StreamWaitValue32(s, p[i].waitValue.address, p[i].waitValue.value, 0);
    else if (p[i].operation == CU_STREAM_MEM_OP_WRITE_VALUE_32)
      r = StreamWriteValue32(s, p[i].writeValue.address, p[i].writeValue.value, 0);
    if (r != 0) return r;
  }
  return 0;
}

bool On(const char* setting) {  // read at each call: a test may set it midway
  const char* v = std::getenv(setting);
  return v && v[0] == '1';
}
bool CuMemMode() { return On("JAX_SMDDP_MOCK_CUMEM"); }

void* MapFd(int fd, size_t bytes, void* at = nullptr) {
  void* p = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// The node device whose memory a shared memory object is, from its name.
int HomeOfName(const char* name) {
  const char* at = nullptr;
  for (const char* p = std::strstr(name, "-d"); p; p = std::strstr(p + 1, "-d")) at = p;
  return at ? std::atoi(at + 2) : -1;
}

int PointerGetAttributes(unsigned count, const int* which, void** data, unsigned long long ptr) {
  Bump(n_attribute_queries);
  std::lock_guard<std::mutex> lock(mu);
  uintptr_t base = 0;
  const Alloc* a = Find(uintptr_t(ptr), 1, &base);
  const bool own = a && a->kind == Kind::kDevice;
  for (unsigned i = 0; i < count; ++i) {
    if (which[i] == 11)
      *static_cast<unsigned long long*>(data[i]) = a ? base : 0;
    else if (which[i] == 7)
      *static_cast<unsigned long long*>(data[i]) = a ? a->id : 0;
    else if (which[i] == 10)
      *static_cast<int*>(data[i]) = own && !CuMemMode();
    else if (which[i] == 12)
      *static_cast<unsigned long long*>(data[i]) = a ? a->bytes : 0;
    else if (which[i] == 14)
      *static_cast<unsigned long long*>(data[i]) = own && CuMemMode();
    else
      return 1;
  }
  return 0;
}

// cuMem: an allocation's handle is its buffer id; exporting opens its shared
// memory (the descriptor), importing keeps a copy of one.
std::map<unsigned long long, int> imported;
unsigned long long next_import = 1ull << 40;

int RetainAllocationHandle(unsigned long long* h, void* addr) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocs.find(uintptr_t(addr));
  if (it == allocs.end() || it->second.kind != Kind::kDevice) return 1;
  *h = it->second.id;
  return 0;
}
int ExportToShareableHandle(void* out, unsigned long long h, int type, unsigned long long) {
  Bump(n_cumem_exports);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [at, a] : allocs) {
    if (a.kind == Kind::kDevice && a.id == h && type == 1) {
      const int fd = shm_open(a.name, O_RDWR | O_CLOEXEC, 0);
      if (fd < 0) return 2;
      *static_cast<int*>(out) = fd;
      return 0;
    }
  }
  return 1;
}
int ImportFromShareableHandle(unsigned long long* h, void* fd, int type) {
  Bump(n_imports);
  if (On("JAX_SMDDP_MOCK_IPC_OPEN_FAILS")) return 1;
  const int copy = type == 1 ? dup(int(reinterpret_cast<uintptr_t>(fd))) : -1;
  if (copy < 0) return 1;
  std::lock_guard<std::mutex> lock(mu);
  *h = next_import++;
  imported[*h] = copy;
  return 0;
}
int Release(unsigned long long h) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = imported.find(h); it != imported.end()) {
    close(it->second);
    imported.erase(it);
  }
  return 0;
}
int AddressReserve(unsigned long long* p, size_t bytes, size_t, unsigned long long,
                   unsigned long long) {
  void* at = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) return 2;
  *p = reinterpret_cast<unsigned long long>(at);
  return 0;
}
int AddressFree(unsigned long long p, size_t bytes) {
  return munmap(reinterpret_cast<void*>(p), bytes) == 0 ? 0 : 1;
}
int MemMap(unsigned long long p, size_t bytes, size_t, unsigned long long h, unsigned long long) {
  Bump(n_maps);
  std::lock_guard<std::mutex> lock(mu);
  auto it = imported.find(h);
  if (it == imported.end()) return 1;
  char link[64], target[256] = {};
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", it->second);
  if (readlink(link, target, sizeof(target) - 1) < 0) return 2;
  if (!MapFd(it->second, bytes, reinterpret_cast<void*>(p))) return 2;
  Alloc a{Kind::kCuMem, bytes, -1, HomeOfName(target), {}, {}, next_id++};
  allocs[uintptr_t(p)] = a;
  return 0;
}
int MemUnmap(unsigned long long p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  allocs.erase(uintptr_t(p));
  void* at = mmap(reinterpret_cast<void*>(p), bytes, PROT_NONE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return at == MAP_FAILED ? 1 : 0;
}
struct AccessDesc {
  int location_type;
  int location_id;
  int flags;
};
int SetAccess(unsigned long long p, size_t, const AccessDesc* desc, size_t count) {
  Bump(n_grants);
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocs.find(uintptr_t(p));
  if (it == allocs.end() || it->second.kind != Kind::kCuMem) return 1;
  for (size_t i = 0; i < count; ++i) {
    const int dev = desc[i].location_id;
    if (dev < 0 || dev >= int(Cfg().devices.size())) return 1;
    // Without peer to peer, a device cannot map another's memory.
    if (!Cfg().p2p && Cfg().devices[dev] != it->second.home) return 1;
    it->second.granted.insert(dev);
  }
  return 0;
}

std::vector<CopyRecord> Schedule() {
  std::lock_guard<std::mutex> lock(mu);
  return schedule;
}
void ClearSchedule() {
  std::lock_guard<std::mutex> lock(mu);
  schedule.clear();
}
int MaxPeerCopiesInFlight(int node_device) {
  std::vector<std::pair<double, int>> edges;  // (time, +1 start / -1 end)
  for (const CopyRecord& c : Schedule()) {
    if (c.device != node_device || !c.peer) continue;
    edges.emplace_back(c.start_us, 1);
    edges.emplace_back(c.end_us, -1);
  }
  std::sort(edges.begin(), edges.end());  // an end before a start at the same time
  int now = 0, most = 0;
  for (const auto& [t, d] : edges) most = std::max(most, now += d);
  return most;
}
std::string Fault(int ordinal) {
  std::lock_guard<std::mutex> lock(mu);
  return faults[ordinal];
}
int NodeDevice(int ordinal) {
  return ordinal >= 0 && ordinal < int(Cfg().devices.size()) ? Cfg().devices[ordinal] : -1;
}
void RemoveMemoryOf(int pid) {  // its names: cudaMalloc's
  const std::string prefix = "jax_smddp_node-" + std::to_string(pid) + "-";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* e = readdir(dir))
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0)
      shm_unlink(("/" + std::string(e->d_name)).c_str());
  closedir(dir);
}
Counters Count() {
  auto n = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  return Counters{n(n_ipc_exports), n(n_ipc_opens), n(n_cumem_exports),    n(n_imports),
                  n(n_maps),        n(n_grants),    n(n_attribute_queries)};
}

}  // namespace mock_node

using namespace mock_node;  // NOLINT: the runtime's entry points below use its parts

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorPeerAccessUnsupported:
      return "peer access is not supported between these two devices";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    default:
      return "mock CUDA error";
  }
}
cudaError_t cudaGetLastError() { return Faulted(current) ? cudaErrorIllegalAddress : cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* n) {
  *n = int(Cfg().devices.size());
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = current;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= int(Cfg().devices.size())) return cudaErrorInvalidDevice;
  current = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  // Every stream of the device: the tests synchronize streams instead.
  return Faulted(current) ? cudaErrorIllegalAddress : cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  const int n = int(Cfg().devices.size());
  if (device < 0 || device >= n || peer < 0 || peer >= n) return cudaErrorInvalidDevice;
  *can = Cfg().p2p && device != peer;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, current, peer) != cudaSuccess) return cudaErrorInvalidDevice;
  if (!can) return cudaErrorPeerAccessUnsupported;
  std::lock_guard<std::mutex> lock(mu);
  if (peer_enabled[current][peer]) return cudaErrorPeerAccessAlreadyEnabled;
  peer_enabled[current][peer] = true;
  return cudaSuccess;
}
// The mock's "device memory" is host memory: writes are always ordered.
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrGPUDirectRDMAWritesOrdering ? 100 : 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget,
                                               cudaFlushGPUDirectRDMAWritesScope) {
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  Alloc a{Kind::kDevice, bytes, current, NodeDevice(current), {}, {}, next_id++};
  std::snprintf(a.name, sizeof(a.name), "/jax_smddp_node-%d-%d-d%d", int(getpid()), allocations++,
                a.home);
  int fd = shm_open(a.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {  // a killed process's leftover, its pid reused
    shm_unlink(a.name);
    fd = shm_open(a.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  }
  if (fd < 0) return cudaErrorMemoryAllocation;
  *p = ftruncate(fd, off_t(bytes)) == 0 ? MapFd(fd, bytes) : nullptr;
  close(fd);
  if (!*p) {
    shm_unlink(a.name);
    return cudaErrorMemoryAllocation;
  }
  allocs[uintptr_t(*p)] = a;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocs.find(uintptr_t(p));
  if (it == allocs.end() || (it->second.kind != Kind::kDevice && it->second.kind != Kind::kIpc))
    return cudaErrorInvalidValue;
  munmap(p, it->second.bytes);
  if (it->second.kind == Kind::kDevice) shm_unlink(it->second.name);
  allocs.erase(it);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  const int dev = Of(s)->device;
  return Enqueue(s, [=] {
    if (Touch(dev, "cudaMemsetAsync", {{p, n}}, false)) std::memset(p, v, n);
  });
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  std::memcpy(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  return Copy2D(dst, n, src, n, n, 1, s, "cudaMemcpyAsync");
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t rows, cudaMemcpyKind, cudaStream_t s) {
  return Copy2D(dst, dpitch, src, spitch, width, rows, s, "cudaMemcpy2DAsync");
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  const size_t rounded = (bytes + 4095) / 4096 * 4096;
  *p = std::aligned_alloc(4096, rounded);
  if (!*p) return cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> lock(mu);
  allocs[uintptr_t(*p)] = Alloc{Kind::kHost, rounded, -1, -1, {}, {}, next_id++};
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  {
    std::lock_guard<std::mutex> lock(mu);
    allocs.erase(uintptr_t(p));
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
  std::lock_guard<std::mutex> lock(mu);
  allocs[uintptr_t(p)] = Alloc{Kind::kHost, bytes, -1, -1, {}, {}, next_id++};
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  allocs.erase(uintptr_t(p));
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) {
  *d = h;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = NewStream(current);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = Of(stream);
  {
    std::unique_lock<std::mutex> lock(s->m);
    s->idle.wait(lock, [&] { return s->q.empty() && !s->busy; });
  }
  return Faulted(s->device) ? cudaErrorIllegalAddress : cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!stream) return cudaErrorInvalidValue;
  {
    std::lock_guard<std::mutex> lock(stream->m);
    stream->stop = true;
    stream->cv.notify_all();
  }
  stream->worker.join();
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamGetDevice(cudaStream_t s, int* device) {
  *device = Of(s)->device;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  *status = Of(s)->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (!s || s->capturing) return cudaErrorInvalidValue;
  s->captured.clear();
  s->capturing = true;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (!s || !s->capturing) return cudaErrorInvalidValue;
  s->capturing = false;
  *graph = new CUgraph_st{std::move(s->captured)};
  s->captured.clear();
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraph_st{graph->ops};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  for (const auto& op : exec->ops) {
    if (const cudaError_t err = Enqueue(s, op); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  const uint64_t gen = e->recorded.fetch_add(1) + 1;
  return Enqueue(s, [e, gen] {
    uint64_t was = e->completed.load();
    while (was < gen && !e->completed.compare_exchange_weak(was, gen)) {
    }
  });
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  const uint64_t gen = e->recorded.load();  // the last record so far, as CUDA's
  return Enqueue(s, [e, gen] {
    while (e->completed.load() < gen) std::this_thread::sleep_for(std::chrono::microseconds(20));
  });
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  const uint64_t gen = e->recorded.load();
  while (e->completed.load() < gen) std::this_thread::sleep_for(std::chrono::microseconds(20));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}

// A handle: the shared memory's name (which ends with its node device).
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  Bump(n_ipc_exports);
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocs.find(uintptr_t(p));
  if (it == allocs.end() || it->second.kind != Kind::kDevice) return cudaErrorInvalidValue;
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, it->second.name, sizeof(it->second.name));
  return cudaSuccess;
}
// Opened in the current device's context; the owner must be reachable
// peer to peer (the lazy flag enables that access for this device only).
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  Bump(n_ipc_opens);
  if (On("JAX_SMDDP_MOCK_IPC_OPEN_FAILS")) return cudaErrorInvalidValue;
  h.reserved[sizeof(h.reserved) - 1] = '\0';
  const int home = HomeOfName(h.reserved);
  if (!Cfg().p2p && home != NodeDevice(current)) return cudaErrorPeerAccessUnsupported;
  const int fd = shm_open(h.reserved, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return cudaErrorInvalidValue;
  struct stat st;
  fstat(fd, &st);
  *p = MapFd(fd, size_t(st.st_size));
  close(fd);
  if (!*p) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mu);
  allocs[uintptr_t(*p)] = Alloc{Kind::kIpc, size_t(st.st_size), current, home, {}, {}, next_id++};
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void* p) { return cudaFree(p); }

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* found) {
  const std::pair<const char*, void*> entries[] = {
      {"cuStreamWaitValue32", reinterpret_cast<void*>(&StreamWaitValue32)},
      {"cuStreamWriteValue32", reinterpret_cast<void*>(&StreamWriteValue32)},
      {"cuStreamBatchMemOp", reinterpret_cast<void*>(&StreamBatchMemOp)},
      {"cuPointerGetAttributes", reinterpret_cast<void*>(&PointerGetAttributes)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&RetainAllocationHandle)},
      {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&ExportToShareableHandle)},
      {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&ImportFromShareableHandle)},
      {"cuMemRelease", reinterpret_cast<void*>(&Release)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&AddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&AddressFree)},
      {"cuMemMap", reinterpret_cast<void*>(&MemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&MemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&SetAccess)},
  };
  *fn = nullptr;
  for (const auto& [name, entry] : entries) {
    if (std::strcmp(symbol, name) == 0) *fn = entry;
  }
  *found = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
