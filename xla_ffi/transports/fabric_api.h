// libfabric, loaded at run time: the transports that use it (the links,
// fabric_link_impl.h and its files; fabric_rail.cc) share one dlopen of "libfabric.so.1" and one
// table of the few functions it exports. Everything else goes through the objects' ops tables (the
// headers' inline wrappers), so nothing of libfabric is linked at build time. Include only from .cc
// files; it pulls in libfabric's headers when the build has them (SMDDP_HAVE_LIBFABRIC).
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_API_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_API_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla_ffi/common/hashing.h"  // Fnv1a, of endpoint addresses
#include "xla_ffi/common/status.h"

// The CMake build decides: -DSMDDP_HAVE_LIBFABRIC=1 with the headers' directory
// (and SMDDP_LIBFABRIC_LIBRARY_DIR, where the library was found), or
// -DSMDDP_NO_LIBFABRIC to build the stubs even where the headers exist. A build
// that says neither (the tests' hand-built binaries) looks for the headers.
#if defined(__has_include) && !defined(SMDDP_NO_LIBFABRIC) && !defined(SMDDP_HAVE_LIBFABRIC)
#if __has_include(<rdma/fabric.h>)
#define SMDDP_HAVE_LIBFABRIC 1
#endif
#endif

#ifdef SMDDP_HAVE_LIBFABRIC
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#endif

namespace smddp {

// Why libfabric cannot be used when the build lacked its headers.
extern const char kFabricNoHeaders[];

#ifdef SMDDP_HAVE_LIBFABRIC

struct FabricApi {
  decltype(&::fi_getinfo) getinfo = nullptr;
  decltype(&::fi_freeinfo) freeinfo = nullptr;
  decltype(&::fi_dupinfo) dupinfo = nullptr;
  decltype(&::fi_fabric) fabric = nullptr;
  decltype(&::fi_strerror) strerror = nullptr;
  decltype(&::fi_version) version = nullptr;
  std::string error;  // empty when loaded
  std::string path;   // the file loaded
  // The kFabricEnvDefaults this process's environment left unset, which
  // GetFabricApi set before loading libfabric.
  std::vector<std::string> env_set;

  // `ret`: a negative libfabric return code.
  std::string Err(int ret) const;
  // The API version to ask for: the older of the library's and the headers'.
  uint32_t RequestedVersion() const;
};

// Loaded once per process and never unloaded (providers may keep threads).
// Before it loads, every variable of kFabricEnvDefaults that the environment
// leaves unset is set to jax_smddp's value.
const FabricApi& GetFabricApi();

// libfabric's own variables that jax_smddp gives a value of its own when the
// environment leaves them unset (a value the user sets wins).
struct FabricEnvDefault {
  const char* name;
  const char* value;
};
extern const FabricEnvDefault kFabricEnvDefaults[];
extern const int kFabricEnvDefaultCount;

// fi_getinfo for a reliable-datagram endpoint of `provider` with `caps` and
// `mr_mode`, bound to `node` ("" = anywhere; for shm, a name unique to this
// call instead). Asks for manual progress first and falls back to what the
// provider offers. Returns
// libfabric's code (-FI_ENODATA: the provider cannot do it here).
int GetRdmInfo(const FabricApi& a, const std::string& provider, const std::string& node,
               uint64_t caps, uint64_t mr_mode, struct fi_info** out);
// The memory-registration modes the endpoints accept (a provider may require
// any of them; FI_MR_LOCAL: efa's registration of local buffers).
constexpr uint64_t kRdmMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;

// The objects of one reliable-datagram endpoint.
struct RdmObjects {
  struct fid_fabric* fabric = nullptr;
  struct fid_domain* domain = nullptr;
  struct fid_av* av = nullptr;
  struct fid_cq* cq = nullptr;
  struct fid_ep* ep = nullptr;
  std::string address;  // the endpoint's, to publish to peers
  // The wait set the completion queue signals (FI_WAIT_SET of FI_WAIT_FD),
  // where the provider offers one, and its descriptor; else the queue's own
  // wait descriptor (FI_WAIT_FD); -1 where there is none (not asked for, or
  // the provider offers no such queue).
  struct fid_wait* wait = nullptr;
  int wait_fd = -1;
};

// Opens, from `info`, the fabric, the domain, an address vector, a completion
// queue of `cq_format` with `cq_size` entries (bound to the endpoint for both
// directions) and the endpoint (enabled), and reads the endpoint's address.
// With `wait_fd`, the queue is asked for a wait descriptor (out->wait_fd) and
// opened without one where the provider refuses.
// Errors name the call that failed and `what` (the provider, say). What was
// opened before an error stays in `*out`, for CloseRdmObjects.
Status OpenRdmObjects(const FabricApi& a, struct fi_info* info, const std::string& what,
                      int cq_format, size_t cq_size, RdmObjects* out, bool wait_fd = false);
// Sleeping on the completion queue of `o` (o.wait_fd >= 0), in two steps:
// MaySleep under whatever serializes the calls on the endpoint's domain
// (FI_THREAD_DOMAIN), false when there is something to read now; then,
// without that lock, SleepOnCompletions until the queue may have something
// or `max_us` passed. With a wait set, MaySleep is fi_wait with no time
// left: it clears the set's signal and checks what it watches. fi_trywait
// alone is not enough there: the net provider's returns success without
// clearing the signal, which then stays up after the first completion and
// turns every sleep into a poll. `kick_fd` (an eventfd in semaphore mode, or
// -1) wakes the sleeper too, and one count of it is taken: another thread
// that progressed the endpoint and read what the descriptor announced kicks
// it, or the sleeper would sleep `max_us` past its own completion.
bool MaySleep(const RdmObjects& o);
void SleepOnCompletions(const RdmObjects& o, int kick_fd, unsigned max_us);
// Closes what is open, the endpoint first (which retires its operations).
// Registrations of the domain must be closed after the endpoint and before
// this, or closed by a caller that closed the endpoint itself.
void CloseRdmObjects(RdmObjects* o);

#endif  // SMDDP_HAVE_LIBFABRIC

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_API_H_
