#include "server/profile/name_summary.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

using Lines = std::vector<std::string>;

std::vector<std::string> Layers(const std::vector<int>& ids,
                                const std::string& suffix) {
  std::vector<std::string> out;
  for (int i : ids) out.push_back(absl::StrCat("layers.", i, ".", suffix));
  return out;
}

TEST(NameSummaryTest, EmptyInputGivesNoLines) {
  EXPECT_TRUE(SummarizeNames({}).empty());
}

TEST(NameSummaryTest, ContiguousLayersCollapseToRange) {
  std::vector<int> ids;
  for (int i = 49; i >= 0; --i) ids.push_back(i);  // order does not matter
  EXPECT_EQ(SummarizeNames(Layers(ids, "attn.gate_compress.weight")),
            Lines{"layers.{0..49}.attn.gate_compress.weight"});
}

TEST(NameSummaryTest, NonContiguousSetAndMixedRuns) {
  EXPECT_EQ(SummarizeNames(Layers({0, 2, 5}, "x")), Lines{"layers.{0,2,5}.x"});
  EXPECT_EQ(SummarizeNames(Layers({0, 1, 2, 3, 7, 9, 10, 11, 12}, "x")),
            Lines{"layers.{0..3,7,9..12}.x"});
  EXPECT_EQ(SummarizeNames(Layers({4, 5}, "x")), Lines{"layers.{4,5}.x"});
}

TEST(NameSummaryTest, SingleNameAndNamesWithoutDigitsStayVerbatim) {
  EXPECT_EQ(SummarizeNames({"layers.3.x", "norm.weight", "lm_head.weight"}),
            (Lines{"layers.3.x", "lm_head.weight", "norm.weight"}));
}

TEST(NameSummaryTest, DuplicatesCountOnce) {
  EXPECT_EQ(SummarizeNames({"a.1", "a.1", "a.2", "a.3"}), Lines{"a.{1..3}"});
}

TEST(NameSummaryTest, TwoPositionGridIsOneLine) {
  std::vector<std::string> names;
  for (int b = 0; b < 12; ++b) {
    for (int f = 1; f <= 2; ++f) {
      names.push_back(absl::StrCat("blocks.", b, ".mlp.fc", f, ".weight"));
    }
  }
  EXPECT_EQ(SummarizeNames(names), Lines{"blocks.{0..11}.mlp.fc{1,2}.weight"});
}

TEST(NameSummaryTest, NonGridSplitsByLastPosition) {
  std::vector<std::string> names;
  for (int l = 0; l < 4; ++l) {
    for (int e = 0; e < 8; ++e) {
      if (l == 2 && e == 5) continue;
      names.push_back(absl::StrCat("layers.", l, ".experts.", e, ".w"));
    }
  }
  EXPECT_EQ(SummarizeNames(names), (Lines{"layers.{0,1,3}.experts.{0..7}.w",
                                          "layers.2.experts.{0..4,6,7}.w"}));
}

TEST(NameSummaryTest, DiagonalIsNotAGrid) {
  EXPECT_EQ(SummarizeNames({"l.0.e.0", "l.1.e.1"}),
            (Lines{"l.0.e.0", "l.1.e.1"}));
}

TEST(NameSummaryTest, DifferentSuffixesAreDifferentGroupsInNaturalOrder) {
  std::vector<std::string> names = Layers({0, 1, 2, 10}, "mlp.weight");
  for (const std::string& n : Layers({0, 1, 2}, "attn.weight")) {
    names.push_back(n);
  }
  names.push_back("embed.weight");
  EXPECT_EQ(SummarizeNames(names),
            (Lines{"embed.weight", "layers.{0..2}.attn.weight",
                   "layers.{0..2,10}.mlp.weight"}));
}

TEST(NameSummaryTest, LeadingZeroDigitRunsAreLiteral) {
  EXPECT_EQ(SummarizeNames({"model-00001.x", "model-00002.x"}),
            (Lines{"model-00001.x", "model-00002.x"}));
  // "0" alone is an integer.
  EXPECT_EQ(SummarizeNames({"a.0", "a.1"}), Lines{"a.{0,1}"});
}

TEST(NameSummaryTest, MaxLinesAddsTrailer) {
  std::vector<std::string> names;
  for (int i = 0; i < 25; ++i) names.push_back(absl::StrCat("t", i, "_x", i));
  // Each name differs in two positions along the diagonal: no grid, 25 lines.
  Lines lines = SummarizeNames(names, 20);
  ASSERT_EQ(lines.size(), 21u);
  EXPECT_EQ(lines[0], "t0_x0");
  EXPECT_EQ(lines[1], "t1_x1");
  EXPECT_EQ(lines[20], "... and 5 more");
  EXPECT_EQ(SummarizeNames(names, 25).size(), 25u);
}

TEST(NameSummaryTest, IsDeterministic) {
  std::vector<std::string> a = {"z.3", "a.1", "z.1", "m", "a.2"};
  std::vector<std::string> b = {"a.2", "m", "z.1", "a.1", "z.3"};
  EXPECT_EQ(SummarizeNames(a), SummarizeNames(b));
  EXPECT_EQ(SummarizeNames(a), (Lines{"a.{1,2}", "m", "z.{1,3}"}));
  EXPECT_EQ(SummarizeNamesInline(a), "a.{1,2}, m, z.{1,3}");
}

TEST(NameSummaryTest, FormatIntegerSet) {
  EXPECT_EQ(FormatIntegerSet({}), "{}");
  EXPECT_EQ(FormatIntegerSet({3}), "3");
  EXPECT_EQ(FormatIntegerSet({7, 0, 1, 2, 3, 3}), "{0..3,7}");
  EXPECT_EQ(FormatIntegerSet({1, 2}), "{1,2}");
}

}  // namespace
}  // namespace weightd
