// What the shared-memory link's native tests share (shm_link_test.cc,
// shm_corruption_test.cc): failures (Die, CHECK_OK on tests/native/check.h),
// the data pattern every transfer is checked against (Fill, Verify), the
// one-byte pipes that keep two processes in step (Put, Get, Expect, Barrier),
// waits with deadlines on a link's requests, and messages (Msg). No jax. One
// translation unit per program: everything here is inline.
#ifndef JAX_SMDDP_TESTS_NATIVE_SHM_HARNESS_H_
#define JAX_SMDDP_TESTS_NATIVE_SHM_HARNESS_H_

#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/native/check.h"
#include "xla_ffi/transports/shm_link.h"

namespace shm_test {

using smddp::Link;
using smddp::Request;
using smddp::ShmSegment;
using smddp::Status;
using Clock = std::chrono::steady_clock;

// A failure in either process: the shared check (tests/native/check.h).
[[noreturn]] inline void Die(const char* file, int line, const std::string& msg) {
  smddp_test::Fail(file, line, msg);
}

#define CHECK_OK(expr)                                                                         \
  do {                                                                                         \
    Status _s = (expr);                                                                        \
    if (!_s.ok()) shm_test::Die(__FILE__, __LINE__, #expr + std::string(": ") + _s.message()); \
  } while (0)

inline const size_t kMiB = size_t(1) << 20;

// Whether large messages are read in place (JAX_SMDDP_SHM_SINGLE_COPY_BYTES;
// the script runs with it on and off).
inline bool SingleCopy() {
  return smddp::SingleCopyMinBytes() > 0 && smddp::SingleCopyMinBytes() <= kMiB;
}

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// ---- data patterns: each 8-byte word depends on tag, direction, offset ----

inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

inline uint64_t Seed(uint64_t tag, int dir) {
  return Mix64(tag * 0x9e3779b97f4a7c15ull + uint64_t(dir) + 1);
}

inline void Fill(uint8_t* p, size_t n, uint64_t tag, int dir) {
  const uint64_t seed = Seed(tag, dir);
  size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    uint64_t w = Mix64(seed ^ k);
    std::memcpy(p + 8 * k, &w, 8);
  }
  if (n % 8) {
    uint64_t w = Mix64(seed ^ words);
    std::memcpy(p + 8 * words, &w, n % 8);
  }
}

// First wrong offset, or -1.
inline long long Verify(const uint8_t* p, size_t n, uint64_t tag, int dir) {
  const uint64_t seed = Seed(tag, dir);
  size_t words = n / 8;
  for (size_t k = 0; k < words; ++k) {
    uint64_t w = Mix64(seed ^ k);
    if (std::memcmp(p + 8 * k, &w, 8) != 0) {
      for (size_t b = 0; b < 8; ++b) {
        if (p[8 * k + b] != reinterpret_cast<const uint8_t*>(&w)[b]) return (long long)(8 * k + b);
      }
    }
  }
  if (n % 8) {
    uint64_t w = Mix64(seed ^ words);
    for (size_t b = 0; b < n % 8; ++b) {
      if (p[8 * words + b] != reinterpret_cast<const uint8_t*>(&w)[b])
        return (long long)(8 * words + b);
    }
  }
  return -1;
}

// ---- pipes between the two processes ----

inline int g_in = -1, g_out = -1;  // read from / write to the other process

inline void Put(char c) {
  ssize_t n;
  do {
    n = ::write(g_out, &c, 1);
  } while (n < 0 && errno == EINTR);
  CHECK_MSG(n == 1, "pipe write failed");
}

// Whether a byte is ready within `ms` (0: just look).
inline bool Ready(int ms) {
  pollfd p{g_in, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, ms);
  } while (r < 0 && errno == EINTR);
  return r > 0;
}

inline char Get(const char* what, int ms = 60000) {
  if (!Ready(ms))
    Die(__FILE__, __LINE__, std::string("timed out waiting for the other process: ") + what);
  char c;
  ssize_t n;
  do {
    n = ::read(g_in, &c, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) Die(__FILE__, __LINE__, std::string("the other process went away: ") + what);
  return c;
}

inline void Expect(char want, const char* what) {
  char c = Get(what);
  CHECK_MSG(c == want, std::string(what) + ": got '" + c + "', expected '" + want + "'");
}

inline void Barrier(const char* what) {
  Put('b');
  Expect('b', what);
}

// ---- waiting on requests ----

inline void Wait(Link* link, const std::vector<Request*>& reqs, const char* what,
                 double seconds = 60) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    bool all = true;
    for (Request* r : reqs) all = all && r->done();
    if (all) return;
    link->Progress();
    std::string f = link->PeerFailure();
    if (!f.empty()) Die(__FILE__, __LINE__, std::string(what) + ": peer failure: " + f);
    if (Clock::now() > deadline) Die(__FILE__, __LINE__, std::string("timed out: ") + what);
    sched_yield();
  }
}

inline void Wait1(Link* link, Request* r, const char* what, double seconds = 60) {
  Wait(link, {r}, what, seconds);
}

// Drives the link for `ms` milliseconds.
inline void Spin(Link* link, int ms) {
  const auto end = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < end) {
    link->Progress();
    sched_yield();
  }
}

struct Msg {
  uint64_t tag;
  size_t n;
  std::vector<uint8_t> buf;
  Request req;
  Msg(uint64_t t, size_t size) : tag(t), n(size), buf(size) {}
};
using Msgs = std::vector<std::unique_ptr<Msg>>;

inline std::vector<Request*> Reqs(const Msgs& ms) {
  std::vector<Request*> r;
  for (auto& m : ms) r.push_back(&m->req);
  return r;
}

inline void PostSend(Link* l, Msg* m, int dir) {
  Fill(m->buf.data(), m->n, m->tag, dir);
  l->Send(m->tag, m->buf.data(), m->n, &m->req);
}

inline void CheckRecv(Msg* m, int dir, const char* what) {
  CHECK_MSG(m->req.done(), what);
  CHECK_MSG(m->req.status().ok(), std::string(what) + " tag " + std::to_string(m->tag) + ": " +
                                      m->req.status().message());
  long long bad = Verify(m->buf.data(), m->n, m->tag, dir);
  CHECK_MSG(bad < 0, std::string(what) + ": tag " + std::to_string(m->tag) + " (" +
                         std::to_string(m->n) + " bytes) wrong at offset " + std::to_string(bad));
}

inline void CheckSent(Msg* m, const char* what) {
  CHECK_MSG(m->req.done() && m->req.status().ok(),
            std::string(what) + " send tag " + std::to_string(m->tag) + ": " +
                (m->req.done() ? m->req.status().message() : std::string("not done")));
}

inline bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

inline bool ShmExists(const std::string& name) {
  struct stat st;
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

inline const std::vector<size_t> kSizes = {0, 1, 7, 4096, kMiB + 3, 64 * kMiB};

}  // namespace shm_test

#endif  // JAX_SMDDP_TESTS_NATIVE_SHM_HARNESS_H_
