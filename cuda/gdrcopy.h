// GDRCopy (NVIDIA's gdrdrv + libgdrapi), loaded with dlopen when present:
// maps a piece of device memory into the host's address space so a host
// thread (the network proxy) can raise a flag in GPU memory with a plain
// store, which a stream waiting on that flag sees at device-memory latency
// instead of polling host memory over PCIe. Absent library or driver: not
// available, and callers use mapped pinned host memory instead.
#ifndef JAX_SMDDP_CUDA_GDRCOPY_H_
#define JAX_SMDDP_CUDA_GDRCOPY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla_ffi/common/status.h"

namespace smddp {
namespace cuda {

// GDRCopy pins and maps whole GPU pages, from a page start.
constexpr size_t kGdrPageBytes = 64 << 10;

// Whether libgdrapi loads and gdr_open() succeeds (the gdrdrv driver is
// loaded), once per process; JAX_SMDDP_GDRCOPY=0 turns it off. `why` says why
// not.
bool GdrCopyAvailable(std::string* why = nullptr);

// Device memory `device_ptr` (on a kGdrPageBytes boundary, `bytes` rounded
// up to whole pages by the caller) mapped for the host.
class GdrMapping {
 public:
  static Status Map(void* device_ptr, size_t bytes, GdrMapping* out);
  GdrMapping() = default;
  GdrMapping(const GdrMapping&) = delete;
  GdrMapping& operator=(const GdrMapping&) = delete;
  GdrMapping(GdrMapping&& other) noexcept { *this = std::move(other); }
  GdrMapping& operator=(GdrMapping&& other) noexcept;
  ~GdrMapping();

  // Host address of device_ptr.
  uint8_t* host() const { return host_; }

 private:
  uint64_t handle_ = 0;
  void* map_ = nullptr;
  size_t bytes_ = 0;
  uint8_t* host_ = nullptr;
};

}  // namespace cuda
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_GDRCOPY_H_
