// The writer set (push_writer.h), the host writer (host_push_writer.h) and
// the job both push paths run (push_plan.h MakePushJob).
#include "server/push/push_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/memory/segment.h"
#include "server/memory/test_buffers.h"
#include "server/push/host_push_writer.h"
#include "server/push/push_plan.h"

namespace weightd {
namespace {

// Says "not me" to everything, or serves everything with `answer`; counts
// what it was asked.
class CountingWriter final : public PushWriter {
 public:
  explicit CountingWriter(std::optional<absl::Status> answer) : answer_(std::move(answer)) {}
  std::optional<absl::Status> Push(const LeaseContents&, const PushLayout&, const PushTarget&,
                                   const std::atomic<bool>*) const override {
    ++pushes;
    return answer_;
  }
  std::optional<absl::StatusOr<ExportPlan>> PlanExport(
      std::shared_ptr<const LeaseContents>, const PushLayout&, const CudaPushTarget&,
      const std::atomic<bool>*) const override {
    ++exports;
    if (!answer_.has_value()) return std::nullopt;
    if (!answer_->ok()) return absl::StatusOr<ExportPlan>(*answer_);
    return ExportPlan{.device = "mine"};
  }
  mutable int pushes = 0;
  mutable int exports = 0;

 private:
  const std::optional<absl::Status> answer_;
};

TEST(PushWritersTest, TheFirstWriterThatIsNotNotMeAnswers) {
  auto none = std::make_shared<CountingWriter>(std::nullopt);
  auto busy = std::make_shared<CountingWriter>(absl::AbortedError("busy"));
  auto after = std::make_shared<CountingWriter>(absl::OkStatus());
  PushWriters writers({none, busy, after});
  LeaseContents lease;
  absl::Status s = writers.Push(lease, PushLayout{}, PushTarget{}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(none->pushes, 1);
  EXPECT_EQ(busy->pushes, 1);
  EXPECT_EQ(after->pushes, 0);
  auto plan = writers.PlanExport(nullptr, PushLayout{}, CudaPushTarget{}, nullptr);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(after->exports, 0);
}

TEST(PushWritersTest, NoWriterForTheTargetIsUnimplemented) {
  PushWriters writers({std::make_shared<CountingWriter>(std::nullopt)});
  LeaseContents lease;
  PushTarget cuda{.cuda = CudaPushTarget{}};
  absl::Status gpu = writers.Push(lease, PushLayout{}, cuda, nullptr);
  EXPECT_EQ(gpu.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(gpu.message(), "this data socket pushes into no GPU memory");
  absl::Status host = writers.Push(lease, PushLayout{}, PushTarget{}, nullptr);
  EXPECT_EQ(host.message(), "this data socket pushes into no host memory");
  auto plan = writers.PlanExport(nullptr, PushLayout{}, CudaPushTarget{}, nullptr);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(PushWriters({}).Push(lease, PushLayout{}, PushTarget{}, nullptr).code() ==
              absl::StatusCode::kUnimplemented);
}

BufferPtr Bytes1000() {
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "src", 1000, false);
  EXPECT_TRUE(seg.ok());
  for (int k = 0; k < 1000; ++k) (*seg)->mutable_data()[k] = static_cast<uint8_t>(k % 251);
  EXPECT_TRUE((*seg)->Seal().ok());
  return SegmentPtr(std::move(*seg));
}

std::shared_ptr<const LeaseContents> Lease() {
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{{0, 0, 600}, {0, 600, 400}});
  return std::make_shared<LeaseContents>(
      LeaseContents{.buffers = {Bytes1000()}, .tensors = tensors});
}

TEST(HostPushWriterTest, ServesHostPushesAndTheHostTwinOnly) {
  HostMemoryManager memory({.limit_bytes = uint64_t{64} << 20});
  HostPushWriter writer(&memory);
  auto lease = Lease();
  absl::StatusOr<PushLayout> layout = LayoutForPush(*lease, {});
  ASSERT_TRUE(layout.ok());
  // A CUDA push, an export to a GPU: not this writer's.
  CudaPushTarget gpu{};
  gpu.gpu_uuid[3] = 7;
  EXPECT_FALSE(writer.Push(*lease, *layout, PushTarget{.cuda = gpu}, nullptr).has_value());
  EXPECT_FALSE(writer.PlanExport(lease, *layout, gpu, nullptr).has_value());
  // A host push into a memfd.
  UniqueFd dest(::memfd_create("dest", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(dest.get(), 4096), 0);
  ASSERT_EQ(::posix_fallocate(dest.get(), 0, 4096), 0);
  ASSERT_EQ(::fcntl(dest.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  std::optional<absl::Status> pushed =
      writer.Push(*lease, *layout, PushTarget{.fd = dest.get()}, nullptr);
  ASSERT_TRUE(pushed.has_value());
  EXPECT_TRUE(pushed->ok()) << *pushed;
  // The host twin: a page-rounded segment of the budget, half of it the
  // default budget, filled and sealed.
  std::optional<absl::StatusOr<ExportPlan>> plan =
      writer.PlanExport(lease, *layout, CudaPushTarget{}, nullptr);
  ASSERT_TRUE(plan.has_value());
  ASSERT_TRUE(plan->ok()) << plan->status();
  EXPECT_EQ((*plan)->device, "host");
  EXPECT_EQ((*plan)->size, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  EXPECT_EQ((*plan)->default_budget, uint64_t{32} << 20);
  lease.reset();  // the plan holds what it fills from
  absl::StatusOr<std::unique_ptr<ExportedBuffer>> filled = (*plan)->fill();
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_NE(::fcntl((*filled)->export_fd(), F_GET_SEALS) & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE), 0);
  std::string pushed_bytes(1168, '\0'), exported(1168, '\0');
  ASSERT_EQ(::pread(dest.get(), pushed_bytes.data(), 1168, 0), 1168);
  ASSERT_EQ(::pread((*filled)->export_fd(), exported.data(), 1168, 0), 1168);
  EXPECT_EQ(pushed_bytes, exported);
  EXPECT_EQ(static_cast<uint8_t>(exported[768]), 600 % 251);
  EXPECT_EQ(memory.account()->used(), (*filled)->size);
}

TEST(MakePushJobTest, PiecesPointIntoTheLeaseAndMergesAreFlattenedOnce) {
  auto lease = Lease();
  auto merge = std::make_shared<PushMerge>();
  merge->cols = 5;
  std::vector<float> v(50, 1.0f);
  MergeTerm add;
  add.kind = MergeTerm::kAdd;
  add.v = v.data();
  add.v_len = v.size();
  merge->terms = {add};
  // An F32 -> BF16 merged tensor of 10 rows x 5: bytes [800, 1000).
  LeaseTensor merged{0, 800, 200};
  merged.cast = true;
  merged.src_dtype = DType::kF32;
  merged.dst_dtype = DType::kBF16;
  merged.merge = merge;
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{{0, 0, 600}, merged});
  LeaseContents contents{.buffers = lease->buffers, .tensors = tensors};
  absl::StatusOr<PushLayout> layout = LayoutForPush(contents, {});
  ASSERT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<PushJob> job =
      MakePushJob(contents, *layout, {.streams = 2, .max_cast_bytes = 3});
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->size, layout->size);
  EXPECT_EQ(job->streams, 2);
  // One element a piece at least: the scratch is what the widest takes.
  EXPECT_EQ(job->max_cast_bytes, 4u);
  ASSERT_EQ(job->merges.size(), 1u);
  EXPECT_EQ(job->merges[0].cols, 5);
  EXPECT_EQ(job->merges[0].terms, merge->terms.data());
  EXPECT_EQ(job->merges[0].num_terms, 1u);
  ASSERT_EQ(job->copies.size(), 1u + 50u);
  const uint8_t* base = lease->buffers[0]->host_data();
  EXPECT_EQ(job->copies[0].src, base);
  EXPECT_EQ(job->copies[0].merge, -1);
  for (size_t i = 1; i < job->copies.size(); ++i) {
    EXPECT_EQ(job->copies[i].src, base + 800 + 4 * (i - 1)) << i;
    EXPECT_EQ(job->copies[i].merge, 0) << i;
    EXPECT_EQ(job->copies[i].first_element, i - 1);
  }
  // A layout that is not the lease's.
  PushLayout other = *layout;
  other.offsets.pop_back();
  EXPECT_EQ(MakePushJob(contents, other, {}).status().code(), absl::StatusCode::kInternal);
  // A source the CPU cannot address (the writers refuse it first).
  LeaseContents device{.buffers = {std::make_shared<FakeDeviceBuffer>(false)},
                       .tensors = std::make_shared<std::vector<LeaseTensor>>(
                           std::vector<LeaseTensor>{{0, 0, 16}})};
  absl::StatusOr<PushLayout> small = LayoutForPush(device, {});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(MakePushJob(device, *small, {}).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace weightd
