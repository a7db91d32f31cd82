// The NCCL API front end's communicators, their real side: the real
// library's id, agreed at a communicator's first forwarded call, the real
// communicator made from it, and its destruction (nccl_comm.h declares them;
// nccl_comm.cc sets the front end's communicators up).
#include <cstring>
#include <set>

#include "cuda/ncclapi/nccl_comm.h"
#include "cuda/ncclapi/nccl_joining.h"
#include "cuda/ncclapi/real_nccl.h"
#include "xla_ffi/common/timeout.h"

namespace smddp {
namespace nccl {

namespace {

// A communicator's real id, agreed at its first forwarded call rather than at
// creation: the real ncclGetUniqueId starts NCCL's bootstrap root (a thread
// and a socket waiting for the real communicator's ranks), which for a
// communicator whose calls are all served would wait forever. One thread of
// each process does this: it makes the id (in the process of the
// communicator's rank 0) and sends it to every other member process, or
// receives it from there.
Status MakeOrReceiveRealId(const Comm& comm, RealId* out) {
  auto world = comm.world.lock();
  const int root = comm.process_of.empty() ? -1 : comm.process_of[0];
  const auto deadline = Clock::now() + Timeout();
  auto no_link = [](int q) {
    return Status::Error("jax_smddp NCCL front end: no link to process " + std::to_string(q) +
                         " for the real NCCL id");
  };
  if (!world || root < 0 || root == world->process()) {
    out->has = NewRealId(out->id);
    for (int q : std::set<int>(comm.process_of.begin(), comm.process_of.end())) {
      if (!world || q < 0 || q == world->process()) continue;
      if (!world->link(q)) return no_link(q);
      Request req;
      world->link(q)->Send(Tag(comm.nonce, kRealId, uint64_t(q), 0), out, sizeof(*out), &req);
      SMDDP_RETURN_IF_ERROR(Await(*world, q, req, "sending the real NCCL id", deadline));
    }
    return Status::Ok();
  }
  if (!world->link(root)) return no_link(root);
  Request req;
  world->link(root)->Recv(Tag(comm.nonce, kRealId, uint64_t(world->process()), 0), out,
                          sizeof(*out), &req);
  return Await(*world, root, req,
               "receiving the real NCCL id from the process of rank 0 (every rank of a "
               "communicator must reach its first forwarded call: NCCL creates the real "
               "communicator only with all of them)",
               deadline);
}

// Sets comm.real_id (when the real library made one that fits); every rank
// of the communicator calls it at the same forwarded call.
Status AgreeRealId(Comm& comm) {
  const std::shared_ptr<Joining> j = JoiningOf(comm.nonce);  // this process's part of it
  std::unique_lock<std::mutex> lock(j->mu);
  if (!j->real_id_agreed && !j->agreeing_real_id) {
    j->agreeing_real_id = true;
    lock.unlock();
    RealId got;
    const Status st = MakeOrReceiveRealId(comm, &got);
    lock.lock();
    j->real_id_status = st;
    j->real_id = got;
    j->real_id_agreed = true;
    j->cv.notify_all();
  }
  j->cv.wait(lock, [&] { return j->real_id_agreed; });
  SMDDP_RETURN_IF_ERROR(j->real_id_status);
  if (j->real_id.has) {
    std::memset(comm.real_id.internal, 0, sizeof(comm.real_id.internal));
    std::memcpy(comm.real_id.internal, j->real_id.id, kRealIdBytes);
    comm.have_real_id = true;
  }
  return Status::Ok();
}

}  // namespace

Status RealComm(Comm& comm, ncclComm_t* out) {
  std::lock_guard<std::mutex> lock(comm.real_mu);
  if (comm.real) {
    *out = comm.real;
    return Status::Ok();
  }
  if (!comm.real_failure.ok()) return comm.real_failure;
  if (!comm.have_real_id && comm.real_id_later) {
    const Status st = AgreeRealId(comm);
    if (!st.ok()) {
      comm.real_failure = st;
      return st;
    }
  }
  if (!comm.have_real_id) {
    comm.real_failure = Status::Unsupported(
        "jax_smddp NCCL front end: no real NCCL communicator can be made for this communicator "
        "(the real library's id did not fit in the front end's, or the library was not found)");
    return comm.real_failure;
  }
  std::string why;
  using Fn = ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  auto fn = reinterpret_cast<Fn>(RealSymbol("ncclCommInitRankConfig", &why));
  if (!fn) {
    comm.real_failure = Status::Error("jax_smddp NCCL front end: " + why);
    return comm.real_failure;
  }
  // Created blocking: the forwarded call that needs it follows at once.
  std::vector<unsigned char> config = comm.config;
  if (!config.empty()) reinterpret_cast<ncclConfigHead*>(config.data())->blocking = 1;
  ncclComm_t real = nullptr;
  const ncclResult_t rc =
      fn(&real, comm.nranks, comm.real_id, comm.rank,
         config.empty() ? nullptr : reinterpret_cast<ncclConfig_t*>(config.data()));
  if (rc != ncclSuccess) {
    comm.real_failure = Status::Error(
        "jax_smddp NCCL front end: the real NCCL library could not "
        "create the communicator (ncclCommInitRankConfig returned " +
        std::to_string(int(rc)) + ")");
    return comm.real_failure;
  }
  comm.real = real;
  *out = real;
  return Status::Ok();
}

ncclResult_t DestroyReal(Comm& comm, const char* function) {
  std::lock_guard<std::mutex> lock(comm.real_mu);
  if (!comm.real) return ncclSuccess;
  std::string why;
  using Fn = ncclResult_t (*)(ncclComm_t);
  auto fn = reinterpret_cast<Fn>(RealSymbol(function, &why));
  if (!fn) return ncclInternalError;
  const ncclResult_t rc = fn(comm.real);
  if (std::strcmp(function, "ncclCommFinalize") != 0) comm.real = nullptr;
  return rc;
}

}  // namespace nccl
}  // namespace smddp
