#include "xla_ffi/algorithms/process_agreement.h"

#include <cstring>
#include <sstream>
#include <string>

namespace smddp {

namespace {

static_assert(sizeof(ProcessCallHeader) < 4096, "a header is one chunk (chunks are 4 KiB or more)");

ProcessCallHeader MakeHeader(const ProcessCall& c, const Plan& p) {
  ProcessCallHeader h;
  std::memset(&h, 0, sizeof(h));
  std::strncpy(h.op, c.info.op, sizeof(h.op) - 1);
  h.dtype = uint64_t(c.info.dtype);
  h.reduce = uint64_t(c.info.reduce);
  h.send_bytes = c.info.send_bytes;
  h.recv_bytes = c.info.recv_bytes;
  h.size = uint64_t(c.size);
  h.kind = uint64_t(p.kind);
  h.outer = p.outer;
  h.inner = p.inner;
  h.count = p.count;
  h.hierarchical = c.routes->hierarchical ? 1 : 0;
  h.chunk_bytes = c.chunk_bytes;
  if (!SpecOf(p.kind).every_peer && p.sources) {  // a permutation: its ranks agree on it too
    uint64_t digest = 1469598103934665603ull;
    for (int r = 0; r < c.size; ++r) digest = MixTag(digest, uint64_t(p.sources[r] + 1));
    h.permutation = digest;
  }
  return h;
}

std::string Describe(const ProcessCallHeader& h) {
  std::ostringstream os;
  std::string op(h.op, strnlen(h.op, sizeof(h.op)));
  os << op << " of " << (h.dtype < 16 ? DTypeName(DType(h.dtype)) : "?") << " (" << h.send_bytes
     << " bytes in, " << h.recv_bytes << " bytes out per device";
  Collective kind;
  if (CollectiveNamed(op.c_str(), &kind) && Reduces(kind))
    os << ", " << (h.reduce < 3 ? ReduceOpName(ReduceOp(h.reduce)) : "?");
  os << ", " << h.size << " devices; " << (h.hierarchical ? "hierarchical" : "flat") << " routes, "
     << (h.chunk_bytes ? std::to_string(h.chunk_bytes) + "-byte" : std::string("default"))
     << " chunks";
  if (h.permutation) os << "; permutation " << std::hex << h.permutation << std::dec;
  os << ")";
  return os.str();
}

}  // namespace

ProcessAgreement::ProcessAgreement(const ProcessCall& call, const Plan& plan)
    : c(call), mine(MakeHeader(call, plan)), theirs(call.peers->size()), m(call) {
  for (size_t i = 0; i < c.peers->size(); ++i)
    m.Recv((*c.peers)[i], Msg(kHeader), &theirs[i], sizeof(ProcessCallHeader));
  for (int p : *c.peers) m.Send(p, Msg(kHeader), &mine, sizeof(ProcessCallHeader));
}

Status ProcessAgreement::Check() const {
  for (size_t i = 0; i < c.peers->size(); ++i) {
    if (m.Succeeded(i) && std::memcmp(&theirs[i], &mine, sizeof(ProcessCallHeader)) != 0) {
      return c.Concerning(
          (*c.peers)[i],
          Status::Mismatch(c.where() + ": processes disagree on the call: this process (process " +
                           std::to_string(c.world->process()) + ") runs " + Describe(mine) +
                           " but " + c.DescribeProcess((*c.peers)[i]) + " runs " +
                           Describe(theirs[i]) +
                           ". Every process must run the same program on same-shaped inputs."));
    }
  }
  return Status::Ok();
}

}  // namespace smddp
