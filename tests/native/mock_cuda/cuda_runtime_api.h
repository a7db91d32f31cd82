// A stand-in for the CUDA runtime API, only what the GPU communicators'
// set-up calls (cuda/gpu_communicator.cc, cuda/gpu_hierarchy.cc), so that set-up can be
// tested on CPU processes (tests/native/gpu_communicator_test.cc) where
// there is no GPU. "Device memory" is POSIX shared memory named
// /jax_smddp_mock-<pid>-<n> (removed by cudaFree; the test removes those of
// a process it killed), so a "CUDA IPC handle" (the name) maps it in another
// process of this host;
// registering host memory maps it to itself; streams run nothing (the test
// drives the protocol with HostStreamOps). Never part of the library.
#ifndef JAX_SMDDP_TESTS_MOCK_CUDA_RUNTIME_API_H_
#define JAX_SMDDP_TESTS_MOCK_CUDA_RUNTIME_API_H_

// Tells the code under test that "device memory" is host memory here.
#define SMDDP_MOCK_CUDA_RUNTIME 1

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

typedef int cudaError_t;
enum : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorPeerAccessAlreadyEnabled = 704,
};
typedef struct CUstream_st* cudaStream_t;
struct cudaIpcMemHandle_t {
  char reserved[64];
};
enum : unsigned {
  cudaHostAllocPortable = 1,
  cudaHostAllocMapped = 2,
  cudaHostRegisterPortable = 1,
  cudaHostRegisterMapped = 2,
  cudaStreamNonBlocking = 1,
  cudaIpcMemLazyEnablePeerAccess = 1,
};

namespace mock_cuda {
struct Mapping {
  bool own;  // allocated here (else mapped from another process)
  size_t bytes;
  char name[64];
  unsigned long long buffer_id;  // never reused in the process, as CUDA's
};
inline unsigned long long next_buffer_id = 1;
inline std::mutex mu;
inline std::map<void*, Mapping> mappings;
inline int device = 0;
inline int allocations = 0;
inline void* Map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}
}  // namespace mock_cuda

inline const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : "mock CUDA error";
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) {
  *d = mock_cuda::device;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  mock_cuda::device = d;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) {
  *can = 1;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }

inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mock_cuda::mu);
  mock_cuda::Mapping m{true, bytes, {}, mock_cuda::next_buffer_id++};
  std::snprintf(m.name, sizeof(m.name), "/jax_smddp_mock-%d-%d", int(getpid()),
                mock_cuda::allocations++);
  int fd = shm_open(m.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    // This process never makes a name twice: it is a killed process's
    // leftover whose process id the system has handed out again.
    shm_unlink(m.name);
    fd = shm_open(m.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  }
  if (fd < 0) return cudaErrorMemoryAllocation;
  *p = ftruncate(fd, off_t(bytes)) == 0 ? mock_cuda::Map(fd, bytes) : nullptr;
  close(fd);
  if (!*p) {
    shm_unlink(m.name);
    return cudaErrorMemoryAllocation;
  }
  mock_cuda::mappings[*p] = m;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  std::lock_guard<std::mutex> lock(mock_cuda::mu);
  auto it = mock_cuda::mappings.find(p);
  if (it == mock_cuda::mappings.end()) return cudaErrorInvalidValue;
  munmap(p, it->second.bytes);
  if (it->second.own) shm_unlink(it->second.name);
  mock_cuda::mappings.erase(it);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  return cudaMemset(p, v, n);
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
enum cudaDeviceAttr {
  cudaDevAttrGPUDirectRDMAFlushWritesOptions = 117,
  cudaDevAttrGPUDirectRDMAWritesOrdering = 118
};
enum cudaGPUDirectRDMAWritesOrdering {
  cudaGPUDirectRDMAWritesOrderingNone = 0,
  cudaGPUDirectRDMAWritesOrderingOwner = 100
};
enum cudaFlushGPUDirectRDMAWritesOptions { cudaFlushGPUDirectRDMAWritesOptionHost = 1 };
enum cudaFlushGPUDirectRDMAWritesTarget { cudaFlushGPUDirectRDMAWritesTargetCurrentDevice };
enum cudaFlushGPUDirectRDMAWritesScope { cudaFlushGPUDirectRDMAWritesToOwner = 100 };
// The mock's "device memory" is host memory: writes are always ordered.
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrGPUDirectRDMAWritesOrdering ? 100 : 1;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget,
                                                      cudaFlushGPUDirectRDMAWritesScope) {
  return cudaSuccess;
}

