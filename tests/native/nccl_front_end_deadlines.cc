// The NCCL API front end's deadline scenarios of nccl_front_end_test (see
// nccl_front_end_test.cc for the program and its other scenarios): a process
// that never makes the call (stalled), a forwarded call that rank 0 never
// makes (partial_forward), a communicator whose ranks never all join
// (join_timeout). Each names what it waited for.
#include <chrono>
#include <string>
#include <vector>

#include "tests/native/nccl_harness.h"

using namespace nccl_test;  // NOLINT: the harness is this test's vocabulary

void Stalled() {
  ncclComm_t comm = Create(P, me, nullptr);
  if (me == 1) {
    Relay("waiting");  // until process 0 is done
    return;
  }
  std::vector<float> x(128, 1.f), g(128 * P);
  const auto start = std::chrono::steady_clock::now();
  // With host step flags (the front end's default) the watchdog releases the
  // waiting call at the deadline (its output undefined), as it would a GPU
  // stream; XLA learns of it from the async error, which names the peer.
  const ncclResult_t rc = ncclAllGather(x.data(), g.data(), 128, ncclFloat32, comm, nullptr);
  Expect(rc == ncclSuccess || rc == ncclRemoteError,
         "released or failed: " + std::to_string(int(rc)));
  double s = 0;
  const ncclResult_t async = AwaitAsyncError(comm, start, 10, &s);
  const std::string why = ncclGetLastError(comm);
  Expect(async == ncclRemoteError && Has(why, "process 1") && Has(why, "within 2 s"),
         "the deadline is the async error, naming the stalled process: " + why);
  Expect(s < 6, "within the deadline: " + std::to_string(s));
  Relay("done");
}

// A forwarded call that rank 0 never makes: the real communicator cannot be
// created (NCCL's creation needs every rank), and the rank waiting for the
// real id from rank 0's process fails at the deadline naming that process and
// the call that needed it, instead of waiting forever.
void PartialForward() {
  ncclComm_t comm = Create(P, me, nullptr);
  if (me == 0) {
    Relay("waiting");  // until process 1 is done
    return;
  }
  std::vector<float> x(8), y(8);
  const auto start = std::chrono::steady_clock::now();
  const ncclResult_t rc = ncclBroadcast(x.data(), y.data(), 8, ncclFloat32, 0, comm, nullptr);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string why = ncclGetLastError(comm);
  Expect(rc != ncclSuccess && Has(why, "process 0") && Has(why, "real NCCL id") &&
             Has(why, "ncclBroadcast") && Has(why, "first forwarded call"),
         "fails naming process 0, the call and the remedy: " + why);
  Expect(s < 6, "at the deadline (2 s): " + std::to_string(s));
  Expect(!Has(Record(), "ncclCommInitRankConfig"), "no real communicator: " + Record());
  Relay("done");
}

void JoinTimeout() {
  ncclResult_t rc = ncclSuccess;
  ncclComm_t comm = Create(3, me, nullptr, &rc);
  Expect(rc == ncclRemoteError && comm == nullptr, "creation fails at the deadline");
  const std::string why = ncclGetLastError(nullptr);
  Expect(Has(why, me == 0 ? "ranks 2 of 3 never joined" : "never joined"),
         "names the missing rank (the root) or the root's verdict: " + why);
}
