// absl::Status <-> grpc::Status. The codes are numerically identical; this is
// the only place the daemon converts.
#ifndef WEIGHTD_SERVER_GRPC_STATUS_CONVERT_H_
#define WEIGHTD_SERVER_GRPC_STATUS_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "proto/convert/dtype_convert.h"
#include "weightd/v1/weightd.pb.h"

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

// proto enum -> DType (DTYPE_UNSPECIFIED has no DType): INVALID_ARGUMENT
// for values without one. The other way: ToProtoDType (dtype_convert.h).
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_STATUS_CONVERT_H_
