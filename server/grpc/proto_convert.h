// weightd.v1 messages <-> the domain's types, for the gRPC services: model
// and adapter summaries, fetch requests, and fetch responses assembled from
// a table's encoding made once (EncodedTable). DTypes: ToProtoDType
// (proto/convert/dtype_convert.h) and FromProtoDType (below).
#ifndef WEIGHTD_SERVER_GRPC_PROTO_CONVERT_H_
#define WEIGHTD_SERVER_GRPC_PROTO_CONVERT_H_

#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "server/engine/weight_service.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// proto enum -> DType (DTYPE_UNSPECIFIED has no DType): INVALID_ARGUMENT
// for values without one. The other way: ToProtoDType (dtype_convert.h).
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);
// Where a load of a model or adapter may read from; LOAD_SOURCE_UNSPECIFIED
// (and any unknown value) is kAuto.
LoadSource FromProtoLoadSource(v1::LoadSource source);

void FillModelInfo(const ModelSummary& s, v1::ModelInfo* out);
void FillAdapterInfo(const AdapterSummary& a, v1::AdapterInfo* out);
// INVALID_ARGUMENT for a bad placement, dtype or transport.
absl::StatusOr<FetchParams> DecodeFetch(const v1::FetchRequest& req);
// INVALID_ARGUMENT when the bytes are not a FetchRequest.
absl::StatusOr<v1::FetchRequest> ParseFetchRequest(const grpc::ByteBuffer& buffer);
// The FetchResponse of `table` without lease_id and token, serialized once
// per table.
const std::string& EncodedTable(const FetchTable& table);
// A fetch's outcome as the call's response (a fresh lease head and the
// table's shared encoding, sent without a copy), or its error.
absl::Status EncodeFetchResponse(const absl::StatusOr<FetchResult>& result,
                                 grpc::ByteBuffer* resp);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_PROTO_CONVERT_H_
