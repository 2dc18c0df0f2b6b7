#include "common/grpc/chunk_stream.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

// A real gRPC server playing the sender: each test scripts what its Read
// stream sends.
class ScriptedShards final : public v1::Shards::Service {
 public:
  using Script = std::function<grpc::Status(grpc::ServerContext*,
                                            grpc::ServerWriter<v1::ReadChunk>*)>;

  void Set(Script script) {
    absl::MutexLock lock(&mu_);
    script_ = std::move(script);
  }

  grpc::Status Read(grpc::ServerContext* ctx, const v1::ReadRequest*,
                    grpc::ServerWriter<v1::ReadChunk>* writer) override {
    Script script;
    {
      absl::MutexLock lock(&mu_);
      script = script_;
    }
    return script(ctx, writer);
  }

 private:
  absl::Mutex mu_;
  Script script_ ABSL_GUARDED_BY(mu_);
};

v1::ReadChunk Chunk(uint64_t offset, const std::string& data) {
  v1::ReadChunk c;
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

// Sends `chunks` in order, then OK.
ScriptedShards::Script Sends(std::vector<v1::ReadChunk> chunks) {
  return [chunks](grpc::ServerContext*, grpc::ServerWriter<v1::ReadChunk>* w) {
    for (const v1::ReadChunk& c : chunks) {
      if (!w->Write(c)) break;
    }
    return grpc::Status::OK;
  };
}

class ChunkStreamTest : public ::testing::Test {
 protected:
  static constexpr int kMaxMessage = 64 << 10;

  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    builder.SetMaxSendMessageSize(4 << 20);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    stub_ = v1::Shards::NewStub(server_->InProcessChannel(args));
  }
  void TearDown() override { server_->Shutdown(); }

  // Reads `length` bytes into a buffer with guard bytes on both sides;
  // `bytes` gets the range, and the guards must be untouched.
  absl::Status Read(uint64_t length, std::string* bytes,
                    absl::Duration deadline = absl::Seconds(30)) {
    std::string buffer(length + 2 * kGuard, '\xAB');
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
    auto reader = stub_->Read(&ctx, v1::ReadRequest());
    absl::Status s =
        ReadChunksInto(ctx, *reader, length, reinterpret_cast<uint8_t*>(buffer.data()) + kGuard,
                       ChunkSender{"the daemon (segment 0)", ""});
    EXPECT_EQ(buffer.substr(0, kGuard), std::string(kGuard, '\xAB'));
    EXPECT_EQ(buffer.substr(kGuard + length), std::string(kGuard, '\xAB'));
    *bytes = buffer.substr(kGuard, length);
    return s;
  }

  static constexpr size_t kGuard = 64;
  ScriptedShards service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Shards::Stub> stub_;
};

TEST_F(ChunkStreamTest, OrderedChunksFillTheRange) {
  service_.Set(Sends({Chunk(0, "abc"), Chunk(3, ""), Chunk(3, "defg"), Chunk(7, "h")}));
  std::string got;
  ASSERT_TRUE(Read(8, &got).ok());
  EXPECT_EQ(got, "abcdefgh");
}

TEST_F(ChunkStreamTest, AnEmptyRangeTakesAnEmptyStream) {
  service_.Set(Sends({}));
  std::string got;
  EXPECT_TRUE(Read(0, &got).ok());
}

TEST_F(ChunkStreamTest, AChunkAheadOfItsPlaceIsDataLoss) {
  service_.Set(Sends({Chunk(0, "abc"), Chunk(4, "efgh")}));
  std::string got;
  absl::Status s = Read(8, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(),
            "the daemon (segment 0) sent bytes 4+4 of a range of 8 where 3 was next");
}

TEST_F(ChunkStreamTest, AChunkRepeatingBytesIsDataLoss) {
  service_.Set(Sends({Chunk(0, "abcd"), Chunk(2, "cdef")}));
  std::string got;
  EXPECT_EQ(Read(8, &got).code(), absl::StatusCode::kDataLoss);
}

