// Communicators of the NCCL API front end. An ncclComm_t it hands out is a
// Comm: the ranks' processes and devices (learnt from each other over the
// world's links when the communicator is created), the jax_smddp GPU
// communicator behind it when the front end serves its calls, and, created
// at the first call it forwards, the real NCCL communicator.
//
// Creation. XLA's process for the clique's root device calls
// ncclGetUniqueId and hands the id to the others through the key-value
// store; every rank then calls ncclCommInitRank* with it, each from its own
// thread. The front end's id carries a random nonce naming the communicator
// and the creating process (the real library's id is agreed only at the
// communicator's first forwarded call, see RealComm): each
// rank sends that process (the root) its process, device and host; the root
// collects all of them (from whichever processes they come) and sends every
// member process the table; then the member processes set up the GPU
// communicator (cuda/gpu_communicator.h: regions mapped by CUDA IPC, watched
// peers) and trade its handles directly. ncclCommSplit runs the same
// exchange over the parent's ranks, with each rank's color and key.
//
// What is served: groups whose ranks' processes all run this front end
// (every process of a jax_smddp job does): inside one host on the GPU
// communicator, across hosts (equal ranks per host) on the hierarchical
// bodies: this host's GPU communicator and network ports over the world's
// links. Everything on a communicator whose config or library version the
// front end does not know is forwarded.
#ifndef JAX_SMDDP_CUDA_NCCLAPI_NCCL_COMM_H_
#define JAX_SMDDP_CUDA_NCCLAPI_NCCL_COMM_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/gpu_communicator.h"
#include "cuda/ncclapi/nccl_types.h"
#include "xla_ffi/algorithms/net_port.h"
#include "xla_ffi/common/status.h"
#include "xla_ffi/transports/world.h"

namespace smddp {
namespace nccl {

// The id's layout: the real library's id first (its bytes past this offset
// must be zero for it to fit), then the front end's part.
constexpr size_t kRealIdBytes = 88;

struct WindowState;  // its registered windows (nccl_windows.h)

struct Comm {
  int nranks = 0;
  int rank = 0;
  int ordinal = 0;             // the CUDA device current when it was created
  uint64_t nonce[2] = {0, 0};  // names it alike in every rank
  bool served = false;
  std::string forwarded_because;  // why its calls are forwarded (served false)
  std::vector<int> process_of;    // per rank
  std::vector<int64_t> members;   // the GPU communicator's member ids
  gpu::LocalRank* local =
      nullptr;              // this host's rank (a communicator across hosts: of its intra part)
  NetPort* port = nullptr;  // across hosts: the rank's network port
  const std::vector<int>* rank_of = nullptr;  // across hosts: host-major order of the ranks
  int hosts = 1;
  // Where its calls are counted. Weak: a communicator XLA never destroys
  // must not keep the world's links open past jax_smddp's shutdown.
  std::weak_ptr<const World> world;
  uint64_t calls = 0;                    // collective calls (op ids in messages)
  uint64_t splits = 0;                   // splits of it so far (names the children)
  std::shared_ptr<WindowState> windows;  // made at its first registration

  // Forwarding: the real communicator, created at the first forwarded call
  // (every call of a communicator forwarded entirely), from a real id
  // agreed then (real_id_later: one made from the front end's id or split)
  // or known from creation (an id another NCCL library made).
  std::mutex real_mu;
  bool real_id_later = false;
  bool have_real_id = false;
  ncclUniqueId real_id{};
  std::vector<unsigned char> config;  // the caller's ncclConfig_t, as it came
  ncclComm_t real = nullptr;
  Status real_failure;  // why the real communicator could not be created

  std::mutex error_mu;
  Status async_error;               // what ncclCommGetAsyncError reports
  std::atomic<bool> failed{false};  // async_error is set: read per call without the lock
  std::string last_error;           // ncclGetLastError(comm)
};

// A Comm from a handle, or null for a handle this front end did not make
// (or destroyed): handles are looked up, never dereferenced blindly.
Comm* AsComm(ncclComm_t handle);
// The handle of a new Comm (AsComm knows it from now on), and its end.
ncclComm_t Publish(Comm* comm);
void Retire(Comm* comm);

// A communicator the real library made by itself (ncclCommInitAll,
// ncclCommShrink, the split of a forwarded parent): its calls are all
// forwarded, for `why`; its size, rank and device are the real one's.
Comm* WrapReal(ncclComm_t real, const std::string& why);

// A front-end id (ncclGetUniqueId).
Status MakeUniqueId(ncclUniqueId* out);

// ncclCommInitRankConfig (config may be null). A failure names the ranks
// that did not join within the deadline, or what the set-up found.
Status InitRank(int nranks, const ncclUniqueId& id, int rank, const ncclConfig_t* config,
                Comm** out);

// ncclCommSplit: *out null for kNoColor. A served parent's ranks join as at
// creation; the child's real side is the real split of the parent's real
// communicator where it has one, else a real id the split's root made for
// the child's color (created at its first forwarded call). A parent whose
// calls are all forwarded is split by the real library alone.
Status Split(Comm& parent, int color, int key, const ncclConfig_t* config, Comm** out);

// The real communicator behind `comm`, created now if it was not (every rank
// of it reaches its first forwarded call at the same point of the program).
Status RealComm(Comm& comm, ncclComm_t* out);

// ncclCommDestroy / ncclCommFinalize / ncclCommAbort on the real side (if
// any); the GPU communicator stays registered until the process ends (XLA
// destroys communicators only at exit or after a failure).
ncclResult_t DestroyReal(Comm& comm, const char* function);

// Why a config is not one the front end knows ("" when it is).
std::string UnknownConfig(const ncclConfig_t* config);

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_NCCL_COMM_H_
