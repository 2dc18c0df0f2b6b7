#include "server/grpc/status_convert.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/untrusted_text.h"

namespace weightd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      TruncateMessage(status.message(), kMaxStatusMessageBytes));
}

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  std::optional<DType> d = DTypeFromProto(dtype);
  if (!d.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype enum value ", static_cast<int>(dtype)));
  }
  return *d;
}

}  // namespace weightd