TEST_F(ChunkStreamTest, AChunkRunningPastTheRangeIsDataLossAndWritesNothingPastIt) {
  service_.Set(Sends({Chunk(0, "abcd"), Chunk(4, "efghijkl")}));
  std::string got;
  absl::Status s = Read(6, &got);  // Read checks the guard bytes
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(got.substr(0, 4), "abcd");
  EXPECT_EQ(got.substr(4), "\xAB\xAB");  // the long chunk is not copied at all
}

TEST_F(ChunkStreamTest, BytesAfterTheWholeRangeAreDataLoss) {
  service_.Set(Sends({Chunk(0, "abcd"), Chunk(4, "e")}));
  std::string got;
  EXPECT_EQ(Read(4, &got).code(), absl::StatusCode::kDataLoss);
}

TEST_F(ChunkStreamTest, AStreamEndingShortIsDataLoss) {
  service_.Set(Sends({Chunk(0, "abc")}));
  std::string got;
  absl::Status s = Read(8, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(), "the daemon (segment 0) sent 3 of 8 bytes");
}

TEST_F(ChunkStreamTest, AChunkOverTheReceiveLimitFailsTheCall) {
  service_.Set(Sends({Chunk(0, std::string(2 * kMaxMessage, 'x'))}));
  std::string got;
  EXPECT_EQ(Read(2 * kMaxMessage, &got).code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(ChunkStreamTest, TheSendersErrorKeepsItsCodeAndGetsTheContext) {
  service_.Set([](grpc::ServerContext*, grpc::ServerWriter<v1::ReadChunk>* w) {
    w->Write(Chunk(0, "ab"));
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "no lease 7");
  });
  std::string got;
  EXPECT_EQ(Read(4, &got), absl::NotFoundError("no lease 7"));

  grpc::ClientContext ctx;
  auto reader = stub_->Read(&ctx, v1::ReadRequest());
  std::string buffer(4, '\0');
  absl::Status s = ReadChunksInto(ctx, *reader, 4, reinterpret_cast<uint8_t*>(buffer.data()),
                                  ChunkSender{"peer p:1", "reading from peer p:1"});
  EXPECT_EQ(s, absl::NotFoundError("reading from peer p:1: no lease 7"));
}

TEST_F(ChunkStreamTest, AStreamTheSenderCancelsIsCancelled) {
  service_.Set([](grpc::ServerContext*, grpc::ServerWriter<v1::ReadChunk>* w) {
    w->Write(Chunk(0, "ab"));
    return grpc::Status(grpc::StatusCode::CANCELLED, "draining");
  });
  std::string got;
  EXPECT_EQ(Read(4, &got).code(), absl::StatusCode::kCancelled);
}

TEST_F(ChunkStreamTest, AStalledStreamEndsAtTheDeadline) {
  service_.Set([](grpc::ServerContext* ctx, grpc::ServerWriter<v1::ReadChunk>* w) {
    w->Write(Chunk(0, "ab"));
    while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status::OK;
  });
  std::string got;
  absl::Status s = Read(4, &got, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

TEST_F(ChunkStreamTest, ABadChunkCancelsTheCall) {
  // The sender would go on for ever: the reader cancels the call at the
  // first bad chunk and returns, and the sender sees the cancel.
  absl::Notification cancelled;
  service_.Set([&](grpc::ServerContext* ctx, grpc::ServerWriter<v1::ReadChunk>* w) {
    w->Write(Chunk(1, "a"));
    while (!ctx->IsCancelled()) {
      w->Write(Chunk(0, std::string(1024, 'y')));
      absl::SleepFor(absl::Milliseconds(1));
    }
    cancelled.Notify();
    return grpc::Status::OK;
  });
  std::string got;
  EXPECT_EQ(Read(1 << 20, &got).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

}  // namespace
}  // namespace weightd
