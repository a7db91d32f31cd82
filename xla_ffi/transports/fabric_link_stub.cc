// The libfabric links in a build without libfabric's headers: the transport
// exists but cannot open (fabric_link.h).
#include "xla_ffi/transports/fabric_link.h"

#include <memory>
#include <string>
#include <utility>

#include "xla_ffi/transports/fabric_api.h"
#include "xla_ffi/transports/fabric_link_impl.h"

#ifndef SMDDP_HAVE_LIBFABRIC

namespace smddp {

using fabric::kDefaultProvider;

class FabricEndpoint::Impl {};

bool FabricAvailable(std::string* why) {
  if (why) *why = kFabricNoHeaders;
  return false;
}

std::string DefaultFabricProvider() { return kDefaultProvider; }

Status FabricEndpoint::Open(const std::string&, const std::string&,
                            std::unique_ptr<FabricEndpoint>*) {
  std::string why;
  FabricAvailable(&why);
  return Status::Error("cannot open a libfabric endpoint: jax_smddp was " + why);
}

FabricEndpoint::FabricEndpoint(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
FabricEndpoint::~FabricEndpoint() = default;
std::string FabricEndpoint::Address() const { return std::string(); }
std::string FabricEndpoint::Provider() const { return std::string(); }
std::string FabricEndpoint::WaitKind() const { return std::string(); }
size_t FabricEndpoint::DrainBytes() const { return 0; }
Status FabricEndpoint::Connect(const std::string&, const std::string&, std::unique_ptr<Link>*) {
  return Status::Unsupported("jax_smddp was built without libfabric headers");
}

}  // namespace smddp

#endif  // SMDDP_HAVE_LIBFABRIC
