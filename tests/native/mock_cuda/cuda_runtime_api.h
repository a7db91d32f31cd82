// A stand-in for the CUDA runtime API, only what the GPU communicators'
// set-up calls (xla_ffi/engine/gpu_communicator.cc), so that set-up can be
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
#define JAX_SMDDP_MOCK_CUDA 1

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
inline cudaError_t cudaGetDevice(int* d) { *d = mock_cuda::device; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int d) { mock_cuda::device = d; return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) { *can = 1; return cudaSuccess; }
inline cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }

inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mock_cuda::mu);
  mock_cuda::Mapping m{true, bytes, {}, mock_cuda::next_buffer_id++};
  std::snprintf(m.name, sizeof(m.name), "/jax_smddp_mock-%d-%d", int(getpid()), mock_cuda::allocations++);
  const int fd = shm_open(m.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
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
inline cudaError_t cudaMemset(void* p, int v, size_t n) { std::memset(p, v, n); return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) { return cudaMemset(p, v, n); }
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
enum cudaDeviceAttr { cudaDevAttrGPUDirectRDMAFlushWritesOptions = 117,
                      cudaDevAttrGPUDirectRDMAWritesOrdering = 118 };
enum cudaGPUDirectRDMAWritesOrdering { cudaGPUDirectRDMAWritesOrderingNone = 0,
                                       cudaGPUDirectRDMAWritesOrderingOwner = 100 };
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

// The driver's cuPointerGetAttributes, the one entry point the set-up asks
// for: of the "allocation" holding `ptr`, its start (11), buffer id (7) and
// whether CUDA IPC can export it (10: allocated here); for other memory, as
// the driver does, zeros and success.
namespace mock_cuda {
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
    if (which[i] == 11) *static_cast<unsigned long long*>(data[i]) = found ? start : 0;
    else if (which[i] == 7) *static_cast<unsigned long long*>(data[i]) = found ? found->buffer_id : 0;
    else if (which[i] == 10) *static_cast<int*>(data[i]) = found && found->own;
    else return 1;  // CUDA_ERROR_INVALID_VALUE: not mocked
  }
  return 0;
}
}  // namespace mock_cuda
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0,
                                       cudaDriverEntryPointSymbolNotFound = 1 };
enum : unsigned long long { cudaEnableDefault = 0 };
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned,
                                                    unsigned long long,
                                                    cudaDriverEntryPointQueryResult* found) {
  const bool known = std::strcmp(symbol, "cuPointerGetAttributes") == 0;
  *fn = known ? reinterpret_cast<void*>(&mock_cuda::PointerGetAttributes) : nullptr;
  *found = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeHost(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaHostRegister(void*, size_t, unsigned) { return cudaSuccess; }
inline cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }
inline cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) { *d = h; return cudaSuccess; }

#endif  // JAX_SMDDP_TESTS_MOCK_CUDA_RUNTIME_API_H_
