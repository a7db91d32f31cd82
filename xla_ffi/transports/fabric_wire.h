// The libfabric links' wire format (fabric_eager.cc, fabric_direct.cc): every
// libfabric message is one chunk, a 64-byte header followed by its payload. A receiver reads a
// chunk only through ParseFabricChunk, which refuses any header its peers'
// FabricEndpoint would not have written (and reads nothing past the chunk's
// end), so a chunk from another build, a stranger or a corrupting network is
// dropped with an error naming its sender instead of being misread.
//
// Independent of libfabric's headers: the tests' probe fuzzes the parser in
// builds without libfabric too.
#ifndef JAX_SMDDP_TRANSPORTS_FABRIC_WIRE_H_
#define JAX_SMDDP_TRANSPORTS_FABRIC_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "xla_ffi/common/status.h"

namespace smddp {

constexpr uint32_t kFabricChunkMagic = 0x46444d53;  // "SMDF"
constexpr size_t kFabricHeaderBytes = 64;

enum FabricChunkKind : uint32_t {
  kFabricData = 1,   // `len` payload bytes of message `seq`, at `offset` of its `total`
  kFabricAbort = 2,  // the sender cancelled message `seq` after `offset` bytes
  kFabricRts = 3,    // message `seq` of `total` bytes comes direct once the receiver asks
  kFabricCts = 4,    // receiver -> sender: message `seq` posted (offset 1) or refused (0)
};

struct FabricChunkHeader {
  uint32_t magic;    // kFabricChunkMagic
  uint32_t version;  // the sender's WireProtocolVersion() (common/protocol.h)
  uint64_t sender;   // Fnv1a of the sender's endpoint address
  uint64_t seq;      // message number on the sender->receiver channel
  uint64_t tag;
  uint64_t total;     // message bytes
  uint64_t offset;    // of this chunk's payload (kFabricAbort: bytes the sender sent)
  uint64_t len;       // payload bytes in this chunk
  uint32_t kind;      // FabricChunkKind
  uint32_t reserved;  // 0
};
static_assert(sizeof(FabricChunkHeader) == kFabricHeaderBytes, "the chunk header is 64 bytes");

// The senders a receiver accepts chunks from (the peers its endpoint is
// connected to): true, with the peer's name in `*name` ("process 3"), for an
// id of the group.
using FabricSenderGroup = std::function<bool(uint64_t sender, std::string* name)>;

// Parses the chunk of `len` bytes at `buf` that one receive delivered into a
// buffer of `capacity` bytes, for a receiver that speaks protocol `version`
// and takes chunks from `group`. Reads only buf[0, min(len, 64)).
//
// Accepts only what a peer writes: the whole header present and len at most
// `capacity`; the magic; protocol `version`; a sender of the group; a known
// kind; `reserved` zero; `len` == 64 + the header's len; and per kind: data
// with offset + len <= total (and a payload unless total is 0); abort with no
// payload and offset <= total; clear-to-send with no payload and offset 0 or
// 1; ready-to-send with no payload, total > 0 and offset 0.
//
// Otherwise a kProtocol status whose message names the sender: its name when
// the header's sender field is in the group ("process 3"), else the id it
// claims ("an unknown sender 0x..."), or "an unknown sender" when the chunk
// is too short to hold one; `*blame` is that sender's id when it is in the
// group (the link to fail), else 0 (the receiver cannot tell whose it is).
Status ParseFabricChunk(const void* buf, size_t len, size_t capacity, uint32_t version,
                        const FabricSenderGroup& group, FabricChunkHeader* out, uint64_t* blame);

}  // namespace smddp

#endif  // JAX_SMDDP_TRANSPORTS_FABRIC_WIRE_H_
