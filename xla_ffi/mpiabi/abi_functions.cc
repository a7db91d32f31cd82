// The MPI functions XLA's CPU collectives call (xla/backends/cpu/collectives/
// mpi_*.cc), on the ABI's types: arguments are checked and translated here;
// what they do is mpi_front_end.h's.
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "xla_ffi/common/heap_reuse.h"
#include "xla_ffi/mpiabi/abi.h"
#include "xla_ffi/mpiabi/mpi_front_end.h"
#include "xla_ffi/mpiabi/mpi_point_to_point.h"

namespace smddp {
namespace mpi {
namespace {

int Ok() { return int(MPIABI_SUCCESS); }

int Check(const Status& st) { return st.ok() ? Ok() : Fail(st); }

// An element type as the engine sees it: its size and, for reductions, the
// engine's type (complex numbers sum as pairs of reals).
struct Type {
  size_t size = 0;
  bool reducible = false;
  DType dtype = DType::kUInt8;
  int lanes = 1;
};

bool TypeOf(MPIABI_Datatype t, Type* out) {
  auto is = [t](uintptr_t h) { return t == h; };
  if (is(MPIABI_BYTE) || is(MPIABI_CHAR) || is(MPIABI_UNSIGNED_CHAR) || is(MPIABI_UINT8_T)) {
    *out = {1, true, DType::kUInt8, 1};
  } else if (is(MPIABI_SIGNED_CHAR) || is(MPIABI_INT8_T)) {
    *out = {1, true, DType::kInt8, 1};
  } else if (is(MPIABI_C_BOOL) || is(MPIABI_CXX_BOOL)) {
    *out = {1, true, DType::kBool, 1};
  } else if (is(MPIABI_INT16_T) || is(MPIABI_UINT16_T) || is(MPIABI_SHORT) ||
             is(MPIABI_UNSIGNED_SHORT)) {
    *out = {2, false, DType::kUInt8, 1};
  } else if (is(MPIABI_INT32_T) || is(MPIABI_INT)) {
    *out = {4, true, DType::kInt32, 1};
  } else if (is(MPIABI_UINT32_T) || is(MPIABI_UNSIGNED)) {
    *out = {4, true, DType::kUInt32, 1};
  } else if (is(MPIABI_INT64_T) || is(MPIABI_LONG) || is(MPIABI_LONG_LONG) ||
             is(MPIABI_LONG_LONG_INT)) {
    *out = {8, true, DType::kInt64, 1};
  } else if (is(MPIABI_UINT64_T) || is(MPIABI_UNSIGNED_LONG) || is(MPIABI_UNSIGNED_LONG_LONG)) {
    *out = {8, false, DType::kUInt8, 1};
  } else if (is(MPIABI_FLOAT)) {
    *out = {4, true, DType::kFloat32, 1};
  } else if (is(MPIABI_DOUBLE)) {
    *out = {8, true, DType::kFloat64, 1};
  } else if (is(MPIABI_C_COMPLEX) || is(MPIABI_C_FLOAT_COMPLEX)) {
    *out = {8, true, DType::kFloat32, 2};
  } else if (is(MPIABI_C_DOUBLE_COMPLEX)) {
    *out = {16, true, DType::kFloat64, 2};
  } else {
    return false;
  }
  return true;
}

int BadType(const char* fn) {
  return Fail(Status::Unsupported(std::string("jax_smddp ") + fn +
                                  ": an MPI datatype the front end does not move (XLA "
                                  "passes fixed-size integers, floats and complex numbers)"));
}

// The engine's reduction for `op` on `type`, or an MPI error.
int ReductionOf(const char* fn, MPIABI_Op op, const Type& type, ReduceOp* out) {
  const char* name = nullptr;
  if (op == MPIABI_SUM) {
    *out = ReduceOp::kSum;
  } else if (op == MPIABI_MAX && type.lanes == 1) {
    *out = ReduceOp::kMax;
  } else if (op == MPIABI_MIN && type.lanes == 1) {
    *out = ReduceOp::kMin;
  } else {
    name = op == MPIABI_PROD ? "MPI_PROD (a product all-reduce)" : "this reduction";
  }
  if (!name && !type.reducible) name = "16-bit or unsigned 64-bit integers";
  if (!name) return Ok();
  return Fail(Status::Unsupported(std::string("jax_smddp ") + fn + ": the engine does not reduce " +
                                  name +
                                  "; unset JAX_SMDDP_COLLECTIVES=xla to run this "
                                  "program's collectives on gloo"));
}

int RankOf(MPIABI_Comm comm, const char* fn, Rank** out) {
  if (comm == MPIABI_COMM_NULL || comm == MPIABI_COMM_WORLD || comm == MPIABI_COMM_SELF) {
    return Fail(Status::InvalidArgument(
        std::string("jax_smddp ") + fn +
        (comm == MPIABI_COMM_NULL
             ? ": MPI_COMM_NULL (the communicator's MPI_Comm_split failed earlier: see "
               "the error it logged)"
             : ": collectives run on the communicators MPI_Comm_split makes, not on "
               "MPI_COMM_WORLD or MPI_COMM_SELF")));
  }
  *out = reinterpret_cast<Rank*>(comm);
  return Ok();
}

bool Overlap(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

}  // namespace
}  // namespace mpi
}  // namespace smddp

using namespace smddp;
using namespace smddp::mpi;

extern "C" {

SMDDP_MPI_EXPORT int MPIABI_Init(int*, char***) {
  ApplyHeapReuse();  // XLA's collectives on this library: its outputs are reused too
  SetInitialized(true);
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Init_thread(int*, char***, int, int* provided) {
  ApplyHeapReuse();  // XLA's collectives on this library: its outputs are reused too
  SetInitialized(true);
  if (provided) *provided = int(MPIABI_THREAD_MULTIPLE);  // any thread may call
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Initialized(int* flag) {
  *flag = Initialized();
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Finalize() {
  SetInitialized(false);
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Finalized(int* flag) {
  *flag = Finalized();
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Query_thread(int* provided) {
  *provided = int(MPIABI_THREAD_MULTIPLE);
  return Ok();
}

// XLA refuses communicators requested from other threads than MPI_Init's:
// this library serves every thread.
SMDDP_MPI_EXPORT int MPIABI_Is_thread_main(int* flag) {
  *flag = 1;
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Get_version(int* version, int* subversion) {
  *version = 3;
  *subversion = 1;
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Get_library_version(char* version, int* length) {
  const int n = snprintf(version, 8192,
                         "jax_smddp MPI front end (XLA's CPU collectives on the jax_smddp engine)");
  *length = n;
  return Ok();
}

SMDDP_MPI_EXPORT double MPIABI_Wtime() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

SMDDP_MPI_EXPORT double MPIABI_Wtick() { return 1e-9; }

SMDDP_MPI_EXPORT int MPIABI_Abort(MPIABI_Comm, int code) {
  fprintf(stderr, "jax_smddp MPI front end: MPI_Abort(%d)\n", code);
  fflush(stderr);
  _exit(code);
}

SMDDP_MPI_EXPORT int MPIABI_Error_string(int code, char* out, int* length) {
  std::string s = ErrorString(code);
  // MPI_MAX_ERROR_STRING of the ABI is 1024.
  if (s.size() > 1023) s.resize(1023);
  memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  *length = int(s.size());
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Error_class(int code, int* error_class) {
  *error_class = code;
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Comm_rank(MPIABI_Comm comm, int* rank) {
  if (comm == MPIABI_COMM_WORLD) {
    *rank = WorldRank();
    return Ok();
  }
  Rank* r;
  if (int e = RankOf(comm, "MPI_Comm_rank", &r)) return e;
  *rank = r->rank;
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Comm_size(MPIABI_Comm comm, int* size) {
  if (comm == MPIABI_COMM_WORLD) {
    *size = WorldSize();
    return Ok();
  }
  Rank* r;
  if (int e = RankOf(comm, "MPI_Comm_size", &r)) return e;
  *size = Size(*r);
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Comm_split(MPIABI_Comm comm, int color, int key, MPIABI_Comm* out) {
  *out = MPIABI_COMM_NULL;
  if (comm != MPIABI_COMM_WORLD)
    return Fail(Status::InvalidArgument("jax_smddp MPI_Comm_split: only MPI_COMM_WORLD is split"));
  Rank* r = nullptr;
  Status st = Split(color, key, &r);
  if (!st.ok()) {
    // XLA does not check this call's result: say why here, once per failure.
    fprintf(stderr, "%s\n", st.message().c_str());
    return Fail(st);
  }
  *out = reinterpret_cast<MPIABI_Comm>(r);
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Comm_free(MPIABI_Comm* comm) {
  if (*comm != MPIABI_COMM_NULL && *comm != MPIABI_COMM_WORLD && *comm != MPIABI_COMM_SELF)
    delete reinterpret_cast<Rank*>(*comm);
  *comm = MPIABI_COMM_NULL;
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Allgather(const void* send, int send_count, MPIABI_Datatype send_type,
                                      void* recv, int recv_count, MPIABI_Datatype recv_type,
                                      MPIABI_Comm comm) {
  Rank* r;
  if (int e = RankOf(comm, "MPI_Allgather", &r)) return e;
  Type st, rt;
  if (!TypeOf(recv_type, &rt)) return BadType("MPI_Allgather");
  const size_t block = size_t(recv_count) * rt.size;
  const int n = Size(*r);
  std::vector<char> copy;
  if (send == MPIABI_IN_PLACE) {
    const char* mine = static_cast<const char*>(recv) + size_t(r->rank) * block;
    copy.assign(mine, mine + block);
    send = copy.data();
  } else {
    if (!TypeOf(send_type, &st)) return BadType("MPI_Allgather");
    if (size_t(send_count) * st.size != block)
      return Fail(Status::InvalidArgument(
          "jax_smddp MPI_Allgather: the send and receive blocks differ in size"));
    if (Overlap(send, block, recv, block * n)) {
      copy.assign(static_cast<const char*>(send), static_cast<const char*>(send) + block);
      send = copy.data();
    }
  }
  Plan plan;
  plan.kind = Collective::kAllGather;
  plan.dtype = DType::kUInt8;
  plan.outer = 1;
  plan.inner = block;
  return Check(RunCollective(*r, "MPI_Allgather", World::Caller::kMpiAllgather, plan, send, recv));
}

SMDDP_MPI_EXPORT int MPIABI_Allreduce(const void* send, void* recv, int count, MPIABI_Datatype type,
                                      MPIABI_Op op, MPIABI_Comm comm) {
  Rank* r;
  if (int e = RankOf(comm, "MPI_Allreduce", &r)) return e;
  Type t;
  if (!TypeOf(type, &t)) return BadType("MPI_Allreduce");
  ReduceOp reduce;
  if (int e = ReductionOf("MPI_Allreduce", op, t, &reduce)) return e;
  const size_t bytes = size_t(count) * t.size;
  std::vector<char> copy;
  if (send == MPIABI_IN_PLACE || Overlap(send, bytes, recv, bytes)) {
    const char* from = static_cast<const char*>(send == MPIABI_IN_PLACE ? recv : send);
    copy.assign(from, from + bytes);
    send = copy.data();
  }
  Plan plan;
  plan.kind = Collective::kAllReduce;
  plan.dtype = t.dtype;
  plan.op = reduce;
  plan.count = size_t(count) * t.lanes;  // count * t.size bytes (a reducible type's lanes)
  return Check(RunCollective(*r, "MPI_Allreduce", World::Caller::kMpiAllreduce, plan, send, recv));
}

static int ReduceScatter(const char* fn, const void* send, void* recv, int count,
                         MPIABI_Datatype type, MPIABI_Op op, MPIABI_Comm comm) {
  Rank* r;
  if (int e = RankOf(comm, fn, &r)) return e;
  Type t;
  if (!TypeOf(type, &t)) return BadType(fn);
  ReduceOp reduce;
  if (int e = ReductionOf(fn, op, t, &reduce)) return e;
  const int n = Size(*r);
  const size_t block = size_t(count) * t.size;
  std::vector<char> copy;
  if (send == MPIABI_IN_PLACE || Overlap(send, block * n, recv, block)) {
    const char* from = static_cast<const char*>(send == MPIABI_IN_PLACE ? recv : send);
    copy.assign(from, from + block * n);
    send = copy.data();
  }
  Plan plan;
  plan.kind = Collective::kReduceScatter;
  plan.dtype = t.dtype;
  plan.op = reduce;
  plan.outer = 1;
  plan.inner = size_t(count) * t.lanes;
  return Check(RunCollective(*r, fn, World::Caller::kMpiReduceScatter, plan, send, recv));
}

SMDDP_MPI_EXPORT int MPIABI_Reduce_scatter(const void* send, void* recv, const int* counts,
                                           MPIABI_Datatype type, MPIABI_Op op, MPIABI_Comm comm) {
  Rank* r;
  if (int e = RankOf(comm, "MPI_Reduce_scatter", &r)) return e;
  const int n = Size(*r);
  for (int i = 1; i < n; ++i) {
    if (counts[i] != counts[0])
      return Fail(Status::InvalidArgument(
          "jax_smddp MPI_Reduce_scatter: blocks of different sizes (XLA's are equal)"));
  }
  return ReduceScatter("MPI_Reduce_scatter", send, recv, counts[0], type, op, comm);
}

SMDDP_MPI_EXPORT int MPIABI_Reduce_scatter_block(const void* send, void* recv, int count,
                                                 MPIABI_Datatype type, MPIABI_Op op,
                                                 MPIABI_Comm comm) {
  return ReduceScatter("MPI_Reduce_scatter_block", send, recv, count, type, op, comm);
}

static int Bytes(const char* fn, int count, MPIABI_Datatype type, size_t* bytes) {
  Type t;
  if (!TypeOf(type, &t)) return BadType(fn);
  *bytes = size_t(count) * t.size;
  return Ok();
}

static void FillStatus(MPIABI_Status* status, int source, int tag) {
  if (status == nullptr || static_cast<void*>(status) == MPIABI_STATUS_IGNORE) return;
  status->MPI_SOURCE = source;
  status->MPI_TAG = tag;
  status->MPI_ERROR = Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Isend(const void* buf, int count, MPIABI_Datatype type, int dest,
                                  int tag, MPIABI_Comm comm, MPIABI_Request* request) {
  *request = MPIABI_REQUEST_NULL;
  Rank* r;
  if (int e = RankOf(comm, "MPI_Isend", &r)) return e;
  size_t bytes = 0;
  if (int e = Bytes("MPI_Isend", count, type, &bytes)) return e;
  Transfer* t = nullptr;
  if (int e = Check(PostSend(*r, dest, tag, buf, bytes, &t))) return e;
  *request = reinterpret_cast<MPIABI_Request>(t);
  return Ok();
}

// MPI_Irecv, counted in the world's calls as `caller` once posted: XLA's CPU
// collective-permute posts MPI_Irecv itself, its all-to-all goes through
// MPI_Sendrecv (xla/backends/cpu/collectives/mpi_communicator.cc), so the
// counts tell the two apart.
static int Irecv(void* buf, int count, MPIABI_Datatype type, int source, int tag, MPIABI_Comm comm,
                 MPIABI_Request* request, World::Caller caller) {
  *request = MPIABI_REQUEST_NULL;
  Rank* r;
  if (int e = RankOf(comm, "MPI_Irecv", &r)) return e;
  size_t bytes = 0;
  if (int e = Bytes("MPI_Irecv", count, type, &bytes)) return e;
  Transfer* t = nullptr;
  if (int e = Check(PostRecv(*r, source, tag, buf, bytes, &t))) return e;
  *request = reinterpret_cast<MPIABI_Request>(t);
  CountCall(*r, caller, bytes);
  return Ok();
}

SMDDP_MPI_EXPORT int MPIABI_Irecv(void* buf, int count, MPIABI_Datatype type, int source, int tag,
                                  MPIABI_Comm comm, MPIABI_Request* request) {
  return Irecv(buf, count, type, source, tag, comm, request, World::Caller::kMpiIrecv);
}

SMDDP_MPI_EXPORT int MPIABI_Wait(MPIABI_Request* request, MPIABI_Status* status) {
  if (*request == MPIABI_REQUEST_NULL) return Ok();
  Transfer* t = reinterpret_cast<Transfer*>(*request);
  *request = MPIABI_REQUEST_NULL;
  FillStatus(status, 0, 0);
  return Check(Complete(t));
}

SMDDP_MPI_EXPORT int MPIABI_Waitall(int count, MPIABI_Request* requests, MPIABI_Status* statuses) {
  int first_error = Ok();
  for (int i = 0; i < count; ++i) {
    const int e =
        MPIABI_Wait(&requests[i], static_cast<void*>(statuses) == MPIABI_STATUSES_IGNORE ? nullptr
                                  : statuses ? &statuses[i]
                                             : nullptr);
    if (e && !first_error) first_error = e;
  }
  return first_error;
}

SMDDP_MPI_EXPORT int MPIABI_Sendrecv(const void* send, int send_count, MPIABI_Datatype send_type,
                                     int dest, int send_tag, void* recv, int recv_count,
                                     MPIABI_Datatype recv_type, int source, int recv_tag,
                                     MPIABI_Comm comm, MPIABI_Status* status) {
  MPIABI_Request rr, sr;
  if (int e = Irecv(recv, recv_count, recv_type, source, recv_tag, comm, &rr,
                    World::Caller::kMpiSendrecv))
    return e;
  if (int e = MPIABI_Isend(send, send_count, send_type, dest, send_tag, comm, &sr)) {
    MPIABI_Wait(&rr, nullptr);
    return e;
  }
  const int e1 = MPIABI_Wait(&rr, nullptr);
  const int e2 = MPIABI_Wait(&sr, nullptr);
  FillStatus(status, source, recv_tag);
  return e1 ? e1 : e2;
}

}  // extern "C"
