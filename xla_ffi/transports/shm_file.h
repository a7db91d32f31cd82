// Named POSIX shared memory between processes of one host: the files behind
// the shared-memory link (shm_link.h) and the GPU flag blocks
// (shared_block.h). Names are "/jax_smddp-<32 hex chars from getrandom()>":
// unguessable, and recognisable when a peer hands one over.
#ifndef JAX_SMDDP_TRANSPORTS_SHM_FILE_H_
#define JAX_SMDDP_TRANSPORTS_SHM_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla_ffi/common/status.h"

namespace smddp {

// Creates a new file of `bytes` (shm_open O_CREAT|O_EXCL, mode 0600), backed
// now so that a full /dev/shm fails here, not with SIGBUS later (`hint` says
// what to lower), and maps it read-write. The file's descriptor is closed.
Status CreateShmFile(size_t bytes, const std::string& hint, std::string* name, void** base);

// Maps a file a peer created, after checking the name, that it belongs to
// this user and nobody else may open it, and that its size is within
// [min_bytes, max_bytes]. `what` names the kind of file in errors.
Status OpenShmFile(const std::string& name, const char* what, uint64_t min_bytes,
                   uint64_t max_bytes, void** base, size_t* bytes);

// Removes the name (mappings stay valid); a name already gone is not an error.
Status UnlinkShmFile(const std::string& name);

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_SHM_FILE_H_
