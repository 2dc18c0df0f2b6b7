// What a weightd gRPC client presents to the daemon it calls: TLS channel
// credentials read from PEM files, and a bearer token sent on every call.
// Shared by the C++ client (client/channel.cc) and the daemon's fleet client
// (server/fleet/peer_channels.cc), which decide when TLS applies; the
// daemon's side of both is server/grpc/call_auth.h. Stateless functions;
// what they return is thread-safe (gRPC's own objects).
#ifndef WEIGHTD_COMMON_GRPC_CREDENTIALS_H_
#define WEIGHTD_COMMON_GRPC_CREDENTIALS_H_

#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/status/statusor.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace weightd {

// The PEM files of a TLS client.
struct TlsFiles {
  std::string ca_file;    // roots that verify the server; empty: the system's
  std::string cert_file;  // client certificate chain; empty: none
  std::string key_file;   // its private key (read only with cert_file)
};

// The largest PEM file read (roots, chain or key).
inline constexpr uint64_t kMaxPemBytes = 1 << 20;

// SslCredentials from `files`, each read whole (ReadFileToString, at most
// kMaxPemBytes): its errors as they come (INVALID_ARGUMENT for a file that
// is not regular or too large, the errno's code for one that cannot be
// read).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeTlsCredentials(
    const TlsFiles& files);

// An interceptor factory that adds "authorization: Bearer <token>" to the
// initial metadata of every call of a channel made with it (the daemon's
// --auth-token-file and --fleet-members check it).
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>
BearerTokenInterceptorFactory(std::string token);

// grpc::CreateCustomChannel, with BearerTokenInterceptorFactory(token) when
// `token` is not empty.
std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds,
    const grpc::ChannelArguments& args, const std::string& token);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_GRPC_CREDENTIALS_H_
