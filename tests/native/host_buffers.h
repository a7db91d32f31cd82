// Files and placed buffers for the kernel-body tests (copy_body_test.cu,
// reduce_body_test.cu): what a test reads from numpy, and a copy of it at a
// chosen distance from a 64-byte boundary (to steer the vector widths).
#ifndef JAX_SMDDP_TESTS_NATIVE_HOST_BUFFERS_H_
#define JAX_SMDDP_TESTS_NATIVE_HOST_BUFFERS_H_

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace smddp_test {

inline std::vector<char> ReadFile(const char* path) {
  std::vector<char> bytes;
  FILE* f = std::fopen(path, "rb");
  if (!f) return bytes;
  char buf[1 << 16];
  for (size_t got; (got = std::fread(buf, 1, sizeof(buf), f)) > 0;)
    bytes.insert(bytes.end(), buf, buf + got);
  std::fclose(f);
  return bytes;
}

// A copy of `bytes` at `misalign` bytes past a 64-byte boundary (never freed:
// the tests are short programs).
inline char* Placed(const std::vector<char>& bytes, size_t misalign) {
  char* base =
      static_cast<char*>(std::aligned_alloc(64, (bytes.size() + misalign + 64) / 64 * 64 + 64));
  std::memcpy(base + misalign, bytes.data(), bytes.size());
  return base + misalign;
}

inline bool WriteFile(const char* path, const char* data, size_t size) {
  FILE* f = std::fopen(path, "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

}  // namespace smddp_test

#endif  // JAX_SMDDP_TESTS_NATIVE_HOST_BUFFERS_H_
