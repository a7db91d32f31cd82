// MPI_Isend, MPI_Irecv and their completion on a clique's ranks (XLA's CPU
// collective-permute and all-to-all are made of them). A message between
// ranks of one process is copied once, from the sender's buffer into the
// receiver's, when both have posted; between processes it goes over the
// world's link to the peer (cross_process messages: chunked, under the
// deadline, failing with the peer's name if it dies). A message matches the
// peer's post with the same (source, destination, tag) and the same count of
// earlier such posts, as MPI's ordering rule says.
#ifndef JAX_SMDDP_MPIABI_MPI_POINT_TO_POINT_H_
#define JAX_SMDDP_MPIABI_MPI_POINT_TO_POINT_H_

#include <cstddef>

#include "xla_ffi/common/status.h"
#include "xla_ffi/mpiabi/mpi_front_end.h"

namespace smddp {
namespace mpi {

// The messages posted between ranks of one process, by (source, destination,
// tag, sequence): each side's buffer until the other side posts.
struct Mailbox;

// One posted send or receive (what an MPI_Request handle points to).
struct Transfer;

Status PostSend(Rank& r, int dest, int tag, const void* buf, size_t bytes, Transfer** out);
Status PostRecv(Rank& r, int source, int tag, void* buf, size_t bytes, Transfer** out);
// Waits until `t` is over and frees it.
Status Complete(Transfer* t);

}  // namespace mpi
}  // namespace smddp

#endif  // JAX_SMDDP_MPIABI_MPI_POINT_TO_POINT_H_
