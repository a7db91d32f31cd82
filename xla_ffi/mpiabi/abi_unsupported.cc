// Every MPI function of the ABI that this library does not implement: each
// fails with MPI_ERR_UNSUPPORTED_OPERATION, and MPI_Error_string then names
// the function (see mpi_front_end.h). The implemented ones
// (abi_functions.cc) replace these: the stubs are weak definitions.
#include "xla_ffi/mpiabi/abi.h"
#include "xla_ffi/mpiabi/mpi_front_end.h"

extern "C" {

#define SMDDP_MPI_STUB(symbol, mpi_name)                   \
  SMDDP_MPI_EXPORT __attribute__((weak)) int symbol(...) { \
    return smddp::mpi::Unsupported(mpi_name);              \
  }
#define SMDDP_MPI_FUNCTION(name) SMDDP_MPI_STUB(MPIABI_##name, "MPI_" #name)
#define SMDDP_MPIX_FUNCTION(name) SMDDP_MPI_STUB(MPIXABI_##name, "MPIX_" #name)
#define SMDDP_MPI_FUNCTIONS
#include "xla_ffi/mpiabi/abi_names.inc"

}  // extern "C"
