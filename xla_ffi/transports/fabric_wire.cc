#include "xla_ffi/transports/fabric_wire.h"

#include <cstddef>
#include <cstdio>
#include <cstring>

namespace smddp {

namespace {

std::string Hex(uint64_t v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%0*llx", digits, static_cast<unsigned long long>(v));
  return buf;
}

const char* KindName(uint32_t kind) {
  switch (kind) {
    case kFabricData:
      return "data";
    case kFabricAbort:
      return "abort";
    case kFabricRts:
      return "ready-to-send";
    case kFabricCts:
      return "clear-to-send";
  }
  return "?";
}

}  // namespace

Status ParseFabricChunk(const void* buf, size_t len, size_t capacity, uint32_t version,
                        const FabricSenderGroup& group, FabricChunkHeader* out, uint64_t* blame) {
  *blame = 0;
  FabricChunkHeader h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(&h, buf, len < sizeof(h) ? len : sizeof(h));  // never past the chunk's end

  // Who sent it, as far as the chunk says.
  constexpr size_t kSenderEnd = offsetof(FabricChunkHeader, sender) + sizeof(h.sender);
  std::string who;
  bool in_group = false;
  if (len >= kSenderEnd) {
    std::string name;
    in_group = group && group(h.sender, &name);
    who = in_group ? name : "an unknown sender (id " + Hex(h.sender, 16) + ")";
  } else {
    who = "an unknown sender";
  }
  if (in_group) *blame = h.sender;
  auto bad = [&](const std::string& what) {
    return Status::Protocol("malformed chunk from " + who + ": " + what);
  };

  if (len < kFabricHeaderBytes) {
    return bad("only " + std::to_string(len) + " bytes, shorter than the " +
               std::to_string(kFabricHeaderBytes) + "-byte header");
  }
  if (len > capacity) {
    return bad(std::to_string(len) + " bytes, more than the " + std::to_string(capacity) +
               "-byte buffer it was received into");
  }
  if (h.magic != kFabricChunkMagic) {
    return bad("magic " + Hex(h.magic, 8) + " instead of jax_smddp's " + Hex(kFabricChunkMagic, 8) +
               " (not a jax_smddp chunk)");
  }
  if (h.version != version) {
    return bad("wire protocol version " + std::to_string(h.version) + ", but this process speaks " +
               std::to_string(version) + " (the processes run different jax_smddp builds)");
  }
  if (!in_group)
    return bad("not a peer of this endpoint (no process of this job has that address)");
  if (h.kind < kFabricData || h.kind > kFabricCts)
    return bad("unknown kind " + std::to_string(h.kind));
  if (h.reserved != 0) return bad("reserved header field " + Hex(h.reserved, 8) + " is not zero");
  const uint64_t payload = len - kFabricHeaderBytes;
  if (h.len != payload) {
    return bad("the header announces " + std::to_string(h.len) +
               " payload bytes, the chunk holds " + std::to_string(payload));
  }
  const std::string msg =
      "message " + std::to_string(h.seq) + " (tag " + std::to_string(h.tag) + ")";
  if (h.kind == kFabricData) {
    if (h.offset > h.total || h.len > h.total - h.offset) {
      return bad(msg + ": " + std::to_string(h.len) + " bytes at offset " +
                 std::to_string(h.offset) + " of a " + std::to_string(h.total) + "-byte message");
    }
    if (h.len == 0 && h.total != 0) {
      return bad(msg + ": an empty data chunk of a " + std::to_string(h.total) + "-byte message");
    }
  } else if (h.len != 0) {
    return bad(msg + ": " + KindName(h.kind) + " chunk with a payload");
  } else if (h.kind == kFabricAbort && h.offset > h.total) {
    return bad(msg + ": an abort after " + std::to_string(h.offset) + " bytes of a " +
               std::to_string(h.total) + "-byte message");
  } else if (h.kind == kFabricCts && h.offset > 1) {
    return bad(msg + ": a clear-to-send answering " + std::to_string(h.offset) + " (0 or 1)");
  } else if (h.kind == kFabricRts && (h.total == 0 || h.offset != 0)) {
    return bad(msg + ": a ready-to-send of " + std::to_string(h.total) + " bytes at offset " +
               std::to_string(h.offset));
  }
  *out = h;
  return Status::Ok();
}

}  // namespace smddp
