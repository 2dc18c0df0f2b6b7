// WDP1 and WDC1 through a real DataServer (push_request.cc): the request
// read whole, the lease attached, the push handed to the writer that serves
// its target (server/push/push_writer.h) and answered.
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "server/transport/data_server_testing.h"

namespace weightd::testing {
namespace {

// A writer of "GPU" memory for the tests: serves CUDA pushes (not exports),
// writes the lease's bytes into the fd it was handed as a host push would,
// and records what it was asked.
class RecordingCudaWriter final : public PushWriter {
 public:
  struct Call {
    uint64_t layout_size = 0;
    uint64_t target_size = 0;
    bool had_fd = false;
  };

  std::optional<absl::Status> Push(const LeaseContents& lease, const PushLayout& layout,
                                   const PushTarget& target,
                                   const std::atomic<bool>* cancel) const override {
    if (!target.cuda.has_value() || target.cuda->handle_kind == kCudaDaemonExport) {
      return std::nullopt;
    }
    absl::MutexLock lock(&mu_);
    calls_.push_back({layout.size, target.cuda->size, target.fd >= 0});
    return absl::OkStatus();
  }
  std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents>, const PushLayout&, const CudaPushTarget&,
      const std::atomic<bool>*) const override {
    return std::nullopt;
  }
  std::vector<Call> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  mutable absl::Mutex mu_;
  mutable std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

std::string CudaTarget(uint64_t size, uint32_t kind) {
  CudaPushTarget t{};
  std::memset(t.gpu_uuid, 0x42, sizeof(t.gpu_uuid));
  t.size = size;
  t.handle_kind = kind;
  return Bytes(&t, sizeof(t));
}

class DataServerPushTest : public DataServerTest {
 protected:
  void StartWith(std::shared_ptr<const PushWriter> writer, size_t max_pushes_per_uid = 8) {
    DataServer::Options options;
    if (writer != nullptr) options.push_writers = {std::move(writer)};
    options.max_pushes_per_uid = max_pushes_per_uid;
    options.on_push = [this](uint64_t bytes) { pushed_.fetch_add(bytes); };
    Start(std::move(options));
  }
  // A lease of two tensors, 600 and 400 bytes of one segment.
  LeaseGrant Lease() {
    auto tensors = std::make_shared<std::vector<LeaseTensor>>(
        std::vector<LeaseTensor>{{0, 0, 600}, {0, 600, 400}});
    return leases_.Grant(LeaseContents{.buffers = {HostBuffer(1000)}, .tensors = tensors});
  }
  std::atomic<uint64_t> pushed_{0};
};

TEST_F(DataServerPushTest, EachPushGoesToTheWriterOfItsTarget) {
  auto gpu = std::make_shared<RecordingCudaWriter>();
  StartWith(gpu);
  LeaseGrant grant = Lease();
  UniqueFd c = Connect();
  // A host push: the host writer writes the memfd; the CUDA writer is not
  // asked to.
  UniqueFd dest = Destination(2048);
  ASSERT_TRUE(Exchange(c.get(), Header(kPushMagic, grant.id, grant.token), {dest.get()})
                  .status.ok());
  std::string got(1000, '\0');
  ASSERT_EQ(::pread(dest.get(), got.data(), 600, 0), 600);
  ASSERT_EQ(::pread(dest.get(), got.data() + 600, 400, 768), 400);  // the default layout
  for (int k = 0; k < 1000; ++k) ASSERT_EQ(static_cast<uint8_t>(got[k]), k % 251) << k;
  EXPECT_TRUE(gpu->calls().empty());
  // A CUDA push, its offsets after its target: the CUDA writer's.
  const uint64_t offsets[2] = {512, 0};
  UniqueFd vmm(::memfd_create("vmm", MFD_CLOEXEC));
  Reply r = Exchange(c.get(),
                     Header(kCudaPushMagic, grant.id, grant.token, 2) +
                         CudaTarget(4096, kCudaVmmPosixFd) + Bytes(offsets, sizeof(offsets)),
                     {vmm.get()});
  ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_EQ(gpu->calls().size(), 1u);
  EXPECT_EQ(gpu->calls()[0].layout_size, 1112u);  // 512 + 600
  EXPECT_EQ(gpu->calls()[0].target_size, 4096u);
  EXPECT_TRUE(gpu->calls()[0].had_fd);
  EXPECT_EQ(pushed_.load(), 2000u);
}

TEST_F(DataServerPushTest, WithoutAWriterForItsTargetAPushIsUnimplemented) {
  StartWith(nullptr);
  LeaseGrant grant = Lease();
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kCudaPushMagic, grant.id, grant.token) +
                                  CudaTarget(4096, kCudaLegacyIpc));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented) << r.status;
  EXPECT_EQ(r.status.message(), "this data socket pushes into no GPU memory");
  EXPECT_EQ(pushed_.load(), 0u);
  // The connection serves on: a host push is the host writer's.
  UniqueFd dest = Destination(2048);
  EXPECT_TRUE(Exchange(c.get(), Header(kPushMagic, grant.id, grant.token), {dest.get()})
                  .status.ok());
  EXPECT_EQ(pushed_.load(), 1000u);
}

