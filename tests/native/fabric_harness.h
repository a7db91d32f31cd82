// The two processes of fabric_link_test.cc: a pipe each way between them (Barrier, and
// bytes to hand over), the log, and waiting on a link's requests with a deadline instead of
// hanging. No jax; inline, one translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_HARNESS_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_HARNESS_H_

#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/native/check.h"
#include "xla_ffi/transports/link.h"

namespace fabric_harness {

using smddp::Link;
using smddp::Request;
using Clock = std::chrono::steady_clock;

inline int g_rd = -1, g_wr = -1;  // pipe ends to the other process

inline void Log(const char* fmt, ...) {
  std::printf("[%s] ", smddp_test::Who().c_str());
  va_list ap;
  va_start(ap, fmt);
  std::vprintf(fmt, ap);
  va_end(ap);
  std::printf("\n");
  std::fflush(stdout);
}

inline void WriteAll(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(g_wr, c, n);
    CHECK(w > 0, "pipe write failed");
    c += w;
    n -= static_cast<size_t>(w);
  }
}

inline void ReadAll(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    struct pollfd pfd = {g_rd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 120000) == 1, "the other process did not answer within 120 s");
    ssize_t r = read(g_rd, c, n);
    CHECK(r > 0, "the other process exited (see its messages above)");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

inline void Barrier() {
  char b = 'b';
  WriteAll(&b, 1);
  ReadAll(&b, 1);
  CHECK(b == 'b', "barrier out of step");
}

// Drives progress until every request is done; fails the test on the
// peer's failure or at the deadline instead of hanging.
inline void Wait(Link* link, const std::vector<Request*>& reqs, double seconds, const char* what) {
  auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  for (unsigned spins = 0;; ++spins) {
    bool all = true;
    for (Request* r : reqs) all = all && r->done();
    if (all) return;
    link->Progress();
    if ((spins & 63) == 0) {
      std::string f = link->PeerFailure();
      CHECK(f.empty(), "%s: peer failure: %s", what, f.c_str());
      CHECK(Clock::now() < deadline, "%s: not done after %.0f s", what, seconds);
    }
  }
}

inline void ProgressFor(Link* link, double seconds) {
  auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) link->Progress();
}

// Progresses until `r` is done or `seconds` passed; whether it is done.
inline bool ProgressUntil(Link* link, const Request& r, double seconds) {
  auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (!r.done() && Clock::now() < until) link->Progress();
  return r.done();
}

inline void CheckOk(const Request& r, const char* what) {
  CHECK(r.done(), "%s: not done", what);
  CHECK(r.status().ok(), "%s: %s", what, r.status().message().c_str());
}

// Sends this process's address (or any string) and returns the other's.
inline std::string SwapStrings(const std::string& mine) {
  uint32_t n = static_cast<uint32_t>(mine.size());
  WriteAll(&n, 4);
  WriteAll(mine.data(), n);
  ReadAll(&n, 4);
  CHECK(n > 0 && n < 4096, "bad address length %u", n);
  std::string theirs(n, '\0');
  ReadAll(&theirs[0], n);
  return theirs;
}

}  // namespace fabric_harness

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_HARNESS_H_
