#include "client/grpc_read.h"

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "client/client_policy.h"
#include "client/weightd_client.h"
#include "gtest/gtest.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

v1::ShardTensor Tensor(uint32_t segment, uint64_t offset, uint64_t length) {
  v1::ShardTensor t;
  t.set_segment(segment);
  t.set_offset(offset);
  t.set_length(length);
  return t;
}

std::vector<std::vector<int>> TensorsOf(const std::vector<ReadRun>& runs) {
  std::vector<std::vector<int>> out;
  for (const ReadRun& r : runs) out.push_back(r.tensors);
  return out;
}

TEST(PlanReadRunsTest, NearbyRangesOfASegmentAreReadAsOne) {
  v1::FetchResponse resp;
  *resp.add_tensors() = Tensor(0, 1000, 100);                        // 0
  *resp.add_tensors() = Tensor(0, 0, 100);                           // 1
  *resp.add_tensors() = Tensor(0, 1100 + kReadMergeGap, 10);         // 2: at the gap
  *resp.add_tensors() = Tensor(0, 1110 + 2 * kReadMergeGap + 1, 5);  // 3: past it
  *resp.add_tensors() = Tensor(1, 0, 7);                             // 4: another segment
  *resp.add_tensors() = Tensor(0, 50, 0);                            // 5: empty, not read
  const std::vector<ReadRun> runs = PlanReadRuns(resp);
  EXPECT_EQ(TensorsOf(runs), (std::vector<std::vector<int>>{{1, 0, 2}, {3}, {4}}));
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].segment, 0u);
  EXPECT_EQ(runs[0].lo, 0u);
  EXPECT_EQ(runs[0].hi, 1110 + kReadMergeGap);
  EXPECT_EQ(runs[2].segment, 1u);
  EXPECT_EQ(runs[2].hi, 7u);
}

TEST(PlanReadRunsTest, NothingToReadForEmptyTensors) {
  v1::FetchResponse resp;
  *resp.add_tensors() = Tensor(0, 0, 0);
  EXPECT_TRUE(PlanReadRuns(resp).empty());
}

// A daemon that grants a lease on one 8-byte tensor and then streams its
// bytes as each test says.
class LyingShards final : public v1::Shards::Service {
 public:
  void SendChunks(std::vector<std::pair<uint64_t, std::string>> chunks) {
    absl::MutexLock lock(&mu_);
    chunks_ = std::move(chunks);
  }

  grpc::Status Fetch(grpc::ServerContext*, const v1::FetchRequest*,
                     v1::FetchResponse* resp) override {
    resp->set_lease_id(7);
    resp->set_token(std::string(16, 't'));
    resp->add_segment_sizes(8);
    v1::ShardTensor* t = resp->add_tensors();
    t->set_name("w");
    t->set_dtype(v1::F32);
    t->add_shape(2);
    t->set_length(8);
    return grpc::Status::OK;
  }
  grpc::Status Read(grpc::ServerContext*, const v1::ReadRequest*,
                    grpc::ServerWriter<v1::ReadChunk>* writer) override {
    std::vector<std::pair<uint64_t, std::string>> chunks;
    {
      absl::MutexLock lock(&mu_);
      chunks = chunks_;
    }
    for (const auto& [offset, data] : chunks) {
      v1::ReadChunk c;
      c.set_offset(offset);
      c.set_data(data);
      if (!writer->Write(c)) break;
    }
    return grpc::Status::OK;
  }
  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest*,
                       v1::ReleaseResponse*) override {
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::string>> chunks_ ABSL_GUARDED_BY(mu_);
};

class GrpcTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "/grpc_read_test." + std::to_string(::getpid()) + ".sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + path_, grpc::InsecureServerCredentials());
    builder.RegisterService(&daemon_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto client = Client::Connect({.socket = path_, .retry_deadline = absl::ZeroDuration()});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown();
    ::unlink(path_.c_str());
  }

  absl::StatusOr<std::unique_ptr<ShardSet>> Fetch() {
    return client_->Fetch({.model = "m", .transport = Transport::kGrpc});
  }

  std::string path_;
  LyingShards daemon_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(GrpcTransportTest, ChunksInOrderMakeTheTensor) {
  daemon_.SendChunks({{0, "abcd"}, {4, "efgh"}});
  auto set = Fetch();
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ((*set)->tensors().size(), 1u);
  const TensorView& t = (*set)->tensors()[0];
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(t.data), t.length), "abcdefgh");
}

// The daemon's peer client and this one read chunks with the same loop
// (common/grpc/chunk_stream.h): bytes out of order are DATA_LOSS in both
// (this client said INTERNAL before).
TEST_F(GrpcTransportTest, AChunkOutOfOrderIsDataLoss) {
  daemon_.SendChunks({{0, "abcd"}, {5, "fgh"}});
  auto set = Fetch();
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kDataLoss) << set.status();
}

TEST_F(GrpcTransportTest, AChunkPastTheTensorIsDataLoss) {
  daemon_.SendChunks({{0, "abcd"}, {4, "efghijkl"}});
  auto set = Fetch();
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kDataLoss) << set.status();
}

TEST_F(GrpcTransportTest, AShortStreamIsDataLoss) {
  daemon_.SendChunks({{0, "abcd"}});
  auto set = Fetch();
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kDataLoss) << set.status();
}

}  // namespace
}  // namespace weightd
