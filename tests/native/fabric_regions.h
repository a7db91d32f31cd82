// Test helper: libfabric's shm provider names each endpoint's region
// /dev/shm/<pid>:<n>:<m> and removes it when the endpoint closes, which a
// killed process (or one leaving by _exit) never does. Tests that kill their
// children remove the children's regions with this.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_

#include <dirent.h>
#include <sys/mman.h>
#include <sys/types.h>

#include <cstring>
#include <string>

inline void RemoveFabricRegionsOf(pid_t pid) {
  const std::string prefix = std::to_string(pid) + ":";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0)
      shm_unlink(("/" + std::string(e->d_name)).c_str());
  }
  closedir(dir);
}

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_REGIONS_H_
