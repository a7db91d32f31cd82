// The MPI ABI jaxlib's MPItrampoline calls through (MPItrampoline's "MPIABI",
// version 2.x): handles are pointer-sized integers, MPI_Status has
// MPI_SOURCE, MPI_TAG and MPI_ERROR after 24 bytes of implementation fields,
// and every constant is a variable this library exports (abi_names.inc).
// XLA's CPU client calls it when jax_cpu_collectives_implementation='mpi';
// this library serves those calls with jax_smddp's engine (mpi_front_end.h).
#ifndef JAX_SMDDP_MPIABI_ABI_H_
#define JAX_SMDDP_MPIABI_ABI_H_

#include <cstddef>
#include <cstdint>

#define SMDDP_MPI_EXPORT __attribute__((visibility("default")))

extern "C" {

typedef uintptr_t MPIABI_Comm;
typedef uintptr_t MPIABI_Datatype;
typedef uintptr_t MPIABI_Op;
typedef uintptr_t MPIABI_Request;

struct MPIABI_Status {
  int implementation[4];
  size_t implementation_count;
  int MPI_SOURCE;
  int MPI_TAG;
  int MPI_ERROR;
};
static_assert(sizeof(MPIABI_Status) == 40, "MPIABI_Status is 10 Fortran integers");

// The version of the ABI this library implements (MPItrampoline accepts an
// equal major and a minor at least its own: jaxlib's requires 2.9).
SMDDP_MPI_EXPORT extern const int mpiabi_version_major;
SMDDP_MPI_EXPORT extern const int mpiabi_version_minor;
SMDDP_MPI_EXPORT extern const int mpiabi_version_patch;

#define SMDDP_MPI_INT(name, value) SMDDP_MPI_EXPORT extern const int64_t MPIABI_##name;
#define SMDDP_MPI_HANDLE(name, value) SMDDP_MPI_EXPORT extern const uintptr_t MPIABI_##name;
#define SMDDP_MPI_POINTER(name) SMDDP_MPI_EXPORT extern void* const MPIABI_##name;
#define SMDDP_MPI_CONSTANTS
#include "xla_ffi/mpiabi/abi_names.inc"
#undef SMDDP_MPI_CONSTANTS
#undef SMDDP_MPI_INT
#undef SMDDP_MPI_HANDLE
#undef SMDDP_MPI_POINTER

}  // extern "C"

#endif  // JAX_SMDDP_MPIABI_ABI_H_
