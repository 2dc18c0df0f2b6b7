// The C++ client's gRPC channel to one daemon and its stubs, shared by a
// Client and its ShardSets (which need them to release their leases).
// Thread-safe (gRPC's channel and stubs are); immutable after it is made.
#ifndef WEIGHTD_CLIENT_CHANNEL_H_
#define WEIGHTD_CLIENT_CHANNEL_H_

#include <memory>
#include <string>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "client/weightd_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

class ClientChannel {
 public:
  // `socket_path`: the Unix socket the channel connects to ("" over TCP).
  ClientChannel(std::shared_ptr<grpc::Channel> channel, std::string socket_path);

  // Constant after construction.
  const std::shared_ptr<grpc::Channel> channel;
  const std::string socket_path;
  const std::unique_ptr<v1::Models::Stub> models;
  const std::unique_ptr<v1::Shards::Stub> shards;
  const std::unique_ptr<v1::Adapters::Stub> adapters;
  const std::unique_ptr<grpc::health::v1::Health::Stub> health;
};

// The channel ClientOptions ask for: the Unix socket or HOST:PORT; TLS
// (TCP only) from the tls_* files; the bearer token on every call; the
// policy's largest message; and, with a retry deadline, gRPC's own retries
// of the read-only methods (kServiceConfig) and reconnects within the
// backoff cap. INVALID_ARGUMENT for options that do not go together; a TLS
// file's own error when it cannot be read.
absl::StatusOr<std::shared_ptr<ClientChannel>> MakeClientChannel(const ClientOptions& options);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CHANNEL_H_
