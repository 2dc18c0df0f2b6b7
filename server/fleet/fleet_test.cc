#include "server/fleet/fleet.h"

#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

// A real gRPC server playing one peer of the fleet; each test sets what it
// answers.
class FakePeer final : public v1::Models::Service {
 public:
  struct Script {
    std::string instance_id;  // sent as kInstanceMetadata when set
    grpc::Status find_status;
    v1::FindCheckpointResponse find;
    std::vector<v1::ReadChunk> chunks;
    grpc::Status read_status;
  };

  void Set(Script script) {
    absl::MutexLock lock(&mu_);
    script_ = std::move(script);
  }
  std::string authorization() {
    absl::MutexLock lock(&mu_);
    return authorization_;
  }

  grpc::Status List(grpc::ServerContext* ctx, const v1::ListModelsRequest*,
                    v1::ListModelsResponse* resp) override {
    Script s = Begin(ctx);
    v1::ModelInfo* m = resp->add_models();
    m->set_name("m");
    m->set_generation(3);
    m->set_weights_id("abc");
    return grpc::Status::OK;
  }
  grpc::Status FindCheckpoint(grpc::ServerContext* ctx, const v1::FindCheckpointRequest*,
                              v1::FindCheckpointResponse* resp) override {
    Script s = Begin(ctx);
    *resp = s.find;
    return s.find_status;
  }
  grpc::Status ReadCheckpoint(grpc::ServerContext* ctx, const v1::ReadCheckpointRequest*,
                              grpc::ServerWriter<v1::ReadChunk>* writer) override {
    Script s = Begin(ctx);
    for (const v1::ReadChunk& c : s.chunks) writer->Write(c);
    return s.read_status;
  }

 private:
  Script Begin(grpc::ServerContext* ctx) {
    absl::MutexLock lock(&mu_);
    auto it = ctx->client_metadata().find("authorization");
    authorization_ = it == ctx->client_metadata().end()
                         ? "(none)"
                         : std::string(it->second.data(), it->second.size());
    if (!script_.instance_id.empty()) {
      ctx->AddInitialMetadata(kInstanceMetadata, script_.instance_id);
    }
    return script_;
  }

  absl::Mutex mu_;
  Script script_ ABSL_GUARDED_BY(mu_);
  std::string authorization_ ABSL_GUARDED_BY(mu_);
};

v1::ReadChunk Chunk(uint64_t offset, const std::string& data) {
  v1::ReadChunk c;
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

// Polls `done` until it holds or 30 s passed.
template <typename F>
bool Eventually(F done) {
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&peer_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port_);
    token_file_ = ::testing::TempDir() + "/fleet_test_token." + std::to_string(::getpid());
    std::ofstream(token_file_) << "# the fleet's\ns3cret\n";
  }
  void TearDown() override {
    server_->Shutdown();
    ::unlink(token_file_.c_str());
  }

  std::unique_ptr<Fleet> StartFleet() {
    PeerOptions options;
    options.addresses = {address_};
    options.poll_interval = absl::Milliseconds(50);
    options.token_file = token_file_;
    auto fleet = Fleet::Start(options);
    EXPECT_TRUE(fleet.ok()) << fleet.status();
    return fleet.ok() ? std::move(*fleet) : nullptr;
  }

  static PeerQuery Query() {
    PeerQuery q;
    q.key = DigestBytes("key", 3);
    q.samples = {{0, 0, 8}};
    q.sample_digests = {DigestBytes("sample", 6)};
    q.tensors_per_file = {2};
    return q;
  }

  static v1::FindCheckpointResponse TrueAnswer() {
    v1::FindCheckpointResponse r;
    r.set_copy(std::string(16, 'c'));
    r.add_tensor_digests(std::string(32, 't'));
    r.add_sample_digests(std::string(16, 's'));
    return r;
  }

  FakePeer peer_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::string token_file_;
};

