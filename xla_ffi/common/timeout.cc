#include "xla_ffi/common/timeout.h"

#include <atomic>
#include <cstdint>

namespace smddp {

namespace {
std::atomic<int64_t> g_timeout_ms{300'000};
}  // namespace

void SetTimeoutSeconds(double seconds) { g_timeout_ms = int64_t(seconds * 1000.0); }
double TimeoutSeconds() { return double(g_timeout_ms.load()) / 1000.0; }
std::chrono::milliseconds Timeout() { return std::chrono::milliseconds(g_timeout_ms.load()); }

}  // namespace smddp
