#include "cuda/gdrcopy.h"
#include "xla_ffi/common/settings.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

namespace smddp {
namespace cuda {
namespace {

// The few gdrapi entry points used, by their C signatures (gdr_mh_t is a
// struct of one unsigned long, passed by value as such).
struct GdrApi {
  void* (*open)() = nullptr;
  int (*pin)(void* g, unsigned long addr, size_t size, uint64_t token, uint32_t va_space,
             uint64_t* handle) = nullptr;
  int (*unpin)(void* g, uint64_t handle) = nullptr;
  int (*map)(void* g, uint64_t handle, void** va, size_t size) = nullptr;
  int (*unmap)(void* g, uint64_t handle, void* va, size_t size) = nullptr;
  // gdr_info(_v2)'s first field is the pinned range's device address; the
  // rest is read into a generous buffer and ignored.
  int (*info)(void* g, uint64_t handle, void* info) = nullptr;
  void* g = nullptr;
  std::string why;
};

const GdrApi& Api() {
  static GdrApi api = [] {
    GdrApi a;
    if (TextSetting("JAX_SMDDP_GDRCOPY") == "0") {
      a.why = "turned off (JAX_SMDDP_GDRCOPY=0)";
      return a;
    }
    void* lib = dlopen("libgdrapi.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libgdrapi.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      a.why = "libgdrapi is not installed";
      return a;
    }
    a.open = reinterpret_cast<void* (*)()>(dlsym(lib, "gdr_open"));
    a.pin = reinterpret_cast<decltype(a.pin)>(dlsym(lib, "gdr_pin_buffer"));
    a.unpin = reinterpret_cast<decltype(a.unpin)>(dlsym(lib, "gdr_unpin_buffer"));
    a.map = reinterpret_cast<decltype(a.map)>(dlsym(lib, "gdr_map"));
    a.unmap = reinterpret_cast<decltype(a.unmap)>(dlsym(lib, "gdr_unmap"));
    a.info = reinterpret_cast<decltype(a.info)>(dlsym(lib, "gdr_get_info_v2"));
    if (!a.info) a.info = reinterpret_cast<decltype(a.info)>(dlsym(lib, "gdr_get_info"));
    if (!a.open || !a.pin || !a.unpin || !a.map || !a.unmap || !a.info) {
      a.why = "libgdrapi lacks the expected entry points";
      a.open = nullptr;
      return a;
    }
    a.g = a.open();
    if (!a.g) {
      a.why = "gdr_open failed (is the gdrdrv kernel module loaded?)";
      a.open = nullptr;
    }
    return a;
  }();
  return api;
}

}  // namespace

bool GdrCopyAvailable(std::string* why) {
  const GdrApi& a = Api();
  if (why) *why = a.why;
  return a.g != nullptr;
}

Status GdrMapping::Map(void* device_ptr, size_t bytes, GdrMapping* out) {
  const GdrApi& a = Api();
  if (!a.g) return Status::Error("jax_smddp: GDRCopy unavailable: " + a.why);
  const uintptr_t addr = uintptr_t(device_ptr);
  if (addr % kGdrPageBytes != 0)
    return Status::Error("jax_smddp: GDRCopy needs 64 KiB aligned memory");
  const size_t size = (bytes + kGdrPageBytes - 1) / kGdrPageBytes * kGdrPageBytes;
  GdrMapping m;
  if (a.pin(a.g, addr, size, 0, 0, &m.handle_) != 0)
    return Status::Error("jax_smddp: gdr_pin_buffer failed");
  m.bytes_ = size;
  if (a.map(a.g, m.handle_, &m.map_, size) != 0) {
    a.unpin(a.g, m.handle_);
    m.map_ = nullptr;
    m.bytes_ = 0;
    return Status::Error("jax_smddp: gdr_map failed");
  }
  alignas(8) unsigned char info[256];
  std::memset(info, 0, sizeof(info));
  if (a.info(a.g, m.handle_, info) != 0) return Status::Error("jax_smddp: gdr_get_info failed");
  uint64_t va;
  std::memcpy(&va, info, sizeof(va));
  m.host_ = static_cast<uint8_t*>(m.map_) + (addr - va);
  *out = std::move(m);
  return Status::Ok();
}

GdrMapping& GdrMapping::operator=(GdrMapping&& other) noexcept {
  std::swap(handle_, other.handle_);
  std::swap(map_, other.map_);
  std::swap(bytes_, other.bytes_);
  std::swap(host_, other.host_);
  return *this;
}

GdrMapping::~GdrMapping() {
  if (!map_) return;
  const GdrApi& a = Api();
  a.unmap(a.g, handle_, map_, bytes_);
  a.unpin(a.g, handle_);
}

}  // namespace cuda
}  // namespace smddp
