#include "server/transport/push_plan.h"

#include <vector>

#include <gtest/gtest.h>

namespace weightd {
namespace {

PushLayout Layout(std::vector<uint64_t> offsets, std::vector<uint64_t> lengths) {
  PushLayout l;
  l.offsets = std::move(offsets);
  l.lengths = std::move(lengths);
  for (size_t i = 0; i < l.offsets.size(); ++i) {
    l.size = std::max(l.size, l.offsets[i] + l.lengths[i]);
  }
  return l;
}

bool operator==(const PushCopy& a, const PushCopy& b) {
  return a.buffer == b.buffer && a.src_offset == b.src_offset && a.dst_offset == b.dst_offset &&
         a.length == b.length && a.stream == b.stream;
}

TEST(PlanPushCopiesTest, MergesTensorsBackToBackInSourceAndDestinationOnly) {
  // t0, t1 adjacent everywhere (256 + 256); t2 follows t1 in the source but
  // the destination pads before it; t3 is in another buffer; t4 is empty.
  std::vector<LeaseTensor> tensors = {
      {0, 0, 256}, {0, 256, 256}, {0, 512, 100}, {1, 0, 300}, {0, 612, 0}};
  PushLayout layout = Layout({0, 256, 768, 1024, 1536}, {256, 256, 100, 300, 0});
  std::vector<PushCopy> plan = PlanPushCopies(tensors, layout, {});
  std::vector<PushCopy> want = {
      {0, 0, 0, 512, 0}, {0, 512, 768, 100, 0}, {1, 0, 1024, 300, 0}};
  ASSERT_EQ(plan.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(plan[i] == want[i]) << i;
}

TEST(PlanPushCopiesTest, CutsLargeRunsAndBalancesStreams) {
  std::vector<LeaseTensor> tensors = {{0, 0, 1000}, {0, 5000, 300}};
  PushLayout layout = Layout({0, 1024}, {1000, 300});
  std::vector<PushCopy> plan = PlanPushCopies(tensors, layout, {.max_copy_bytes = 400, .streams = 2});
  std::vector<PushCopy> want = {{0, 0, 0, 400, 0},
                                {0, 400, 400, 400, 1},
                                {0, 800, 800, 200, 0},
                                {0, 5000, 1024, 300, 1}};
  ASSERT_EQ(plan.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(plan[i] == want[i]) << i;
}

LeaseTensor Cast(uint32_t buffer, uint64_t offset, uint64_t length, DType src, DType dst) {
  LeaseTensor t{buffer, offset, length};
  t.cast = true;
  t.src_dtype = src;
  t.dst_dtype = dst;
  return t;
}

TEST(PlanPushCopiesTest, CastsAreNeverJoinedAndAreCutOnElements) {
  // t0 plain, t1 a BF16 -> F32 cast right after it in source and (by
  // offsets) destination, t2 plain after t1: no run crosses the cast.
  // 100 BF16 elements (200 bytes) become 400 bytes; with 96-byte scratch a
  // piece holds 24 elements (96 bytes of F32 output, 48 of source).
  std::vector<LeaseTensor> tensors = {{0, 0, 64}, Cast(0, 64, 200, DType::kBF16, DType::kF32),
                                      {0, 264, 64}};
  EXPECT_EQ(PushLength(tensors[1]), 400u);
  PushLayout layout = Layout({0, 64, 464}, {64, 400, 64});
  std::vector<PushCopy> plan =
      PlanPushCopies(tensors, layout, {.max_copy_bytes = 1000, .max_cast_bytes = 96});
  ASSERT_EQ(plan.size(), 1u + 5u + 1u);
  EXPECT_FALSE(plan[0].cast);
  EXPECT_EQ(plan[0].length, 64u);
  uint64_t src = 64, dst = 64, elements = 0;
  for (size_t i = 1; i <= 5; ++i) {
    const PushCopy& c = plan[i];
    EXPECT_TRUE(c.cast);
    EXPECT_EQ(c.src_dtype, DType::kBF16);
    EXPECT_EQ(c.dst_dtype, DType::kF32);
    EXPECT_EQ(c.src_offset, src);
    EXPECT_EQ(c.dst_offset, dst);
    EXPECT_EQ(c.dst_length, c.length * 2);
    EXPECT_LE(c.dst_length, 96u);
    EXPECT_EQ(c.length % 2, 0u);
    src += c.length;
    dst += c.dst_length;
    elements += c.length / 2;
  }
  EXPECT_EQ(elements, 100u);
  EXPECT_FALSE(plan[6].cast);
  EXPECT_EQ(plan[6].src_offset, 264u);
  EXPECT_EQ(plan[6].dst_offset, 464u);
}

TEST(PlanPushCopiesTest, NarrowingCastsAreLimitedByTheirSourceAndBalancedByTheLarger) {
  // F64 -> F16: 10 elements, 80 bytes in, 20 out; 32-byte scratch = 4
  // elements a piece; two streams take 32, 32, 16 source bytes in turn.
  std::vector<LeaseTensor> tensors = {Cast(0, 0, 80, DType::kF64, DType::kF16)};
  PushLayout layout = Layout({0}, {20});
  std::vector<PushCopy> plan =
      PlanPushCopies(tensors, layout, {.streams = 2, .max_cast_bytes = 32});
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].length, 32u);
  EXPECT_EQ(plan[0].dst_length, 8u);
  EXPECT_EQ(plan[0].stream, 0);
  EXPECT_EQ(plan[1].stream, 1);
  EXPECT_EQ(plan[2].length, 16u);
  EXPECT_EQ(plan[2].dst_offset, 16u);
  EXPECT_EQ(plan[2].stream, 0);
  // A scratch smaller than one element still takes one a piece.
  plan = PlanPushCopies(tensors, layout, {.max_cast_bytes = 3});
  EXPECT_EQ(plan.size(), 10u);
}

TEST(PlanPushCopiesTest, CheckLeaseTensorsRefusesACastThatCannotBe) {
  LeaseContents lease;
  lease.buffers.push_back(nullptr);
  auto tensors = std::make_shared<std::vector<LeaseTensor>>();
  tensors->push_back(Cast(0, 0, 0, DType::kI64, DType::kF32));  // empty: no buffer read
  lease.tensors = tensors;
  EXPECT_EQ(CheckLeaseTensors(lease).code(), absl::StatusCode::kInternal);
}

TEST(PlanPushCopiesTest, EveryByteOnceInDestinationOrderWhateverTheOffsets) {
  // The client's offsets, in reverse order of the tensors.
  std::vector<LeaseTensor> tensors = {{0, 0, 10}, {0, 10, 20}, {2, 7, 30}};
  PushLayout layout = Layout({4096, 2048, 0}, {10, 20, 30});
  std::vector<PushCopy> plan = PlanPushCopies(tensors, layout, {.max_copy_bytes = 7, .streams = 3});
  uint64_t total = 0, last_dst = 0;
  for (const PushCopy& c : plan) {
    EXPECT_LE(c.length, 7u);
    EXPECT_GE(c.dst_offset, last_dst);
    last_dst = c.dst_offset;
    total += c.length;
    EXPECT_GE(c.stream, 0);
    EXPECT_LT(c.stream, 3);
  }
  EXPECT_EQ(total, 60u);
  EXPECT_EQ(plan.front().buffer, 2u);
  EXPECT_EQ(plan.front().src_offset, 7u);
  EXPECT_TRUE(PlanPushCopies({}, PushLayout{}, {}).empty());
}

}  // namespace
}  // namespace weightd
