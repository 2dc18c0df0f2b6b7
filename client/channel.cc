#include "client/channel.h"

#include <utility>

#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "client/client_policy.h"
#include "common/grpc/credentials.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(
    const ClientOptions& o, grpc::ChannelArguments* args) {
  bool tls = o.tls || !o.tls_ca_file.empty() || !o.tls_cert_file.empty() ||
             !o.tls_key_file.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (!o.socket.empty()) {
    return absl::InvalidArgumentError("TLS is for --target HOST:PORT, not a Unix socket");
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both --tls-cert and --tls-key");
  }
  if (!o.tls_server_name.empty()) args->SetSslTargetNameOverride(o.tls_server_name);
  return MakeTlsCredentials({o.tls_ca_file, o.tls_cert_file, o.tls_key_file});
}

grpc::ChannelArguments ChannelArguments(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  if (options.retry_deadline > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
    args.SetServiceConfigJSON(kServiceConfig);
    // Reconnect to a restarted daemon within the backoff cap instead of
    // gRPC's default (1 s growing to 120 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  } else {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  }
  return args;
}

}  // namespace

ClientChannel::ClientChannel(std::shared_ptr<grpc::Channel> channel, std::string socket_path)
    : channel(channel),
      socket_path(std::move(socket_path)),
      models(v1::Models::NewStub(channel)),
      shards(v1::Shards::NewStub(channel)),
      adapters(v1::Adapters::NewStub(channel)),
      health(grpc::health::v1::Health::NewStub(channel)) {}

absl::StatusOr<std::shared_ptr<ClientChannel>> MakeClientChannel(const ClientOptions& options) {
  std::string target;
  if (!options.socket.empty()) {
    target = "unix:" + options.socket;
  } else if (!options.target.empty()) {
    target = options.target;
  } else {
    return absl::InvalidArgumentError("give a --socket PATH or a --target HOST:PORT");
  }
  grpc::ChannelArguments args = ChannelArguments(options);
  WD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                      MakeCredentials(options, &args));
  return std::make_shared<ClientChannel>(
      CreateChannelWithToken(target, creds, args, options.token), options.socket);
}

}  // namespace weightd
