// Copies whose stores bypass the caches, for collectives that write more
// than the caches hold.
//
// A collective's outputs are often far larger than the caches (an all_gather
// of 8 devices writes 64 blocks per call). Plain stores then first read every
// destination line into the cache (read for ownership) only to overwrite it,
// and evict inputs other copies still need. Non-temporal stores write whole
// lines straight to memory: measured on this project's 2-core VM, 8 ranks'
// all_gather copies (1 MiB blocks, 2 threads) ran at 18.8-21.3 GB/s written
// instead of 10.5-12.1 with memcpy. Below the caches' size plain memcpy is
// faster, and what it writes is still in cache for the next op, so a call
// streams only when it writes JAX_SMDDP_STREAMING_STORE_BYTES or more in all.
#ifndef JAX_SMDDP_COMMON_STREAMING_COPY_H_
#define JAX_SMDDP_COMMON_STREAMING_COPY_H_

#include <cstddef>
#include <cstdint>

namespace smddp {

// Whether a call that writes `bytes` in all (every output of this process)
// should stream its stores: bytes >= JAX_SMDDP_STREAMING_STORE_BYTES
// (0: never), on a CPU with non-temporal stores (x86-64).
bool StreamStores(uint64_t bytes);

// memcpy of `bytes` from `src` to `dst` (not overlapping); with `stream`,
// through non-temporal stores, fenced before it returns (so a release that
// follows publishes them like plain stores).
void CopyBytes(void* dst, const void* src, size_t bytes, bool stream);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_STREAMING_COPY_H_
