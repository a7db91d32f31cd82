// Hashes that name things alike in every process: message and call tags,
// endpoint addresses.
#ifndef JAX_SMDDP_COMMON_HASHING_H_
#define JAX_SMDDP_COMMON_HASHING_H_

#include <cstdint>
#include <string>

namespace smddp {

// Mixes `value` into a 64-bit tag (message tags and call tags).
uint64_t MixTag(uint64_t tag, uint64_t value);

// FNV-1a of `s`.
uint64_t Fnv1a(const std::string& s);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_HASHING_H_
