#include "server/publish/publish_plan.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace weightd {
namespace {

TEST(LayoutPublish, AlignsEveryTensorAndRefusesRepeatsAndEmptyLists) {
  std::vector<PublishTensorSpec> specs = {{"a", DType::kBF16, {3}},      // 6 bytes
                                          {"b", DType::kF32, {2, 2}},    // 16 bytes
                                          {"c", DType::kF16, {0, 4}},    // 0 bytes
                                          {"d", DType::kF32, {}}};       // 4 bytes
  auto layout = LayoutPublish(specs);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->offsets, (std::vector<uint64_t>{0, 256, 512, 512}));
  EXPECT_EQ(layout->total, 516u);

  specs.push_back({"b", DType::kF32, {1}});
  auto twice = LayoutPublish(specs);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.status().message(), "\"b\" is published twice"));
  EXPECT_EQ(LayoutPublish({}).status().code(), absl::StatusCode::kInvalidArgument);
  auto huge = LayoutPublish({{"h", DType::kF32, {int64_t{1} << 62, 4}}});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "\"h\""));
  auto negative = LayoutPublish({{"n", DType::kF32, {-1}}});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RangeCoverage, EveryByteExactlyOnceInAnyOrder) {
  RangeCoverage c(100);
  EXPECT_EQ(c.FirstGap(), std::make_pair(uint64_t{0}, uint64_t{100}));
  ASSERT_TRUE(c.Add(40, 20).ok());
  ASSERT_TRUE(c.Add(0, 10).ok());
  EXPECT_EQ(c.covered(), 30u);
  EXPECT_EQ(c.FirstGap(), std::make_pair(uint64_t{10}, uint64_t{40}));
  // Overlaps on either side, inside, around; past the end.
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {5, 10}, {35, 10}, {45, 5}, {30, 40}, {59, 2}, {90, 11}, {~uint64_t{0} - 2, 5}}) {
    absl::Status s = c.Add(off, len);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << off << "+" << len;
  }
  EXPECT_TRUE(absl::StrContains(c.Add(50, 20).message(), "bytes [50, 70) overlap bytes [40, 60)"));
  EXPECT_EQ(c.covered(), 30u);  // refusals record nothing
  ASSERT_TRUE(c.Add(10, 30).ok());  // joins both neighbours
  ASSERT_TRUE(c.Add(60, 0).ok());
  EXPECT_EQ(c.FirstGap(), std::make_pair(uint64_t{60}, uint64_t{100}));
  ASSERT_TRUE(c.Add(80, 20).ok());
  ASSERT_TRUE(c.Add(60, 20).ok());
  EXPECT_TRUE(c.complete());
  EXPECT_FALSE(c.FirstGap().has_value());
  EXPECT_FALSE(c.Add(0, 1).ok());

  RangeCoverage empty(0);
  EXPECT_TRUE(empty.complete());
}

TEST(SplitParts, ConcatenatedAlongDimZero) {
  auto parts = SplitParts({6, 4}, DType::kBF16, {2, 3, 1});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].offset, 0u);
  EXPECT_EQ(parts[0].length, 16u);
  EXPECT_EQ(parts[1].offset, 16u);
  EXPECT_EQ(parts[1].length, 24u);
  EXPECT_EQ(parts[2].offset, 40u);
  EXPECT_EQ(parts[2].length, 8u);
  auto scalar = SplitParts({}, DType::kF32, {1});
  EXPECT_EQ(scalar[0].length, 4u);
}

}  // namespace
}  // namespace weightd
