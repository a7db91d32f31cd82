// The real NCCL behind the front end: opened by path (never by soname, which
// names the front end itself once it is loaded), with RTLD_LOCAL so that
// neither library's symbols bind the other's. Everything the front end does
// not serve is called through it, with the caller's arguments as they came.
#ifndef JAX_SMDDP_CUDA_NCCLAPI_REAL_NCCL_H_
#define JAX_SMDDP_CUDA_NCCLAPI_REAL_NCCL_H_

#include <string>

#include "cuda/ncclapi/nccl_types.h"

namespace smddp {
namespace nccl {

// Where the real library is (set by jax_smddp before the first NCCL call;
// JAX_SMDDP_NCCL_LIBRARY overrides it). Opened at the first use.
void SetRealLibrary(const std::string& path);
std::string RealLibrary();

// `name` in the real library, or null; `*why` then says why (not
// configured, not loadable, no such function).
void* RealSymbol(const char* name, std::string* why);

// The real library's version (ncclGetVersion), or 0 with `*why`.
int RealVersion(std::string* why);

// Whether that version is one the front end knows (nccl_types.h): with any
// other, every call is forwarded.
bool KnownVersion(int version);

}  // namespace nccl
}  // namespace smddp

#endif  // JAX_SMDDP_CUDA_NCCLAPI_REAL_NCCL_H_
