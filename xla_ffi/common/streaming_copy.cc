#include "xla_ffi/common/streaming_copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla_ffi/common/settings.h"

namespace smddp {

namespace {

// Shorter copies are not worth the fence.
constexpr size_t kMinStreamBytes = 4096;

}  // namespace

bool StreamStores(uint64_t bytes) {
#if defined(__SSE2__)
  static const int64_t min_bytes = IntSetting("JAX_SMDDP_STREAMING_STORE_BYTES");
  return min_bytes > 0 && bytes >= uint64_t(min_bytes);
#else
  (void)bytes;
  return false;
#endif
}

void CopyBytes(void* dst, const void* src, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && bytes >= kMinStreamBytes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    // Plain stores up to the first 64-byte boundary of the destination.
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, bytes - i);
    _mm_sfence();
    return;
  }
#endif
  (void)stream;
  if (bytes) std::memcpy(dst, src, bytes);
}

}  // namespace smddp
