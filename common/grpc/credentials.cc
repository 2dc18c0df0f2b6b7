#include "common/grpc/credentials.h"

#include <utility>
#include <vector>

#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "common/fd.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// Adds the authorization header to one call.
class BearerTokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(std::string header) : header_(std::move(header)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", header_});
    }
    methods->Proceed();
  }

 private:
  const std::string header_;  // gRPC keeps a reference until the call ends
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(header_);  // gRPC owns interceptors
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeTlsCredentials(
    const TlsFiles& files) {
  grpc::SslCredentialsOptions ssl;
  if (!files.ca_file.empty()) {
    WD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileToString(files.ca_file, kMaxPemBytes));
  }
  if (!files.cert_file.empty()) {
    WD_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileToString(files.cert_file, kMaxPemBytes));
    WD_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileToString(files.key_file, kMaxPemBytes));
  }
  return grpc::SslCredentials(ssl);
}

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>
BearerTokenInterceptorFactory(std::string token) {
  return std::make_unique<TokenInterceptorFactory>(std::move(token));
}

std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds,
    const grpc::ChannelArguments& args, const std::string& token) {
  if (token.empty()) return grpc::CreateCustomChannel(target, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(BearerTokenInterceptorFactory(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(factories));
}

}  // namespace weightd
