#include "xla_ffi/common/timeout.h"

#include <atomic>
#include <cstdint>
#include <sstream>

#include "xla_ffi/common/settings.h"

namespace smddp {

namespace {

constexpr int64_t kUnset = -1;
std::atomic<int64_t> g_timeout_ms{kUnset};

// Until set_timeout, the registry's default (JAX_SMDDP_TIMEOUT_S, declared in
// settings.cc): read on first use, not at static initialization, which may
// run before the registry's own.
int64_t TimeoutMs() {
  int64_t ms = g_timeout_ms.load();
  if (ms != kUnset) return ms;
  const int64_t declared = int64_t(DeclaredDefault("JAX_SMDDP_TIMEOUT_S") * 1000.0);
  g_timeout_ms.compare_exchange_strong(ms, declared);
  return g_timeout_ms.load();
}

}  // namespace

void SetTimeoutSeconds(double seconds) { g_timeout_ms = int64_t(seconds * 1000.0); }
double TimeoutSeconds() { return double(TimeoutMs()) / 1000.0; }
std::chrono::milliseconds Timeout() { return std::chrono::milliseconds(TimeoutMs()); }

std::string Seconds(std::chrono::steady_clock::duration d) {
  std::ostringstream os;
  os.precision(3);
  os << std::chrono::duration<double>(d).count() << " s";
  return os.str();
}

}  // namespace smddp
