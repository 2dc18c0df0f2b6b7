// PublishService without a daemon: a session begun on a real model (loaded
// by a real WeightService from a safetensors file), written in runs, staged,
// committed through the commit hook (called once, by the write that
// completes it), aborted, capped and idled out — the session layer's
// contract (weight_service.h, "Publishing new base weights") checked on
// its own, with a commit hook that records what it was handed.
#include "server/publish/publish_service.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"
#include "server/engine/weight_service.h"

namespace weightd {
namespace {

class PublishServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/publish_service_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    // "w": F32 [4, 2] (32 bytes); "b": F32 [2] (8 bytes).
    const std::vector<float> w(8, 1.0f), b(2, 2.0f);
    path_ = root_ + "/m.safetensors";
    ASSERT_TRUE(WriteSafetensorsFile(path_, {{"w", DType::kF32, {4, 2}, F32Bytes(w)},
                                             {"b", DType::kF32, {2}, F32Bytes(b)}})
                    .ok());
    WeightServiceOptions options;
    options.model_roots = {root_};
    auto service = WeightService::Create(std::move(options));
    ASSERT_TRUE(service.ok()) << service.status();
    models_ = std::move(*service);
    ASSERT_TRUE(models_->LoadModel("m", path_, "", nullptr).ok());
  }
  void TearDown() override {
    publish_.reset();
    staging_.reset();
    models_.reset();
    ::unlink(path_.c_str());
    ::rmdir(root_.c_str());
  }

  // The service under test, with these caps and idle timeout; its commit
  // hook records the session's bytes and answers generation 2.
  void Start(PublishSlots::Limits limits, absl::Duration idle = absl::Minutes(5)) {
    staging_ = std::make_unique<StagingReserve>(StagingReserve::Options{
        .enabled = false, .memory = models_->host_memory(), .still_loaded = nullptr});
    publish_ = std::make_unique<PublishService>(PublishService::Options{
        .memory = models_->host_memory(),
        .access = &models_->access(),
        .staging = staging_.get(),
        .limits = limits,
        .idle_timeout = idle,
        .find_model = [this](const std::string& name) {
          return models_->catalog()->FindModel(name);
        },
        .commit = [this](PublishSession& session, const std::optional<Principal>&)
            -> absl::StatusOr<PublishResult> {
          ++commits_;
          committed_.assign(reinterpret_cast<const char*>(session.base),
                            session.bytes_total == 0 ? 0 : session.layout.total);
          PublishResult result;
          result.tensors = session.specs.size();
          result.bytes = session.bytes_total;
          result.generation.generation = 2;
          return result;
        }});
  }
  static PublishBeginParams Params() {
    PublishBeginParams p;
    p.model = "m";
    p.tensors = {PublishTensorSpec{"w", DType::kF32, {4, 2}},
                 PublishTensorSpec{"b", DType::kF32, {2}}};
    return p;
  }

  std::string root_, path_;
  std::unique_ptr<WeightService> models_;
  std::unique_ptr<StagingReserve> staging_;
  std::unique_ptr<PublishService> publish_;
  int commits_ = 0;
  std::string committed_;
};

TEST_F(PublishServiceTest, TheWriteThatCompletesASessionCommitsItOnce) {
  Start({});
  auto info = publish_->Begin(Params());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->bytes, 40u);
  EXPECT_EQ(info->base_generation, 1u);
  EXPECT_EQ(publish_->OpenSessions(), 1u);
  const std::string w(32, 'w'), b(8, 'b');
  const PublishRun first[] = {{0, 0, 32}};
  auto progress = publish_->Write(std::nullopt, info->id, info->token, first, w, false);
  ASSERT_TRUE(progress.ok()) << progress.status();
  EXPECT_EQ(progress->bytes_done, 32u);
  EXPECT_FALSE(progress->result.has_value());
  // Not complete: the commit names what is missing and waits for nothing.
  auto early = publish_->Commit(std::nullopt, info->id, info->token, absl::ZeroDuration());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(commits_, 0);
  const PublishRun second[] = {{1, 0, 8}};
  progress = publish_->Write(std::nullopt, info->id, info->token, second, b, false);
  ASSERT_TRUE(progress.ok()) << progress.status();
  ASSERT_TRUE(progress->result.has_value());
  EXPECT_EQ(progress->result->generation.generation, 2u);
  EXPECT_EQ(commits_, 1);
  // Each tensor's bytes where the layout put them.
  EXPECT_EQ(committed_.substr(info->layout.offsets[0], 32), w);
  EXPECT_EQ(committed_.substr(info->layout.offsets[1], 8), b);
  // The result stays readable; the commit is not run again.
  auto result = publish_->Commit(std::nullopt, info->id, info->token, absl::Seconds(1));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->bytes, 40u);
  EXPECT_EQ(commits_, 1);
  EXPECT_EQ(publish_->OpenSessions(), 0u);
}

