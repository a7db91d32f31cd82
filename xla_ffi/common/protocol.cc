#include "xla_ffi/common/protocol.h"

#include "xla_ffi/common/settings.h"

namespace smddp {

uint32_t WireProtocolVersion() {
  static const uint32_t version = [] {
    const int64_t posed = IntSetting("JAX_SMDDP_TEST_PROTOCOL_VERSION", 0);
    return posed > 0 ? uint32_t(posed) : kWireProtocolVersion;
  }();
  return version;
}

}  // namespace smddp
