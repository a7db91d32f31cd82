// The wire protocol's version: what two processes of one job must read alike
// in everything they exchange. Declared once, here; jax_smddp.initialize()
// publishes it with the build id (jax_smddp.capabilities.build()) and every
// process compares its peers' with its own before any link is used, so a job
// whose processes run different builds fails there, naming both, instead of
// misreading each other's chunks. The links carry it too (the shared-memory
// segment's header, every libfabric chunk header), so a chunk of another
// version is refused even where the bootstrap was skipped.
#ifndef JAX_SMDDP_COMMON_PROTOCOL_H_
#define JAX_SMDDP_COMMON_PROTOCOL_H_

#include <cstdint>

namespace smddp {

// Raise it with any change to what crosses a link: the shared-memory segment's
// layout and ring chunks (transports/shm_link_impl.h), the libfabric chunk header
// and the direct-transfer handshake (transports/fabric_wire.h), message tags
// (common/hashing.h MixTag), the GPU communicators' shared block
// (transports/shared_block.cc), the per-call agreement header
// (algorithms/process_algorithms.cc), the messages an algorithm exchanges.
constexpr uint32_t kWireProtocolVersion = 4;

// The version this process speaks: kWireProtocolVersion, unless the tests'
// JAX_SMDDP_TEST_PROTOCOL_VERSION makes it pose as a build of another version
// (read once).
uint32_t WireProtocolVersion();

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_PROTOCOL_H_
