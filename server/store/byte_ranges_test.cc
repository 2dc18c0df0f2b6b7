// ByteRanges (byte_ranges.h) against a plain reference: one flag per byte.
#include "server/store/byte_ranges.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace weightd {
namespace {

TEST(ByteRangesTest, MergesAndCoversAsAByteMapDoes) {
  constexpr uint64_t kSize[] = {257, 64};
  std::vector<std::vector<char>> ref = {std::vector<char>(kSize[0]), std::vector<char>(kSize[1])};
  ByteRanges r(2);
  std::mt19937 rng(7);
  for (int step = 0; step < 400; ++step) {
    const size_t f = rng() % 2;
    const uint64_t b = rng() % kSize[f];
    const uint64_t n = rng() % std::min<uint64_t>(9, kSize[f] - b + 1);
    r.Add(f, b, n);
    for (uint64_t i = b; i < b + n; ++i) ref[f][i] = 1;

    uint64_t bytes = 0;
    std::vector<CheckpointRange> want;  // maximal runs of set bytes
    for (size_t g = 0; g < 2; ++g) {
      for (uint64_t i = 0; i < kSize[g]; ++i) {
        if (!ref[g][i]) continue;
        ++bytes;
        if (i > 0 && ref[g][i - 1]) {
          ++want.back().length;
        } else {
          want.push_back({static_cast<uint32_t>(g), i, 1});
        }
      }
    }
    ASSERT_EQ(r.bytes(), bytes) << "step " << step;
    const std::vector<CheckpointRange> got = r.List(1000);
    ASSERT_EQ(got.size(), want.size()) << "step " << step;
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].file, want[k].file);
      EXPECT_EQ(got[k].offset, want[k].offset);
      EXPECT_EQ(got[k].length, want[k].length);
    }
    const size_t g = rng() % 2;
    const uint64_t qb = rng() % kSize[g];
    const uint64_t qn = 1 + rng() % std::min<uint64_t>(20, kSize[g] - qb);
    bool all = true;
    for (uint64_t i = qb; i < qb + qn; ++i) all = all && ref[g][i];
    EXPECT_EQ(r.Covers(g, qb, qn), all) << "step " << step << " file " << g << " " << qb << "+"
                                        << qn;
  }
  EXPECT_EQ(r.List(2).size(), std::min<size_t>(2, r.List(1000).size()));
}

TEST(ByteRangesTest, IgnoresFilesItDoesNotHaveAndEmptyRanges) {
  ByteRanges r(1);
  r.Add(1, 0, 10);
  r.Add(0, 5, 0);
  EXPECT_EQ(r.bytes(), 0u);
  EXPECT_TRUE(r.List(10).empty());
  r.Add(0, 0, 10);
  EXPECT_TRUE(r.Covers(0, 0, 10));
  EXPECT_FALSE(r.Covers(0, 0, 11));
  EXPECT_FALSE(r.Covers(0, 3, 0));
  EXPECT_FALSE(r.Covers(1, 0, 1));
}

}  // namespace
}  // namespace weightd
