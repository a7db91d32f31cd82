// The deadline of every wait inside a collective (jax_smddp.set_timeout,
// JAX_SMDDP_TIMEOUT_S): read by every layer that waits on a peer.
#ifndef JAX_SMDDP_COMMON_TIMEOUT_H_
#define JAX_SMDDP_COMMON_TIMEOUT_H_

#include <chrono>

namespace smddp {

void SetTimeoutSeconds(double seconds);
double TimeoutSeconds();
std::chrono::milliseconds Timeout();

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_TIMEOUT_H_