TEST_F(PublishServiceTest, TokensIdsAndSpecsAreChecked) {
  Start({});
  PublishBeginParams bad = Params();
  bad.tensors[0].shape = {8};
  EXPECT_EQ(publish_->Begin(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = Params();
  bad.tensors[0].name = "nope";
  EXPECT_EQ(publish_->Begin(bad).status().code(), absl::StatusCode::kNotFound);
  bad = Params();
  bad.model = "other";
  EXPECT_EQ(publish_->Begin(bad).status().code(), absl::StatusCode::kNotFound);
  auto info = publish_->Begin(Params());
  ASSERT_TRUE(info.ok()) << info.status();
  const PublishRun run[] = {{0, 0, 4}};
  EXPECT_EQ(publish_->Write(std::nullopt, info->id, "00", run, "abcd", false).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(publish_->Write(std::nullopt, info->id + 7, info->token, run, "abcd", false)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  // A run over bytes already written fails the session.
  ASSERT_TRUE(publish_->Write(std::nullopt, info->id, info->token, run, "abcd", false).ok());
  auto twice = publish_->Write(std::nullopt, info->id, info->token, run, "abcd", false);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(publish_->Commit(std::nullopt, info->id, info->token, absl::ZeroDuration())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(publish_->OpenSessions(), 0u);
  EXPECT_EQ(commits_, 0);
}

TEST_F(PublishServiceTest, AbortedSessionsGiveTheirSlotBack) {
  Start({.total = 1, .per_caller = 1});
  auto first = publish_->Begin(Params());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(publish_->Begin(Params()).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(publish_->Abort(std::nullopt, first->id, first->token).ok());
  const PublishRun run[] = {{0, 0, 4}};
  EXPECT_FALSE(publish_->Write(std::nullopt, first->id, first->token, run, "abcd", false).ok());
  auto second = publish_->Begin(Params());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(commits_, 0);
}

TEST_F(PublishServiceTest, StagedBytesWrittenInPlaceCommit) {
  Start({});
  auto info = publish_->Begin(Params());
  ASSERT_TRUE(info.ok()) << info.status();
  auto fd = publish_->Stage(std::nullopt, info->id, info->token);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const std::string w(32, 'x'), b(8, 'y');
  ASSERT_EQ(::pwrite(fd->get(), w.data(), 32, info->layout.offsets[0]), 32);
  ASSERT_EQ(::pwrite(fd->get(), b.data(), 8, info->layout.offsets[1]), 8);
  // Runs written in place carry no data.
  const PublishRun runs[] = {{0, 0, 32}, {1, 0, 8}};
  auto progress = publish_->Write(std::nullopt, info->id, info->token, runs, "", true);
  ASSERT_TRUE(progress.ok()) << progress.status();
  ASSERT_TRUE(progress->result.has_value());
  EXPECT_EQ(commits_, 1);
  EXPECT_EQ(committed_.substr(info->layout.offsets[0], 32), w);
  EXPECT_EQ(committed_.substr(info->layout.offsets[1], 8), b);
}

TEST_F(PublishServiceTest, InPlaceWritesNeedTheStagingHandedOutAndCarryNoData) {
  Start({});
  auto info = publish_->Begin(Params());
  ASSERT_TRUE(info.ok()) << info.status();
  const PublishRun runs[] = {{0, 0, 32}, {1, 0, 8}};
  // No writer took the staging memfd: refused, the session still open.
  EXPECT_EQ(publish_->Write(std::nullopt, info->id, info->token, runs, "", true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(publish_->OpenSessions(), 1u);
  ASSERT_TRUE(publish_->Stage(std::nullopt, info->id, info->token).ok());
  // Data with runs declared written in place: the session fails.
  EXPECT_EQ(publish_->Write(std::nullopt, info->id, info->token, runs, "x", true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(publish_->OpenSessions(), 0u);
  EXPECT_EQ(commits_, 0);
}

TEST_F(PublishServiceTest, AnIdleSessionEndsAndFreesItsSlot) {
  Start({.total = 1, .per_caller = 1}, absl::Milliseconds(1));
  auto info = publish_->Begin(Params());
  ASSERT_TRUE(info.ok()) << info.status();
  absl::SleepFor(absl::Milliseconds(20));
  publish_->Expire();
  EXPECT_EQ(publish_->OpenSessions(), 0u);
  EXPECT_EQ(publish_->Commit(std::nullopt, info->id, info->token, absl::ZeroDuration())
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(publish_->Begin(Params()).ok());
}

}  // namespace
}  // namespace weightd
