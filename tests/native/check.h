// The checks every native test uses. A failed check prints who failed (the
// test's process or rank), where and why, kills the peer process the test
// forked (if any) and exits 1; a test that ends prints "all checks passed".
//   CHECK(cond)                  the condition is the message
//   CHECK(cond, "fmt %d", x)     printf-style message
//   CHECK_MSG(cond, std_string)  a std::string message
#ifndef JAX_SMDDP_TESTS_NATIVE_CHECK_H_
#define JAX_SMDDP_TESTS_NATIVE_CHECK_H_

#include <signal.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <string>

namespace smddp_test {

// Who is running: "parent", "child", "rank 2", ... (set by each process).
inline std::string& Who() {
  static std::string who = "parent";
  return who;
}

// A process this one forked, killed when this one fails (0: none).
inline pid_t& Peer() {
  static pid_t peer = 0;
  return peer;
}

inline std::string Format(const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

[[noreturn]] inline void Fail(const char* file, int line, const std::string& why) {
  std::fflush(stdout);
  std::fprintf(stderr, "[%s] FAILED at %s:%d: %s\n", Who().c_str(), file, line, why.c_str());
  std::fflush(stderr);
  if (Peer() > 0) ::kill(Peer(), SIGKILL);
  ::_exit(1);
}

inline void Passed() {
  std::printf("all checks passed\n");
  std::fflush(stdout);
}

}  // namespace smddp_test

#define CHECK(cond, ...)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      const std::string _why = ::smddp_test::Format("" __VA_ARGS__);                    \
      ::smddp_test::Fail(__FILE__, __LINE__, _why.empty() ? std::string(#cond) : _why); \
    }                                                                                   \
  } while (0)
#define CHECK_MSG(cond, msg)                                               \
  do {                                                                     \
    if (!(cond)) ::smddp_test::Fail(__FILE__, __LINE__, std::string(msg)); \
  } while (0)

#endif  // JAX_SMDDP_TESTS_NATIVE_CHECK_H_
