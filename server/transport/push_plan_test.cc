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
