// The interface the host algorithms (host_algorithms.h) are written against.
//
// A host algorithm is a body: what one rank does, given an Exchange (that
// rank's view of all ranks' buffers for the call, with the moves it may make
// between them). The engine's in-process rendezvous (engine/rendezvous.h)
// builds one per rank and runs the bodies once every rank has arrived.
// Across processes the same collectives run process_algorithms.h over links,
// and on GPUs stream_algorithms.h over StreamOps. What the three families
// share is the Plan (plan.h), the reductions (reduce.h) and the element
// types; each collective has one body per family (docs/architecture.md).
#ifndef JAX_SMDDP_ALGORITHMS_EXCHANGE_H_
#define JAX_SMDDP_ALGORITHMS_EXCHANGE_H_

#include <cstddef>

#include "xla_ffi/common/status.h"

namespace smddp {

class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Direct pointer to `peer`'s send buffer when it is addressable from this
  // rank (always for peer == rank), else nullptr.
  virtual const void* PeerSend(int peer) = 0;
  // Copies `bytes` of `peer`'s send buffer, from `offset`, into local `dst`.
  virtual Status Get(int peer, size_t offset, void* dst, size_t bytes) = 0;
  // Copies local `src` into `peer`'s receive buffer at `offset`.
  virtual Status Put(int peer, size_t offset, const void* src, size_t bytes) = 0;
  // This rank's receive buffer.
  virtual void* Recv() = 0;
};

}  // namespace smddp

#endif  // JAX_SMDDP_ALGORITHMS_EXCHANGE_H_