TEST_F(DataServerPushTest, ARefusedCudaPushLeavesNothingToTheNextPush) {
  auto gpu = std::make_shared<RecordingCudaWriter>();
  StartWith(gpu);
  LeaseGrant grant = Lease();
  UniqueFd c = Connect();
  LeaseToken wrong = grant.token;
  wrong[0] ^= 1;
  // Its target read whole, its header refused (no offsets follow: the
  // connection serves on).
  Reply refused = Exchange(
      c.get(), Header(kCudaPushMagic, grant.id, wrong) + CudaTarget(4096, kCudaLegacyIpc));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kPermissionDenied) << refused.status;
  // The next request is a host push, not the CUDA push the last one was.
  UniqueFd dest = Destination(2048);
  EXPECT_TRUE(Exchange(c.get(), Header(kPushMagic, grant.id, grant.token), {dest.get()})
                  .status.ok());
  EXPECT_TRUE(gpu->calls().empty());
}

TEST_F(DataServerPushTest, OffsetsTrickledInPiecesAreReadWhole) {
  StartWith(nullptr);
  LeaseGrant grant = Lease();
  UniqueFd c = Connect();
  UniqueFd dest = Destination(4096);
  const uint64_t offsets[2] = {1024, 0};
  const std::string header = Header(kPushMagic, grant.id, grant.token, 2);
  int fd = dest.get();
  ASSERT_TRUE(SendWithFds(c.get(), header, {&fd, 1}).ok());
  const std::string rest = Bytes(offsets, sizeof(offsets));
  for (char byte : rest) {
    ASSERT_TRUE(SendAll(c.get(), &byte, 1).ok());
    absl::SleepFor(absl::Milliseconds(1));
  }
  Reply r = ReadReply(c.get());
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::string got(400, '\0');
  ASSERT_EQ(::pread(dest.get(), got.data(), got.size(), 0), 400);
  for (int k = 0; k < 400; ++k) ASSERT_EQ(static_cast<uint8_t>(got[k]), (600 + k) % 251) << k;
}

TEST_F(DataServerPushTest, AFailedPushIsAnsweredAndNotCounted) {
  StartWith(nullptr);
  LeaseGrant grant = Lease();
  UniqueFd c = Connect();
  // Too small for the layout.
  UniqueFd small = Destination(512);
  Reply r = Exchange(c.get(), Header(kPushMagic, grant.id, grant.token), {small.get()});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_EQ(pushed_.load(), 0u);
  // A push with two fds is refused before it is started.
  UniqueFd dest = Destination(2048);
  r = Exchange(c.get(), Header(kPushMagic, grant.id, grant.token), {dest.get(), dest.get()});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status.message(),
            "a push carries exactly one fd (its destination memfd); this one carried more");
}

}  // namespace
}  // namespace weightd::testing
