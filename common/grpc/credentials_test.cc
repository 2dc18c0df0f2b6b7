#include "common/grpc/credentials.h"

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

// A real server that records the authorization header of each call.
class RecordingModels final : public v1::Models::Service {
 public:
  grpc::Status List(grpc::ServerContext* ctx, const v1::ListModelsRequest*,
                    v1::ListModelsResponse*) override {
    absl::MutexLock lock(&mu_);
    auto it = ctx->client_metadata().find("authorization");
    seen_ = it == ctx->client_metadata().end() ? "(none)"
                                               : std::string(it->second.data(), it->second.size());
    return grpc::Status::OK;
  }
  std::string seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  absl::Mutex mu_;
  std::string seen_ ABSL_GUARDED_BY(mu_);
};

std::string SocketPath() {
  return ::testing::TempDir() + "/credentials_test." + std::to_string(::getpid()) + ".sock";
}

TEST(CredentialsTest, TheTokenRidesOnEveryCallAndOnlyWhenGiven) {
  RecordingModels service;
  grpc::ServerBuilder builder;
  const std::string path = SocketPath();
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  for (const std::string token : {"s3cret", ""}) {
    auto channel = CreateChannelWithToken("unix:" + path, grpc::InsecureChannelCredentials(),
                                          grpc::ChannelArguments(), token);
    auto stub = v1::Models::NewStub(channel);
    for (int call = 0; call < 2; ++call) {
      grpc::ClientContext ctx;
      v1::ListModelsResponse resp;
      ASSERT_TRUE(stub->List(&ctx, v1::ListModelsRequest(), &resp).ok());
      EXPECT_EQ(service.seen(), token.empty() ? "(none)" : "Bearer " + token);
    }
  }
  server->Shutdown();
  ::unlink(path.c_str());
}

TEST(CredentialsTest, UnreadablePemFilesAreRefused) {
  auto missing = MakeTlsCredentials({.ca_file = ::testing::TempDir() + "/no-such-ca.pem"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  auto dir = MakeTlsCredentials({.cert_file = ::testing::TempDir(), .key_file = "k"});
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument) << dir.status();
  EXPECT_TRUE(MakeTlsCredentials({}).ok());  // the system's roots, no client certificate
}

}  // namespace
}  // namespace weightd
