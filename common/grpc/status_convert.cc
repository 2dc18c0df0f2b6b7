#include "common/grpc/status_convert.h"

#include "absl/strings/str_cat.h"
#include "common/untrusted_text.h"

namespace weightd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      TruncateMessage(status.message(), kMaxStatusMessageBytes));
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (context.empty()) return absl::Status(code, status.error_message());
  return absl::Status(code, absl::StrCat(context, ": ", status.error_message()));
}

}  // namespace weightd
