#include "xla_ffi/common/hashing.h"

namespace smddp {

uint64_t MixTag(uint64_t tag, uint64_t value) {
  // splitmix64 of the combination: tags of different calls and messages
  // collide with probability ~2^-64.
  uint64_t z = tag ^ (value + 0x9e3779b97f4a7c15ull + (tag << 6) + (tag >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace smddp
