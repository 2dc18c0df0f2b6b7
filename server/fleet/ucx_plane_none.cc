// UcxPlane in a build without UCX (CMake WEIGHTD_UCX=OFF, or no
// pkg-config `ucx`): Start says so, and nothing else is reached.
#include "server/fleet/ucx_plane.h"

namespace weightd {

struct UcxPlane::Impl {};

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Start() {
  return absl::UnavailableError(
      "this weightd was built without UCX (libucx-dev not found, or -DWEIGHTD_UCX=OFF)");
}
UcxPlane::UcxPlane(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxPlane::~UcxPlane() = default;
std::string UcxPlane::transports() const { return ""; }
const std::string& UcxPlane::worker_address() const {
  static const std::string kNone;
  return kNone;
}
absl::StatusOr<UcxGrant> UcxPlane::Grant(const SegmentPtr&, uint64_t, uint64_t) {
  return absl::UnavailableError("built without UCX");
}
absl::Status UcxPlane::Read(const std::string&, const std::string&, const UcxGrant&, uint64_t,
                            uint64_t, uint8_t*, absl::Duration) {
  return absl::UnavailableError("built without UCX");
}
void UcxPlane::Revoke(uint64_t) {}
UcxPlane::Stats UcxPlane::stats() const { return {}; }

}  // namespace weightd
