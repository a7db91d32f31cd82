#include "xla_ffi/common/protocol.h"

#include "xla_ffi/common/settings.h"

namespace smddp {

uint32_t WireProtocolVersion() {
  static const uint32_t version = [] {
    int64_t posed = 0;
    return IntSettingIfSet("JAX_SMDDP_TEST_PROTOCOL_VERSION", &posed) && posed > 0
               ? uint32_t(posed)
               : kWireProtocolVersion;
  }();
  return version;
}

}  // namespace smddp
