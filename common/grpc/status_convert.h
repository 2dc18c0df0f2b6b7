// absl::Status <-> grpc::Status: the one conversion the daemon's gRPC
// adapters, the C++ client and the daemon's fleet client share. The codes
// are numerically identical; only the message may change on the way.
// Stateless; thread-safe.
#ifndef WEIGHTD_COMMON_GRPC_STATUS_CONVERT_H_
#define WEIGHTD_COMMON_GRPC_STATUS_CONVERT_H_

#include <cstddef>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightd {

// The longest message a status carries to a client. gRPC sends it
// percent-encoded in a trailer (up to 3 bytes per byte) and a peer refuses
// metadata over 8 KiB (the default), which would turn any status with a
// longer message into RESOURCE_EXHAUSTED "metadata size exceeds limit".
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// Same code; the message cut to kMaxStatusMessageBytes (TruncateMessage, at
// a UTF-8 boundary, saying how much was cut). Every status the daemon sends
// goes through here.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Same code. The message is the sender's as it is, or with `context`
// "context: message" (what the caller was doing, e.g. "reading from peer
// 10.0.0.2:7070"). OK stays OK whatever the context.
absl::Status FromGrpc(const grpc::Status& status, absl::string_view context = {});

}  // namespace weightd

#endif  // WEIGHTD_COMMON_GRPC_STATUS_CONVERT_H_
