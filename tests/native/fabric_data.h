// The data pattern fabric_link_test.cc checks every transfer against: bytes that depend on
// the tag, the offset and the sender (Fill, Verify), and AllBytes for buffers that must stay
// untouched. No jax; inline, one translation unit per program.
#ifndef JAX_SMDDP_TESTS_NATIVE_FABRIC_DATA_H_
#define JAX_SMDDP_TESTS_NATIVE_FABRIC_DATA_H_

#include <cstdint>
#include <cstring>
#include <vector>

namespace fabric_data {

// Bytes that depend on the tag, the offset and the sender, in 8-byte words.
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0x7fb5d329728ea185ull;
  x ^= x >> 27;
  x *= 0x81dadef4bc2dd44dull;
  x ^= x >> 33;
  return x;
}
inline uint64_t Word(uint64_t tag, int from, uint64_t w) {
  return Mix(w * 0x9e3779b97f4a7c15ull + (tag << 20) + static_cast<uint64_t>(from) * 0x51ed27);
}
inline void Fill(std::vector<char>& buf, uint64_t tag, int from) {
  size_t n = buf.size(), w = 0;
  for (; (w + 1) * 8 <= n; ++w) {
    uint64_t v = Word(tag, from, w);
    std::memcpy(buf.data() + w * 8, &v, 8);
  }
  uint64_t v = Word(tag, from, w);
  if (n > w * 8) std::memcpy(buf.data() + w * 8, &v, n - w * 8);
}
// Offset of the first wrong byte, or -1.
inline long long Verify(const std::vector<char>& buf, uint64_t tag, int from) {
  size_t n = buf.size(), w = 0;
  for (; (w + 1) * 8 <= n; ++w) {
    uint64_t v = Word(tag, from, w);
    if (std::memcmp(buf.data() + w * 8, &v, 8) != 0) {
      for (size_t i = 0; i < 8; ++i) {
        if (buf[w * 8 + i] != reinterpret_cast<const char*>(&v)[i]) {
          return static_cast<long long>(w * 8 + i);
        }
      }
    }
  }
  uint64_t v = Word(tag, from, w);
  for (size_t i = 0; w * 8 + i < n; ++i) {
    if (buf[w * 8 + i] != reinterpret_cast<const char*>(&v)[i]) {
      return static_cast<long long>(w * 8 + i);
    }
  }
  return -1;
}
inline bool AllBytes(const std::vector<char>& buf, char c) {
  for (char x : buf) {
    if (x != c) return false;
  }
  return true;
}

}  // namespace fabric_data

#endif  // JAX_SMDDP_TESTS_NATIVE_FABRIC_DATA_H_
