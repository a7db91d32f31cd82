#include "cuda/ncclapi/real_nccl.h"

#include <dlfcn.h>

#include <mutex>
#include <unordered_map>

#include "xla_ffi/common/settings.h"

namespace smddp {
namespace nccl {
namespace {

std::mutex mu;
std::string configured;    // guarded by mu
void* handle = nullptr;    // guarded by mu
std::string open_failure;  // guarded by mu: why the library could not be opened
std::unordered_map<std::string, void*>& Symbols() {  // guarded by mu
  static auto* symbols = new std::unordered_map<std::string, void*>;
  return *symbols;
}

std::string PathLocked() {
  const std::string chosen = TextSetting("JAX_SMDDP_NCCL_LIBRARY");
  return chosen.empty() ? configured : chosen;
}

void* OpenLocked(std::string* why) {
  if (handle) return handle;
  if (!open_failure.empty()) {
    *why = open_failure;
    return nullptr;
  }
  const std::string path = PathLocked();
  if (path.empty()) {
    // Not remembered: jax_smddp may still say where it is.
    *why =
        "the real NCCL library was not located (set JAX_SMDDP_NCCL_LIBRARY to the path of "
        "libnccl.so.2, e.g. site-packages/nvidia/nccl/lib/libnccl.so.2)";
    return nullptr;
  }
  if (path.find('/') == std::string::npos) {
    open_failure = "JAX_SMDDP_NCCL_LIBRARY=" + path +
                   " is not a path; the soname would name the front end itself";
    *why = open_failure;
    return nullptr;
  }
  handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* err = dlerror();
    open_failure = "the real NCCL library " + path + " could not be loaded: " + (err ? err : "?");
    *why = open_failure;
  }
  return handle;
}

}  // namespace

void SetRealLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu);
  if (handle || path == configured) return;  // the first library opened stays
  configured = path;
  open_failure.clear();
}

std::string RealLibrary() {
  std::lock_guard<std::mutex> lock(mu);
  return PathLocked();
}

void* RealSymbol(const char* name, std::string* why) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = Symbols().find(name);
  if (it != Symbols().end()) return it->second;
  void* lib = OpenLocked(why);
  if (!lib) return nullptr;
  void* symbol = dlsym(lib, name);
  if (!symbol) {
    *why = std::string("the real NCCL library has no ") + name;
    return nullptr;
  }
  Symbols()[name] = symbol;
  return symbol;
}

int RealVersion(std::string* why) {
  using Fn = ncclResult_t (*)(int*);
  auto fn = reinterpret_cast<Fn>(RealSymbol("ncclGetVersion", why));
  int version = 0;
  if (!fn) return 0;
  if (fn(&version) != ncclSuccess) {
    *why = "the real NCCL library's ncclGetVersion failed";
    return 0;
  }
  return version;
}

bool KnownVersion(int version) {
  return version >= kOldestKnownVersion && version <= kNewestKnownVersion;
}

}  // namespace nccl
}  // namespace smddp
