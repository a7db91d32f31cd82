// What libfabric offers this process: whether the build had its headers, which
// library was loaded, and which providers can open the reliable-datagram
// endpoints the transports use. For jax_smddp.doctor and its requirements.
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_INFO_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_INFO_H_

#include <string>
#include <vector>

namespace smddp {

struct FabricInfo {
  bool built = false;                  // the build found libfabric's headers
  std::string include_dir;             // where it found them ("" when not built)
  std::string library_dir;             // where it found the library ("" when not found)
  bool loaded = false;                 // libfabric.so.1 loaded in this process
  std::string error;                   // why it cannot be used ("" when it can)
  std::string path;                    // the file loaded
  std::string version;                 // "major.minor" of the library
  std::vector<std::string> providers;  // RDM providers usable here, e.g. "tcp;ofi_rxm"
  std::string default_provider;        // what an unset JAX_SMDDP_FABRIC_PROVIDER picks
  // libfabric variables jax_smddp gives a default (kFabricEnvDefaults): the
  // value in effect, and whether it is jax_smddp's (false: the user's).
  struct EnvValue {
    std::string name;
    std::string value;
    bool ours = false;
  };
  std::vector<EnvValue> env_defaults;
};

// Loads libfabric if needed (once per process) and lists its providers.
FabricInfo DescribeFabric();

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_INFO_H_
