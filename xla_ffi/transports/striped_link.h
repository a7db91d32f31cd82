// A link to one peer over several links at once: one per NIC pair when this
// process or its peer has several NICs (one libfabric endpoint per NIC), so
// that the traffic between two processes leaves by every NIC they were given.
//
// A message of at least `stripe_bytes` is cut into one stripe per link (equal
// parts, each a multiple of 64 bytes but the last), every stripe sent under the
// message's tag on its own link; a smaller message goes whole over one link,
// chosen by its tag. Both ends derive the same split from the tag and the
// size alone, so they need only agree on the links' order (the bootstrap gives
// both the same list of NIC pairs) and on `stripe_bytes` (a setting every
// process shares). Per tag, the sub-links keep send order, so the striped link
// does too.
//
// A request completes once every stripe's did (with the first failure, after
// cancelling the others); Cancel withdraws every stripe, so once it returns no
// sub-link touches the caller's buffer. Completion is noticed by Progress(),
// which the waiting callers run.
#ifndef JAX_SMDDP_TRANSPORTS_STRIPED_LINK_H_
#define JAX_SMDDP_TRANSPORTS_STRIPED_LINK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla_ffi/transports/link.h"

namespace smddp {

// Where stripe `k` of a message of `bytes` split over `links` links starts and
// how long it is; the last stripe takes the remainder. For tests and for
// StripedLink, which uses exactly this split.
void StripeOf(size_t bytes, int links, int k, size_t* offset, size_t* length);
// The one link a message too small to stripe takes.
int LinkOfTag(uint64_t tag, int links);

// `links` (at least one; one is returned as it is) to the same peer.
std::unique_ptr<Link> StripedLink(std::vector<std::unique_ptr<Link>> links, size_t stripe_bytes);

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_STRIPED_LINK_H_
