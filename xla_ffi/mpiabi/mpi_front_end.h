// What the MPI calls XLA makes mean on jax_smddp's engine.
//
// XLA's CPU client (jax_cpu_collectives_implementation='mpi') creates one MPI
// communicator per device and clique: every device of a program that crosses
// processes calls MPI_Comm_split(MPI_COMM_WORLD, color = the clique's first
// device, key = the device's rank in it), each from its own thread. Here
// MPI_COMM_WORLD is every device of the job (not every process), so a split
// is collective over devices: once all devices of this process have called
// it, the processes exchange their (color, key) pairs over the engine's world
// and each clique becomes an engine communicator (in one process: the
// in-process rendezvous; across processes: the cross-process one, with its
// routes, deadline and dead-peer detection). The handle each device gets is
// its rank in that communicator; its n-th collective call meets the other
// ranks' n-th (MPI's ordering rule), so no tag is needed.
//
// Errors are MPI error codes; MPI_Error_string on the same thread gives the
// engine's message (XLA puts it in the exception Python sees).
#ifndef JAX_SMDDP_MPIABI_MPI_FRONT_END_H_
#define JAX_SMDDP_MPIABI_MPI_FRONT_END_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/algorithms/plan.h"
#include "xla_ffi/common/status.h"
#include "xla_ffi/engine/communicator.h"
#include "xla_ffi/transports/world.h"

namespace smddp {
namespace mpi {

struct Mailbox;  // point-to-point messages between ranks of one process

// One clique as this process shares it among its devices.
struct Group {
  std::unique_ptr<Communicator> comm;
  uint64_t site = 0;             // names the clique alike in every process
  std::vector<int64_t> members;  // each rank's key (its device's rank in XLA's clique)
  std::vector<int> process_of_rank;
  std::unique_ptr<Mailbox> mailbox;
  std::shared_ptr<const World> world;  // of the split; its calls are counted there
  Group();
  ~Group();
};

// The communicator handle one device holds: its rank in a clique.
struct Rank {
  std::shared_ptr<Group> group;
  int rank = 0;
  uint64_t calls = 0;  // collective calls so far (touched by this device's thread only)
  // Point-to-point messages so far, per (peer, tag) (MPI's non-overtaking order).
  std::map<std::pair<int, int>, uint64_t> sent, received;
};

// Called by jax_smddp (Python) before JAX creates its CPU client: the world
// to use (the CPU module's, see world.h) and how many devices this process
// has, which is how many split calls make one split.
void Configure(WorldSource source, int local_devices);

// Records `message` for MPI_Error_string on this thread; returns `code`.
int Fail(int code, std::string message);
int Fail(const Status& status);
// An MPI function this library does not implement.
int Unsupported(const char* function);
// The message of `code` (this thread's last failure when it has that code).
std::string ErrorString(int code);

void SetInitialized(bool on);
bool Initialized();
bool Finalized();

// MPI_COMM_WORLD as a process sees it: this process and the job's processes.
int WorldRank();
int WorldSize();

// MPI_Comm_split(MPI_COMM_WORLD, color, key): blocks until every device of
// the job has called it. `*out` is null for color MPI_UNDEFINED.
Status Split(int color, int key, Rank** out);
int Size(const Rank& r);

// One collective call of `r`'s device, made by MPI function `mpi_name`;
// blocks until it is over for it. Its bytes in and out are the plan's
// (CallBytes). Counted as `caller` in the world's calls (World::CountCall)
// once it succeeded.
Status RunCollective(Rank& r, const char* mpi_name, World::Caller caller, const Plan& plan,
                     const void* send, void* recv);

// Counts one call of `caller` of `r`'s device delivering `bytes` in the
// calls of the world its clique was split in (none without one).
void CountCall(const Rank& r, World::Caller caller, uint64_t bytes);

}  // namespace mpi
}  // namespace smddp

#endif  // JAX_SMDDP_MPIABI_MPI_FRONT_END_H_
