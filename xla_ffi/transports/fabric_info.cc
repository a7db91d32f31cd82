#include "xla_ffi/transports/fabric_info.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "xla_ffi/common/settings.h"
#include "xla_ffi/transports/fabric_api.h"
#include "xla_ffi/transports/fabric_link.h"

namespace smddp {

// With or without libfabric's headers (DefaultFabricProvider is the build's).
std::string ChooseFabricProvider(const std::string& requested) {
  if (!requested.empty()) return requested;
  std::string env = TextSetting("JAX_SMDDP_FABRIC_PROVIDER");
  return env.empty() ? DefaultFabricProvider() : env;
}

FabricInfo DescribeFabric() {
  FabricInfo info;
#ifndef SMDDP_HAVE_LIBFABRIC
  info.error = kFabricNoHeaders;
  return info;
#else
  info.built = true;
#ifdef SMDDP_LIBFABRIC_INCLUDE_DIR
  info.include_dir = SMDDP_LIBFABRIC_INCLUDE_DIR;
  info.library_dir = SMDDP_LIBFABRIC_LIBRARY_DIR;
#endif
  const FabricApi& a = GetFabricApi();
  if (!a.error.empty()) {
    info.error = a.error;
    return info;
  }
  info.loaded = true;
  info.path = a.path;
  uint32_t v = a.version();
  info.version = std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v));
  // The same endpoint type and memory-registration modes the transports ask for.
  struct fi_info* hints = a.dupinfo(nullptr);
  if (hints == nullptr) {
    info.error = "fi_dupinfo failed (out of memory)";
    return info;
  }
  hints->caps = FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = kRdmMrModes;
  struct fi_info* list = nullptr;
  int ret = a.getinfo(a.RequestedVersion(), nullptr, nullptr, 0, hints, &list);
  a.freeinfo(hints);
  if (ret != 0 && ret != -FI_ENODATA) info.error = "fi_getinfo failed: " + a.Err(ret);
  for (struct fi_info* i = list; i != nullptr; i = i->next) {
    const char* name = i->fabric_attr ? i->fabric_attr->prov_name : nullptr;
    if (name &&
        std::find(info.providers.begin(), info.providers.end(), name) == info.providers.end())
      info.providers.emplace_back(name);
  }
  if (list) a.freeinfo(list);
  info.default_provider = DefaultFabricProvider();
  for (int i = 0; i < kFabricEnvDefaultCount; ++i) {
    const char* name = kFabricEnvDefaults[i].name;
    const char* value = std::getenv(name);
    bool ours = std::find(a.env_set.begin(), a.env_set.end(), name) != a.env_set.end();
    info.env_defaults.push_back({name, value ? value : "", ours});
  }
  return info;
#endif
}

}  // namespace smddp
