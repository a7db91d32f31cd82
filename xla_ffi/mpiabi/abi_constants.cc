// Defines every constant of the ABI (abi_names.inc) and the version
// MPItrampoline checks before it resolves them (exported as abi.h declares).
#include "xla_ffi/mpiabi/abi.h"

extern "C" {

const int mpiabi_version_major = 2;
const int mpiabi_version_minor = 10;
const int mpiabi_version_patch = 0;
// This library's own version, which MPItrampoline prints when verbose.
SMDDP_MPI_EXPORT extern const int mpiwrapper_version_major = 0;
SMDDP_MPI_EXPORT extern const int mpiwrapper_version_minor = 1;
SMDDP_MPI_EXPORT extern const int mpiwrapper_version_patch = 0;

// Sentinels (MPI_IN_PLACE, MPI_STATUS_IGNORE, ...): distinct addresses no
// buffer can have. Callback constants (MPI_COMM_DUP_FN, ...) point here too:
// no function that takes callbacks is implemented.
static char sentinels[64];

#define SMDDP_MPI_INT(name, value) const int64_t MPIABI_##name = value;
#define SMDDP_MPI_HANDLE(name, value) const uintptr_t MPIABI_##name = value;
#define SMDDP_MPI_POINTER(name) void* const MPIABI_##name = &sentinels[__COUNTER__ % 64];
#define SMDDP_MPI_CONSTANTS
#include "xla_ffi/mpiabi/abi_names.inc"

// MPItrampoline calls this before it reads the constants (for Fortran, which
// this library does not serve).
SMDDP_MPI_EXPORT void mpiwrapper_export_fortran_constants_() {}

}  // extern "C"
