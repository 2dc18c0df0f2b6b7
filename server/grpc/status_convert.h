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

grpc::Status ToGrpcStatus(const absl::Status& status);

// proto enum -> DType (DTYPE_UNSPECIFIED has no DType): INVALID_ARGUMENT
// for values without one. The other way: ToProtoDType (dtype_convert.h).
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_STATUS_CONVERT_H_
