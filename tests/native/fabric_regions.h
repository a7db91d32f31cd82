// Test helper: libfabric's shm provider names each endpoint's region
// /dev/shm/<name>:<n>:<m>, jax_smddp's name being <pid>-<random word>
// (fabric_api.cc), and removes it when the endpoint closes, which a killed
// process (or one leaving by _exit) never does. Tests that kill their
// children remove the children's regions with this; a test that closes its
// endpoints checks that none are left.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_

#include <dirent.h>
#include <sys/mman.h>
#include <sys/types.h>

#include <cstring>
#include <string>

// Removes `pid`'s regions (remove = true) or only counts them; returns how
// many there were.
inline int FabricRegionsOf(pid_t pid, bool remove = false) {
  const std::string prefix = std::to_string(pid) + "-";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int found = 0;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) != 0) continue;
    ++found;
    if (remove) shm_unlink(("/" + std::string(e->d_name)).c_str());
  }
  closedir(dir);
  return found;
}

inline void RemoveFabricRegionsOf(pid_t pid) { FabricRegionsOf(pid, /*remove=*/true); }

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_
