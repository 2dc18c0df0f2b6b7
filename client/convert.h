// weightd.v1 messages -> the C++ client's public types (weightd_client.h),
// and the few request fields the client parses. What the daemon sends is
// trusted for shape only as far as these say. Stateless; thread-safe.
#ifndef WEIGHTD_CLIENT_CONVERT_H_
#define WEIGHTD_CLIENT_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "client/weightd_client.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// INTERNAL "daemon sent unknown dtype N" for a value without a DType.
absl::StatusOr<DType> DTypeFromDaemon(v1::DType d);

// A tensor's dtype the client does not know reads as U8 (the listing is
// informational; a fetch refuses it).
ModelInfo ToModelInfo(const v1::ModelInfo& m);
AdapterInfo ToAdapterInfo(const v1::AdapterInfo& a);
PublishOutcome ToPublishOutcome(const v1::PublishResult& r);
DaemonStats ToDaemonStats(const v1::StatsResponse& r);
PeersInfo ToPeersInfo(const v1::PeersResponse& r);
GenerationEvent ToGenerationEvent(const v1::GenerationEvent& e);

// Load's and LoadAdapter's `source`: "auto" (or ""), "storage", "peers";
// INVALID_ARGUMENT otherwise.
absl::StatusOr<v1::LoadSource> ParseSource(const std::string& source);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CONVERT_H_