TEST_F(FleetTest, StartRefusesAddressesAndTokensItCannotUse) {
  PeerOptions bad;
  bad.addresses = {"no-port"};
  auto fleet = Fleet::Start(bad);
  EXPECT_EQ(fleet.status(),
            absl::InvalidArgumentError("--peers: expected HOST:PORT, got \"no-port\""));
  bad.addresses = {};
  bad.dns = "name:0";
  EXPECT_EQ(Fleet::Start(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.dns = "";
  bad.addresses = {address_};
  bad.token_file = token_file_ + ".missing";
  EXPECT_FALSE(Fleet::Start(bad).ok());
}

TEST_F(FleetTest, TheTablePollsEachPeerWithTheToken) {
  std::unique_ptr<Fleet> fleet = StartFleet();
  ASSERT_NE(fleet, nullptr);
  ASSERT_TRUE(Eventually([&] {
    std::vector<PeerState> peers = fleet->table()->Snapshot();
    return peers.size() == 1 && peers[0].reachable;
  }));
  PeerState p = fleet->table()->Snapshot()[0];
  EXPECT_EQ(p.address, address_);
  ASSERT_EQ(p.models.size(), 1u);
  EXPECT_EQ(p.models[0].name, "m");
  EXPECT_EQ(p.models[0].generation, 3u);
  EXPECT_EQ(p.models[0].weights_id, "abc");
  EXPECT_EQ(peer_.authorization(), "Bearer s3cret");
  EXPECT_EQ(fleet->table()->instance_id().size(), 32u);
}

TEST_F(FleetTest, APeerAnsweringWithThisDaemonsIdIsLeftOut) {
  std::unique_ptr<Fleet> fleet = StartFleet();
  ASSERT_NE(fleet, nullptr);
  peer_.Set({.instance_id = fleet->table()->instance_id()});
  EXPECT_TRUE(Eventually([&] { return fleet->table()->Snapshot().empty(); }));
  EXPECT_TRUE(fleet->checkpoint_peers()->FindHolders(Query()).empty());
}

TEST_F(FleetTest, FindHoldersTakesOnlyAnswersOfTheQuerysShape) {
  std::unique_ptr<Fleet> fleet = StartFleet();
  ASSERT_NE(fleet, nullptr);
  peer_.Set({.find = TrueAnswer()});
  std::vector<PeerHolding> found = fleet->checkpoint_peers()->FindHolders(Query());
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].peer, address_);
  EXPECT_EQ(found[0].copy, *DigestFromBytes(std::string(16, 'c')));
  ASSERT_EQ(found[0].tensor_digests.size(), 1u);
  EXPECT_EQ(found[0].tensor_digests[0].size(), 2u);
  ASSERT_EQ(found[0].sample_digests.size(), 1u);

  v1::FindCheckpointResponse short_file = TrueAnswer();
  short_file.set_tensor_digests(0, std::string(16, 't'));  // one tensor of two
  peer_.Set({.find = short_file});
  EXPECT_TRUE(fleet->checkpoint_peers()->FindHolders(Query()).empty());
  v1::FindCheckpointResponse no_copy = TrueAnswer();
  no_copy.clear_copy();
  peer_.Set({.find = no_copy});
  EXPECT_TRUE(fleet->checkpoint_peers()->FindHolders(Query()).empty());
  peer_.Set({.find_status = grpc::Status(grpc::StatusCode::NOT_FOUND, "not held")});
  EXPECT_TRUE(fleet->checkpoint_peers()->FindHolders(Query()).empty());
}

TEST_F(FleetTest, ReadRangeTakesOnlyTheRangeInOrder) {
  std::unique_ptr<Fleet> fleet = StartFleet();
  ASSERT_NE(fleet, nullptr);
  const Digest key = DigestBytes("key", 3), copy = DigestBytes("copy", 4);
  std::string dest(6, '\0');
  const char* transport = "";
  auto read = [&] {
    return fleet->checkpoint_peers()->ReadRange(address_, key, copy, {0, 10, 6},
                                                reinterpret_cast<uint8_t*>(dest.data()),
                                                &transport);
  };
  peer_.Set({.chunks = {Chunk(0, "abc"), Chunk(3, "def")}});
  ASSERT_TRUE(read().ok());
  EXPECT_EQ(dest, "abcdef");
  EXPECT_STREQ(transport, "grpc");  // no UCX plane: over gRPC

  peer_.Set({.chunks = {Chunk(0, "abc"), Chunk(4, "ef")}});
  EXPECT_EQ(read(), absl::DataLossError(absl::StrCat(
                        "peer ", address_, " sent bytes 4+2 of a range of 6 where 3 was next")));
  peer_.Set({.chunks = {Chunk(0, "abc")}});
  EXPECT_EQ(read(), absl::DataLossError(absl::StrCat("peer ", address_, " sent 3 of 6 bytes")));
  peer_.Set({.read_status = grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not a member")});
  EXPECT_EQ(read(), absl::PermissionDeniedError(
                        absl::StrCat("reading from peer ", address_, ": not a member")));
  EXPECT_EQ(peer_.authorization(), "Bearer s3cret");
}

}  // namespace
}  // namespace weightd
