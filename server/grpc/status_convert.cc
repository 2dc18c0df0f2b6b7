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

v1::DType ToProtoDType(DType dtype) {
  return static_cast<v1::DType>(static_cast<int>(dtype) + 1);
}

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  int v = static_cast<int>(dtype);
  if (v < 1 || v > kNumDTypes) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype enum value ", v));
  }
  return static_cast<DType>(v - 1);
}

}  // namespace weightd
