#include "cuda/buffer_ipc.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>

#include "cuda/device_scope.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace smddp {
namespace cuda {
namespace {

using Ptr = unsigned long long;      // CUdeviceptr
using Generic = unsigned long long;  // CUmemGenericAllocationHandle
struct AccessDesc {                  // CUmemAccessDesc
  int location_type;                 // CU_MEM_LOCATION_TYPE_DEVICE
  int location_id;                   // the device ordinal
  int flags;                         // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
};
enum : int { kLocationDevice = 1, kProtReadWrite = 3, kPosixFd = 1 };
// CUpointer_attribute values (cuda.h).
enum : int {
  kBufferId = 7,
  kLegacyIpcCapable = 10,
  kRangeStart = 11,
  kRangeSize = 12,
  kAllowedHandleTypes = 14,
};

struct Api {
  int (*attributes)(unsigned, const int*, void**, Ptr) = nullptr;  // cuPointerGetAttributes
  int (*retain)(Generic*, void*) = nullptr;                        // cuMemRetainAllocationHandle
  int (*export_fd)(void*, Generic, int,
                   unsigned long long) = nullptr;    // cuMemExportToShareableHandle
  int (*import_fd)(Generic*, void*, int) = nullptr;  // cuMemImportFromShareableHandle
  int (*release)(Generic) = nullptr;                 // cuMemRelease
  int (*reserve)(Ptr*, size_t, size_t, Ptr, unsigned long long) = nullptr;  // cuMemAddressReserve
  int (*free_range)(Ptr, size_t) = nullptr;                                 // cuMemAddressFree
  int (*map)(Ptr, size_t, size_t, Generic, unsigned long long) = nullptr;   // cuMemMap
  int (*unmap)(Ptr, size_t) = nullptr;                                      // cuMemUnmap
  int (*set_access)(Ptr, size_t, const AccessDesc*, size_t) = nullptr;      // cuMemSetAccess
  bool cumem() const {
    return retain && export_fd && import_fd && release && reserve && free_range && map && unmap &&
           set_access;
  }
};

const Api& TheApi() {
  static const Api api = [] {
    Api a;
    a.attributes = Driver<decltype(a.attributes)>("cuPointerGetAttributes");
    a.retain = Driver<decltype(a.retain)>("cuMemRetainAllocationHandle");
    a.export_fd = Driver<decltype(a.export_fd)>("cuMemExportToShareableHandle");
    a.import_fd = Driver<decltype(a.import_fd)>("cuMemImportFromShareableHandle");
    a.release = Driver<decltype(a.release)>("cuMemRelease");
    a.reserve = Driver<decltype(a.reserve)>("cuMemAddressReserve");
    a.free_range = Driver<decltype(a.free_range)>("cuMemAddressFree");
    a.map = Driver<decltype(a.map)>("cuMemMap");
    a.unmap = Driver<decltype(a.unmap)>("cuMemUnmap");
    a.set_access = Driver<decltype(a.set_access)>("cuMemSetAccess");
    return a;
  }();
  return api;
}

Status DriverError(const std::string& what, int r) {
  return Status::Error(what + " failed (CUDA driver error " + std::to_string(r) + ")");
}

// A handle's first byte says its kind; what follows depends on it.
enum : unsigned char { kLegacy = 1, kFileDescriptor = 2 };
constexpr size_t kPayload = 8;
struct FdPayload {
  int32_t pid;     // the exporting process
  int32_t fd;      // its descriptor of the allocation
  uint64_t bytes;  // the allocation's size
};
static_assert(kPayload + sizeof(cudaIpcMemHandle_t) <= BufferExchange::kHandleBytes,
              "a legacy CUDA IPC handle fits in a buffer handle");
static_assert(kPayload + sizeof(FdPayload) <= BufferExchange::kHandleBytes,
              "a file descriptor handle fits in a buffer handle");

struct Attributes {
  unsigned long long start = 0, id = 0, allowed = 0;
  int legacy = 0;  // zeroed: the driver may write a narrower boolean
};

Status Query(int ordinal, const void* p, Attributes* a) {
  const Api& api = TheApi();
  if (!api.attributes) return Status::Error("the driver has no cuPointerGetAttributes");
  DeviceScope scope(ordinal);  // the driver call needs a current context
  const int which[4] = {kRangeStart, kBufferId, kLegacyIpcCapable, kAllowedHandleTypes};
  void* data[4] = {&a->start, &a->id, &a->legacy, &a->allowed};
  if (const int r = api.attributes(4, which, data, reinterpret_cast<Ptr>(p)); r != 0)
    return DriverError("cuPointerGetAttributes", r);
  return Status::Ok();
}

// A peer may copy this process's descriptors (pidfd_getfd checks ptrace
// access: under Yama's ptrace_scope=1 only if this process allows it).
void AllowPeersToCopyDescriptors() {
  static const bool done = [] {
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // fails harmlessly without Yama
    return true;
  }();
  (void)done;
}

// A peer's descriptor `fd` copied into this process, or -1 with errno set.
int CopyDescriptor(int pid, int fd) {
  const int pidfd = int(syscall(SYS_pidfd_open, pid_t(pid), 0));
  if (pidfd < 0) return -1;
  const int copy = int(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int saved = errno;
  close(pidfd);
  errno = saved;
  return copy;
}

std::string CopyFailure(int pid, int err) {
  return "copying process " + std::to_string(pid) +
         "'s descriptors (pidfd_getfd): " + std::strerror(err) +
         (err == EPERM    ? " (refused here: a seccomp profile without CAP_SYS_PTRACE, "
                            "kernel.yama.ptrace_scope >= 2, or another user)"
          : err == ENOSYS ? " (Linux 5.6 or later is needed)"
                          : "");
}

}  // namespace

int DescriptorProbe() {
  static const int fd = [] {
    AllowPeersToCopyDescriptors();
    return open("/dev/null", O_RDONLY | O_CLOEXEC);  // kept for the process's life
  }();
  return fd;
}

std::string CopyDescriptorRefused(int pid, int fd) {
  const int copy = CopyDescriptor(pid, fd);
  if (copy < 0) return CopyFailure(pid, errno);
  close(copy);
  return "";
}

Status BufferIpc::FindAllocation(int ordinal, const void* p, uintptr_t* base, uint64_t* unique) {
  Attributes a;
  SMDDP_RETURN_IF_ERROR(Query(ordinal, p, &a));
  if (!a.start || !a.id)
    return Status::Error(
        "its memory is not device memory the driver knows (managed or host memory?)");
  if (!a.legacy) {
    if (!((a.allowed & kPosixFd) && TheApi().cumem()))
      return Status::Error(
          "its memory can be shared neither by legacy CUDA IPC nor as a POSIX "
          "file descriptor (memory pools, XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async, "
          "cannot)");
    if (!descriptors_refused_.empty())
      return Status::Error("its memory can only be shared as a file descriptor, and " +
                           descriptors_refused_);
  }
  *base = uintptr_t(a.start);
  *unique = uint64_t(a.id);
  return Status::Ok();
}

void BufferIpc::RefuseDescriptors(const std::string& why) {
  if (descriptors_refused_.empty()) descriptors_refused_ = why;
}

size_t BufferIpc::mapped() {
  std::lock_guard<std::mutex> lock(mu_);
  return by_handle_.size();
}

Status BufferIpc::Map(int ordinal, const BufferExchange::Handle& handle, uint8_t** base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_handle_.find(handle);
  if (it != by_handle_.end()) {
    if (auto at = it->second.find(ordinal); at != it->second.end()) {
      *base = at->second;
      return Status::Ok();
    }
    if (handle[0] == kFileDescriptor) {  // mapped for another device: grant this one access
      uint8_t* mapping = it->second.begin()->second;
      for (const Range& r : mapped_) {
        if (r.address != Ptr(uintptr_t(mapping))) continue;
        DeviceScope scope(ordinal);
        const AccessDesc access{kLocationDevice, ordinal, kProtReadWrite};
        if (const int e = TheApi().set_access(r.address, r.bytes, &access, 1); e != 0)
          return DriverError("cuMemSetAccess (device " + std::to_string(ordinal) + ")", e);
        *base = it->second[ordinal] = mapping;
        return Status::Ok();
      }
      return Status::Error("a mapped buffer lost its range; report this as a bug");
    }
  }
  SMDDP_RETURN_IF_ERROR(MapOnce(ordinal, handle, base));
  by_handle_[handle][ordinal] = *base;
  return Status::Ok();
}

BufferIpc::~BufferIpc() {
  const Api& api = TheApi();
  for (const auto& [ordinal, p] : legacy_) {
    DeviceScope scope(ordinal);
    cudaIpcCloseMemHandle(p);
  }
  for (const Range& r : mapped_) {
    DeviceScope scope(r.ordinal);
    api.unmap(r.address, r.bytes);
    api.free_range(r.address, r.bytes);
  }
  for (int fd : exported_fds_) close(fd);
}

Status BufferIpc::Export(int ordinal, uintptr_t base, BufferExchange::Handle* handle) {
  Attributes a;
  SMDDP_RETURN_IF_ERROR(Query(ordinal, reinterpret_cast<const void*>(base), &a));
  handle->fill(0);
  DeviceScope scope(ordinal);
  if (a.legacy) {
    cudaIpcMemHandle_t h;
    const cudaError_t err = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::Error(std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(err));
    }
    (*handle)[0] = kLegacy;
    std::memcpy(handle->data() + kPayload, &h, sizeof(h));
    return Status::Ok();
  }
  const Api& api = TheApi();
  unsigned long long bytes = 0;
  const int which = kRangeSize;
  void* data = &bytes;
  if (const int r = api.attributes(1, &which, &data, Ptr(base)); r != 0 || bytes == 0)
    return DriverError("cuPointerGetAttributes (range size)", r);
  Generic g = 0;
  if (const int r = api.retain(&g, reinterpret_cast<void*>(base)); r != 0)
    return DriverError("cuMemRetainAllocationHandle", r);
  int fd = -1;
  const int r = api.export_fd(&fd, g, kPosixFd, 0);
  api.release(g);  // XLA keeps its own reference; the descriptor keeps another
  if (r != 0) return DriverError("cuMemExportToShareableHandle (POSIX file descriptor)", r);
  AllowPeersToCopyDescriptors();
  {
    std::lock_guard<std::mutex> lock(mu_);
    exported_fds_.push_back(fd);
  }
  const FdPayload payload{int32_t(getpid()), int32_t(fd), uint64_t(bytes)};
  (*handle)[0] = kFileDescriptor;
  std::memcpy(handle->data() + kPayload, &payload, sizeof(payload));
  return Status::Ok();
}

Status BufferIpc::MapOnce(int ordinal, const BufferExchange::Handle& handle, uint8_t** base) {
  DeviceScope scope(ordinal);
  if (handle[0] == kLegacy) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + kPayload, sizeof(h));
    void* p = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::Error(std::string("cudaIpcOpenMemHandle: ") + cudaGetErrorString(err));
    }
    legacy_.emplace_back(ordinal, static_cast<uint8_t*>(p));
    *base = static_cast<uint8_t*>(p);
    return Status::Ok();
  }
  if (handle[0] != kFileDescriptor) return Status::Error("a buffer handle of an unknown kind");
  const Api& api = TheApi();
  if (!api.cumem())
    return Status::Error("this driver has no cuMem* entry points to map the buffer");
  FdPayload payload;
  std::memcpy(&payload, handle.data() + kPayload, sizeof(payload));
  const int fd = CopyDescriptor(payload.pid, payload.fd);
  if (fd < 0) return Status::Error(CopyFailure(payload.pid, errno));
  Generic g = 0;
  int r = api.import_fd(&g, reinterpret_cast<void*>(uintptr_t(fd)), kPosixFd);
  close(fd);  // the imported handle keeps the allocation
  if (r != 0) return DriverError("cuMemImportFromShareableHandle", r);
  Ptr address = 0;
  const size_t bytes = size_t(payload.bytes);
  r = api.reserve(&address, bytes, 0, 0, 0);
  if (r != 0) {
    api.release(g);
    return DriverError("cuMemAddressReserve", r);
  }
  r = api.map(address, bytes, 0, g, 0);
  api.release(g);  // the mapping keeps the allocation
  if (r != 0) {
    api.free_range(address, bytes);
    return DriverError("cuMemMap", r);
  }
  const AccessDesc access{kLocationDevice, ordinal, kProtReadWrite};
  r = api.set_access(address, bytes, &access, 1);
  if (r != 0) {
    api.unmap(address, bytes);
    api.free_range(address, bytes);
    return DriverError("cuMemSetAccess", r);
  }
  mapped_.push_back(Range{ordinal, address, bytes});
  *base = reinterpret_cast<uint8_t*>(uintptr_t(address));
  return Status::Ok();
}

}  // namespace cuda
}  // namespace smddp
