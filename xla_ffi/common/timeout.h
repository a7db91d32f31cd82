// The deadline of every wait inside a collective (jax_smddp.set_timeout,
// JAX_SMDDP_TIMEOUT_S): read by every layer that waits on a peer.
#ifndef JAX_SMDDP_COMMON_TIMEOUT_H_
#define JAX_SMDDP_COMMON_TIMEOUT_H_

#include <chrono>
#include <string>

namespace smddp {

void SetTimeoutSeconds(double seconds);
double TimeoutSeconds();
std::chrono::milliseconds Timeout();

// How long a wait took, as timeout messages say it ("3.01 s").
std::string Seconds(std::chrono::steady_clock::duration d);
// The advice a timeout message ends with.
inline constexpr char kIfOnlySlow[] =
    "if it is only slow, raise JAX_SMDDP_TIMEOUT_S (or jax_smddp.set_timeout).";

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_TIMEOUT_H_