inline cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  std::lock_guard<std::mutex> lock(mock_cuda::mu);
  auto it = mock_cuda::mappings.find(p);
  if (it == mock_cuda::mappings.end() || !it->second.own) return cudaErrorInvalidValue;
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, it->second.name, sizeof(it->second.name));
  return cudaSuccess;
}
// JAX_SMDDP_MOCK_IPC_OPEN_FAILS=1 (read at each call) makes opening fail.
inline cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  if (const char* fail = std::getenv("JAX_SMDDP_MOCK_IPC_OPEN_FAILS"); fail && fail[0] == '1')
    return cudaErrorInvalidValue;
  h.reserved[sizeof(h.reserved) - 1] = '\0';
  const int fd = shm_open(h.reserved, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return cudaErrorInvalidValue;
  struct stat st;
  fstat(fd, &st);
  *p = mock_cuda::Map(fd, size_t(st.st_size));
  close(fd);
  if (!*p) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(mock_cuda::mu);
  mock_cuda::mappings[*p] = {false, size_t(st.st_size), {}, mock_cuda::next_buffer_id++};
  return cudaSuccess;
}
inline cudaError_t cudaIpcCloseMemHandle(void* p) { return cudaFree(p); }

// The driver's cuPointerGetAttributes: of the "allocation" holding `ptr`,
// its start (11), size (12), buffer id (7), whether legacy CUDA IPC can
// export it (10) and the shareable handle types it allows (14). Allocated
// here: as cudaMalloc's (legacy IPC, no handle types), or with
// JAX_SMDDP_MOCK_CUMEM=1 as cuMemCreate's that allow POSIX file descriptors
// (what XLA hands out); for other memory, as the driver does, zeros and
// success.
namespace mock_cuda {
inline bool CuMem() {
  const char* v = std::getenv("JAX_SMDDP_MOCK_CUMEM");
  return v && v[0] == '1';
}
inline int PointerGetAttributes(unsigned count, const int* which, void** data,
                                unsigned long long ptr) {
  std::lock_guard<std::mutex> lock(mu);
  const Mapping* found = nullptr;
  unsigned long long start = 0;
  for (const auto& [at, m] : mappings) {
    const auto b = reinterpret_cast<unsigned long long>(at);
    if (ptr >= b && ptr < b + m.bytes) {
      found = &m;
      start = b;
    }
  }
  for (unsigned i = 0; i < count; ++i) {
    if (which[i] == 11)
      *static_cast<unsigned long long*>(data[i]) = found ? start : 0;
    else if (which[i] == 7)
      *static_cast<unsigned long long*>(data[i]) = found ? found->buffer_id : 0;
    else if (which[i] == 10)
      *static_cast<int*>(data[i]) = found && found->own && !CuMem();
    else if (which[i] == 12)
      *static_cast<unsigned long long*>(data[i]) = found ? found->bytes : 0;
    else if (which[i] == 14)
      *static_cast<unsigned long long*>(data[i]) = found && found->own && CuMem();
    else
      return 1;  // CUDA_ERROR_INVALID_VALUE: not mocked
  }
  return 0;
}
}  // namespace mock_cuda
// The cuMem* entry points (with JAX_SMDDP_MOCK_CUMEM=1): an allocation's
// handle is its buffer id; exporting opens its shared memory (the
// descriptor), importing keeps a copy of one; mapping maps it at a reserved
// address.
namespace mock_cuda {
inline std::map<unsigned long long, int> imported;  // handle -> descriptor
inline int cumem_maps = 0;                          // peers' allocations mapped by cuMemMap
inline unsigned long long next_import = 1ull << 40;
inline int RetainAllocationHandle(unsigned long long* h, void* addr) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = mappings.find(addr);
  if (it == mappings.end() || !it->second.own) return 1;
  *h = it->second.buffer_id;
  return 0;
}
inline int ExportToShareableHandle(void* out, unsigned long long h, int type, unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [at, m] : mappings) {
    if (m.own && m.buffer_id == h && type == 1) {
      const int fd = shm_open(m.name, O_RDWR | O_CLOEXEC, 0);
      if (fd < 0) return 2;
      *static_cast<int*>(out) = fd;
      return 0;
    }
  }
  return 1;
}
inline int ImportFromShareableHandle(unsigned long long* h, void* fd, int type) {
  if (const char* fail = std::getenv("JAX_SMDDP_MOCK_IPC_OPEN_FAILS"); fail && fail[0] == '1')
    return 1;  // as cudaIpcOpenMemHandle below
  const int copy = type == 1 ? dup(int(reinterpret_cast<uintptr_t>(fd))) : -1;
  if (copy < 0) return 1;
  std::lock_guard<std::mutex> lock(mu);
  *h = next_import++;
  imported[*h] = copy;
  return 0;
}
inline int Release(unsigned long long h) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = imported.find(h); it != imported.end()) {
    close(it->second);
    imported.erase(it);
  }
  return 0;
}
inline int AddressReserve(unsigned long long* p, size_t bytes, size_t, unsigned long long,
                          unsigned long long) {
  void* at = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) return 2;
  *p = reinterpret_cast<unsigned long long>(at);
  return 0;
}
inline int AddressFree(unsigned long long p, size_t bytes) {
  return munmap(reinterpret_cast<void*>(p), bytes) == 0 ? 0 : 1;
}
inline int MemMap(unsigned long long p, size_t bytes, size_t offset, unsigned long long h,
                  unsigned long long) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = imported.find(h);
  if (it == imported.end()) return 1;
  void* at = mmap(reinterpret_cast<void*>(p), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                  it->second, off_t(offset));
  if (at == MAP_FAILED) return 2;
  cumem_maps++;
  return 0;
}
inline int MemUnmap(unsigned long long p, size_t bytes) {
  void* at = mmap(reinterpret_cast<void*>(p), bytes, PROT_NONE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return at == MAP_FAILED ? 1 : 0;
}
inline int SetAccess(unsigned long long, size_t, const void*, size_t) { return 0; }
}  // namespace mock_cuda

enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1
};
enum : unsigned long long { cudaEnableDefault = 0 };
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned,
                                                    unsigned long long,
                                                    cudaDriverEntryPointQueryResult* found) {
  const std::pair<const char*, void*> entries[] = {
      {"cuPointerGetAttributes", reinterpret_cast<void*>(&mock_cuda::PointerGetAttributes)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&mock_cuda::RetainAllocationHandle)},
      {"cuMemExportToShareableHandle",
       reinterpret_cast<void*>(&mock_cuda::ExportToShareableHandle)},
      {"cuMemImportFromShareableHandle",
       reinterpret_cast<void*>(&mock_cuda::ImportFromShareableHandle)},
      {"cuMemRelease", reinterpret_cast<void*>(&mock_cuda::Release)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&mock_cuda::AddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&mock_cuda::AddressFree)},
      {"cuMemMap", reinterpret_cast<void*>(&mock_cuda::MemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&mock_cuda::MemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&mock_cuda::SetAccess)},
  };
  *fn = nullptr;
  for (const auto& [name, entry] : entries) {
    if (std::strcmp(symbol, name) == 0) *fn = entry;
  }
  *found = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaHostRegister(void*, size_t, unsigned) { return cudaSuccess; }
inline cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }
inline cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) {
  *d = h;
  return cudaSuccess;
}

#endif  // JAX_SMDDP_TESTS_MOCK_CUDA_RUNTIME_API_H_
