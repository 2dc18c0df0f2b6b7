#include "server/profile/profile.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/shard.h"

namespace weightd {
namespace {

using Shape = std::vector<int64_t>;
using Names = std::vector<std::string>;

#define EXPECT_STATUS(expr, status_code, substr)                       \
  do {                                                                 \
    auto wd_result_ = (expr);                                          \
    ASSERT_FALSE(wd_result_.ok()) << #expr;                            \
    absl::Status wd_s_ = wd_result_.status();                          \
    EXPECT_EQ(wd_s_.code(), status_code) << wd_s_;                     \
    EXPECT_TRUE(absl::StrContains(wd_s_.message(), substr))            \
        << "message: " << wd_s_.message() << "\nwanted: " << (substr); \
  } while (0)

SourceTensorInfo T(std::string name, Shape shape, DType dtype = DType::kBF16) {
  return SourceTensorInfo{std::move(name), dtype, std::move(shape)};
}

Profile MustParse(const std::string& json) {
  absl::StatusOr<Profile> p = Profile::Parse(json);
  EXPECT_TRUE(p.ok()) << p.status() << "\n" << json;
  return p.ok() ? *std::move(p) : Profile();
}

Names ServedNames(const ServedLayout& layout) {
  Names out;
  for (const ServedTensorPlan& t : layout.tensors) out.push_back(t.name);
  return out;
}

Names Sources(const ServedTensorPlan& t) {
  Names out;
  for (const ServedPart& p : t.parts) out.push_back(p.source);
  return out;
}

// --- Parse basics -----------------------------------------------------------

TEST(ProfileParseTest, EmptyObjectHasDefaults) {
  Profile p = MustParse("{}");
  EXPECT_TRUE(p.strict());
  EXPECT_FALSE(p.default_placements().has_value());
  EXPECT_FALSE(p.has_expected());
}

TEST(ProfileParseTest, DefaultPlacementsAndStrict) {
  Profile p =
      MustParse(R"({"default_placements": ["R", "S0"], "strict": false})");
  ASSERT_TRUE(p.default_placements().has_value());
  EXPECT_EQ(
      *p.default_placements(),
      (std::vector<Placement>{Placement::Replicate(), Placement::Shard(0)}));
  EXPECT_FALSE(p.strict());
}

TEST(ProfileParseTest, DesignDocumentExampleParses) {
  MustParse(R"json({
    "name_mapping": [
      {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.(.*)", "target": "layers.\\1.qkv.\\2",
       "merge_index": 0, "num_merges": 3},
      {"match": "model\\.(.*)", "target": "\\1"}
    ],
    "placements": [
      {"match": "layers\\.\\d+\\.qkv\\.weight", "placements": ["R", "S0"], "per_part": true},
      {"match": ".*norm.*", "placements": ["R", "R"]}
    ],
    "default_placements": ["R", "S0"],
    "dtype_rules": [{"match": ".*norm.*", "dtype": "f32"}],
    "quantize": [{"match": ".*_proj\\.weight", "scheme": "fp8_e4m3_per_tensor"}],
    "expected": {"layers.0.qkv.weight": {"shape": [3072, 2048]}},
    "strict": false,
    "allow_new": ["gate_compress", "proj_l"]
  })json");
}

// --- Validation errors (one case each) -------------------------------------

struct BadProfile {
  const char* test_name;
  const char* json;
  const char* message;  // substring naming the rule and field
};

class ProfileValidationTest : public testing::TestWithParam<BadProfile> {};

TEST_P(ProfileValidationTest, IsInvalidArgumentNamingRuleAndField) {
  EXPECT_STATUS(Profile::Parse(GetParam().json),
                absl::StatusCode::kInvalidArgument, GetParam().message);
}

const BadProfile kBadProfiles[] = {
    {"NotJson", R"({"strict": )", "profile is not valid JSON: "},
    {"NotJsonHasLine", "{\n\"strict\" true}", "line 2"},
    {"TopLevelArray", "[]", "profile: must be a JSON object, not array"},
    {"UnknownTopLevelKey", R"({"strikt": true})",
     "unknown top-level key \"strikt\""},
    {"NameMappingNotArray", R"({"name_mapping": {}})",
     "name_mapping: must be an array, not object"},
    {"NameMappingRuleNotObject", R"({"name_mapping": [1]})",
     "name_mapping[0]: must be an object"},
    {"BadRegex",
     R"({"name_mapping": [{"match": "a", "target": "b"}, {"match": "c", "target": "d"},
                          {"match": "(", "target": "x"}]})",
     "name_mapping[2].match: bad regex \"(\": missing )"},
    {"MatchMissing", R"({"name_mapping": [{"target": "x"}]})",
     "name_mapping[0].match: required"},
    {"MatchNotString", R"({"name_mapping": [{"match": 3, "target": "x"}]})",
     "name_mapping[0].match: must be a string, not number"},
    {"TargetMissing", R"({"name_mapping": [{"match": "x"}]})",
     "name_mapping[0].target: required"},
    {"TargetEmpty", R"({"name_mapping": [{"match": "x", "target": ""}]})",
     "name_mapping[0].target: must not be empty"},
    {"TargetUsesMissingGroup",
     R"j({"name_mapping": [{"match": "a(.*)", "target": "\\2"}]})j",
     "name_mapping[0].target: bad target \"\\2\""},
    {"TargetBadEscape",
     R"({"name_mapping": [{"match": "a", "target": "\\x"}]})",
     "name_mapping[0].target: bad target"},
    {"RuleUnknownKey",
     R"({"name_mapping": [{"match": "a", "target": "b", "tgt": "c"}]})",
     "name_mapping[0]: unknown key \"tgt\""},
    {"NumMergesZero",
     R"({"name_mapping": [{"match": "a", "target": "b", "num_merges": 0}]})",
     "name_mapping[0].num_merges: 0 is out of range"},
    {"NumMergesString",
     R"({"name_mapping": [{"match": "a", "target": "b", "num_merges": "3"}]})",
     "name_mapping[0].num_merges: must be an integer, not string"},
    {"MergeIndexOutOfRange",
     R"({"name_mapping": [{"match": "a", "target": "b", "merge_index": 3, "num_merges": 3}]})",
     "name_mapping[0]: merge_index 3 is out of range for num_merges 3"},
    {"MergeIndexNegative",
     R"({"name_mapping": [{"match": "a", "target": "b", "merge_index": -1, "num_merges": 3}]})",
     "name_mapping[0]: merge_index -1 is out of range for num_merges 3"},
    {"MergeIndexWithoutNumMerges",
     R"({"name_mapping": [{"match": "a", "target": "b", "merge_index": 1}]})",
     "name_mapping[0]: merge_index 1 is out of range for num_merges 1"},
    {"MergeIndexRequired",
     R"({"name_mapping": [{"match": "a", "target": "b", "num_merges": 2}]})",
     "name_mapping[0]: merge_index is required when num_merges > 1"},
    {"MergeIndexFloat",
     R"({"name_mapping": [{"match": "a", "target": "b", "merge_index": 0.5, "num_merges": 2}]})",
     "name_mapping[0].merge_index: must be an integer"},
    {"MergeIndexHuge",
     R"({"name_mapping": [{"match": "a", "target": "b", "merge_index": 18446744073709551615, "num_merges": 2}]})",
     "name_mapping[0].merge_index: 18446744073709551615 is too large"},
    {"BadPlacement",
     R"({"placements": [{"match": "a", "placements": ["R"]}, {"match": "b", "placements": ["X"]}]})",
     "placements[1].placements[0]: bad placement \"X\""},
    {"PlacementNotString",
     R"({"placements": [{"match": "a", "placements": [0]}]})",
     "placements[0].placements[0]: must be a string"},
    {"PlacementListEmpty",
     R"({"placements": [{"match": "a", "placements": []}]})",
     "placements[0].placements: must not be empty"},
    {"PlacementListMissing", R"({"placements": [{"match": "a"}]})",
     "placements[0].placements: required"},
    {"PlacementListTooLong",
     R"({"placements": [{"match": "a", "placements": ["R","R","R","R","R","R","R","R","R"]}]})",
     "placements[0].placements: 9 entries; at most 8"},
    {"PlacementRuleBadRegex",
     R"({"placements": [{"match": "[", "placements": ["R"]}]})",
     "placements[0].match: bad regex \"[\""},
    {"PerPartNotBool",
     R"({"placements": [{"match": "a", "placements": ["S0"], "per_part": 1}]})",
     "placements[0].per_part: must be a boolean"},
    {"PerPartWithoutMerge",
     R"({"name_mapping": [{"match": "a", "target": "b"}],
         "placements": [{"match": "a", "placements": ["S0"]},
                        {"match": "b", "placements": ["S0"], "per_part": true}]})",
     "placements[1]: per_part needs a target made by a merge rule"},
    {"DefaultPlacementsNotArray", R"({"default_placements": "R,S0"})",
     "default_placements: must be an array, not string"},
    {"DefaultPlacementsBadEntry", R"({"default_placements": ["R", "S-1"]})",
     "default_placements[1]: bad placement \"S-1\""},
    {"DefaultPlacementsEmpty", R"({"default_placements": []})",
     "default_placements: must not be empty"},
    {"UnknownDType", R"({"dtype_rules": [{"match": "a", "dtype": "f13"}]})",
     "dtype_rules[0].dtype: unknown dtype \"f13\""},
    {"KeepInRule", R"({"dtype_rules": [{"match": "a", "dtype": "keep"}]})",
     "dtype_rules[0].dtype: \"keep\" is not allowed here"},
    {"DTypeMissing", R"({"dtype_rules": [{"match": "a"}]})",
     "dtype_rules[0].dtype: required"},
    {"DTypeRuleUnknownKey",
     R"({"dtype_rules": [{"match": "a", "dtype": "f32", "to": "f16"}]})",
     "dtype_rules[0]: unknown key \"to\""},
    {"UnknownQuantizeScheme",
     R"({"quantize": [{"match": "a", "scheme": "int4"}]})",
     "quantize[0].scheme: unknown scheme \"int4\" (expected "
     "fp8_e4m3_per_tensor)"},
    {"QuantizeSchemeMissing", R"({"quantize": [{"match": "a"}]})",
     "quantize[0].scheme: required"},
    {"ExpectedNotObject", R"({"expected": ["a"]})",
     "expected: must be an object, not array"},
    {"ExpectedEntryNotObject", R"({"expected": {"a": [1, 2]}})",
     "expected[\"a\"]: must be an object"},
    {"ExpectedShapeMissing", R"({"expected": {"a": {"dtype": "f32"}}})",
     "expected[\"a\"].shape: required"},
    {"ExpectedNegativeDim", R"({"expected": {"a": {"shape": [4, -1]}}})",
     "expected[\"a\"].shape[1]: -1 must be >= 0"},
    {"ExpectedDimNotInteger", R"({"expected": {"a": {"shape": ["4"]}}})",
     "expected[\"a\"].shape[0]: must be an integer"},
    {"ExpectedBadDType",
     R"({"expected": {"a": {"shape": [4], "dtype": "f13"}}})",
     "expected[\"a\"].dtype: unknown dtype \"f13\""},
    {"ExpectedUnknownKey", R"({"expected": {"a": {"shape": [4], "size": 4}}})",
     "expected[\"a\"]: unknown key \"size\""},
    {"StrictNotBool", R"({"strict": "yes"})", "strict: must be a boolean"},
    {"AllowNewNotArray", R"({"allow_new": "x"})",
     "allow_new: must be an array"},
    {"AllowNewEmptyString", R"({"allow_new": ["ok", ""]})",
     "allow_new[1]: must not be empty"},
    {"AllowNewNotString", R"({"allow_new": [1]})",
     "allow_new[0]: must be a string"},
};

INSTANTIATE_TEST_SUITE_P(AllErrors, ProfileValidationTest,
                         testing::ValuesIn(kBadProfiles),
                         [](const testing::TestParamInfo<BadProfile>& info) {
                           return std::string(info.param.test_name);
                         });

// --- Name mapping -----------------------------------------------------------

TEST(ProfileMapTest, EmptyProfileServesEveryTensorAsIs) {
  Profile p;
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("b", {2}), T("a", {3, 4}), T("s", {})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(ServedNames(*layout), (Names{"a", "b", "s"}));
  EXPECT_EQ(layout->tensors[0].part_rows, Shape{3});
  EXPECT_EQ(layout->tensors[2].part_rows, Shape{1});  // 0-dim
  EXPECT_EQ(layout->reverse.at("a"), Names{"a"});
}

TEST(ProfileMapTest, IdentitySortsAndServesOnePartEach) {
  ServedLayout layout = Profile::Identity(
      {T("z.weight", {4, 2}, DType::kF16), T("a.bias", {4}, DType::kI64)});
  ASSERT_EQ(ServedNames(layout), (Names{"a.bias", "z.weight"}));
  const ServedTensorPlan& z = layout.tensors[1];
  EXPECT_EQ(z.dtype, DType::kF16);
  EXPECT_EQ(z.shape, (Shape{4, 2}));
  EXPECT_EQ(Sources(z), Names{"z.weight"});
  EXPECT_EQ(z.part_rows, Shape{4});
  EXPECT_FALSE(z.placements.has_value());
  EXPECT_FALSE(z.dtype_override.has_value());
  EXPECT_FALSE(z.quantize_fp8);
  EXPECT_EQ(layout.reverse.at("a.bias"), Names{"a.bias"});
  EXPECT_TRUE(layout.report.empty());
}

TEST(ProfileMapTest, SubstitutesGroupsAndPassesUnmatchedThrough) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "model\\.layers\\.(\\d+)\\.(\\w+)\\.weight", "target": "blk\\1.\\2.w"},
      {"match": "transformer\\.(.*)", "target": "\\1"}]})json");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("model.layers.12.attn.weight", {2}),
             T("transformer.wte.weight", {2}), T("lm_head.weight", {2})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(ServedNames(*layout),
            (Names{"blk12.attn.w", "lm_head.weight", "wte.weight"}));
  EXPECT_EQ(layout->reverse.at("blk12.attn.w"),
            Names{"model.layers.12.attn.weight"});
  EXPECT_EQ(layout->reverse.at("lm_head.weight"), Names{"lm_head.weight"});
}

TEST(ProfileMapTest, FirstMatchingRuleWins) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "model\\.norm\\.weight", "target": "final_norm"},
      {"match": "model\\.(.*)", "target": "\\1"}]})json");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("model.norm.weight", {2}), T("model.embed.weight", {2})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(ServedNames(*layout), (Names{"embed.weight", "final_norm"}));
}

TEST(ProfileMapTest, MatchMustCoverTheWholeName) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "layers\\.\\d+", "target": "x"}]})json");
  absl::StatusOr<ServedLayout> layout = p.Map({T("layers.0.weight", {2})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(ServedNames(*layout), Names{"layers.0.weight"});
}

TEST(ProfileMapTest, WholeMatchSubstitution) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "w\\d", "target": "model.\\0"}]})json");
  absl::StatusOr<ServedLayout> layout = p.Map({T("w1", {2})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(ServedNames(*layout), Names{"model.w1"});
}

TEST(ProfileMapTest, TargetRewritingToEmptyIsInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "x", "target": "a"}, {"match": "prefix\\.(.*)", "target": "\\1"}]})json");
  EXPECT_STATUS(p.Map({T("prefix.", {2})}), absl::StatusCode::kInvalidArgument,
                "name_mapping[1]: maps \"prefix.\" to an empty name");
}

TEST(ProfileMapTest, TwoPlainSourcesOnOneTargetAreInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "model\\.(.*)", "target": "\\1"}]})json");
  EXPECT_STATUS(p.Map({T("model.a", {2}), T("a", {2})}),
                absl::StatusCode::kInvalidArgument,
                "\"model.a\" (name_mapping[0]) and \"a\" (no rule) both map to "
                "served tensor \"a\"");
}

// --- Merges
// -------------------------------------------------------------------

constexpr char kQkvProfile[] = R"json({"name_mapping": [
    {"match": "l(\\d+)\\.q", "target": "l\\1.qkv", "merge_index": 0, "num_merges": 3},
    {"match": "l(\\d+)\\.k", "target": "l\\1.qkv", "merge_index": 1, "num_merges": 3},
    {"match": "l(\\d+)\\.v", "target": "l\\1.qkv", "merge_index": 2, "num_merges": 3}]})json";

TEST(ProfileMergeTest, CompleteGroupConcatenatesInMergeIndexOrder) {
  Profile p = MustParse(kQkvProfile);
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("l0.v", {2, 8}), T("l0.q", {8, 8}), T("l0.k", {2, 8})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->tensors.size(), 1u);
  const ServedTensorPlan& qkv = layout->tensors[0];
  EXPECT_EQ(qkv.name, "l0.qkv");
  EXPECT_EQ(qkv.shape, (Shape{12, 8}));
  EXPECT_EQ(Sources(qkv), (Names{"l0.q", "l0.k", "l0.v"}));
  EXPECT_EQ(qkv.part_rows, (Shape{8, 2, 2}));
  EXPECT_EQ(qkv.dtype, DType::kBF16);
  EXPECT_EQ(layout->reverse.at("l0.qkv"), (Names{"l0.q", "l0.k", "l0.v"}));
}

TEST(ProfileMergeTest, IncompleteGroupIsFailedPreconditionListingMissing) {
  Profile p = MustParse(kQkvProfile);
  std::vector<SourceTensorInfo> ckpt;
  for (int l = 0; l < 4; ++l)
    ckpt.push_back(T(absl::StrCat("l", l, ".q"), {8, 8}));
  absl::StatusOr<ServedLayout> layout = p.Map(ckpt);
  EXPECT_STATUS(layout, absl::StatusCode::kFailedPrecondition,
                "merge group \"l0.qkv\" is incomplete: missing merge_index "
                "{1,2} of num_merges 3 (have \"l0.q\" (merge_index 0))");
  EXPECT_STATUS(layout, absl::StatusCode::kFailedPrecondition,
                "3 more incomplete merge group(s): l{1..3}.qkv");
}

TEST(ProfileMergeTest, DuplicateMergeIndexIsInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "(a|b)", "target": "ab", "merge_index": 0, "num_merges": 2}]})json");
  EXPECT_STATUS(p.Map({T("a", {2, 2}), T("b", {2, 2})}),
                absl::StatusCode::kInvalidArgument,
                "\"a\" (name_mapping[0], merge_index 0 of 2) and \"b\" "
                "(name_mapping[0], merge_index 0 of 2) have the same "
                "merge_index 0");
}

TEST(ProfileMergeTest, PartsDisagreeingOnTrailingDimsAreInvalid) {
  Profile p = MustParse(kQkvProfile);
  EXPECT_STATUS(
      p.Map({T("l0.q", {8, 8}), T("l0.k", {2, 4}), T("l0.v", {2, 8})}),
      absl::StatusCode::kInvalidArgument,
      "merge parts \"l0.q\" BF16 [8, 8] and \"l0.k\" BF16 [2, 4] must have");
}

TEST(ProfileMergeTest, PartsDisagreeingOnNdimAreInvalid) {
  Profile p = MustParse(kQkvProfile);
  EXPECT_STATUS(p.Map({T("l0.q", {8, 8}), T("l0.k", {16}), T("l0.v", {2, 8})}),
                absl::StatusCode::kInvalidArgument,
                "\"l0.q\" BF16 [8, 8] and \"l0.k\" BF16 [16]");
}

TEST(ProfileMergeTest, PartsDisagreeingOnDTypeAreInvalid) {
  Profile p = MustParse(kQkvProfile);
  EXPECT_STATUS(p.Map({T("l0.q", {8, 8}), T("l0.k", {2, 8}, DType::kF32),
                       T("l0.v", {2, 8})}),
                absl::StatusCode::kInvalidArgument,
                "\"l0.q\" BF16 [8, 8] and \"l0.k\" F32 [2, 8]");
}

TEST(ProfileMergeTest, ZeroDimPartsAreInvalid) {
  Profile p = MustParse(kQkvProfile);
  EXPECT_STATUS(p.Map({T("l0.q", {}), T("l0.k", {}), T("l0.v", {})}),
                absl::StatusCode::kInvalidArgument,
                "merge parts need ndim >= 1");
}

TEST(ProfileMergeTest, PlainSourceAndMergePartOnOneTargetAreInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "a", "target": "ab", "merge_index": 0, "num_merges": 2},
      {"match": "b", "target": "ab", "merge_index": 1, "num_merges": 2}]})json");
  EXPECT_STATUS(p.Map({T("a", {2}), T("b", {2}), T("ab", {4})}),
                absl::StatusCode::kInvalidArgument,
                "\"ab\" (no rule) both map to served tensor \"ab\"");
}

TEST(ProfileMergeTest, PartsDisagreeingOnNumMergesAreInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "a", "target": "ab", "merge_index": 0, "num_merges": 2},
      {"match": "b", "target": "ab", "merge_index": 1, "num_merges": 3}]})json");
  EXPECT_STATUS(p.Map({T("a", {2}), T("b", {2})}),
                absl::StatusCode::kInvalidArgument, "disagree on num_merges");
}

// --- A Llama-shaped checkpoint ----------------------------------------------

constexpr char kLlamaProfile[] = R"json({
  "name_mapping": [
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.(.*)",
     "target": "layers.\\1.qkv.\\2", "merge_index": 0, "num_merges": 3},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.k_proj\\.(.*)",
     "target": "layers.\\1.qkv.\\2", "merge_index": 1, "num_merges": 3},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.v_proj\\.(.*)",
     "target": "layers.\\1.qkv.\\2", "merge_index": 2, "num_merges": 3},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.gate_proj\\.(.*)",
     "target": "layers.\\1.gate_up.\\2", "merge_index": 0, "num_merges": 2},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.up_proj\\.(.*)",
     "target": "layers.\\1.gate_up.\\2", "merge_index": 1, "num_merges": 2},
    {"match": "model\\.(.*)", "target": "\\1"}
  ],
  "placements": [
    {"match": "layers\\.\\d+\\.(qkv|gate_up)\\.weight", "placements": ["R", "S0"], "per_part": true},
    {"match": ".*norm.*", "placements": ["R", "R"]}
  ],
  "default_placements": ["R", "S0"],
  "dtype_rules": [{"match": ".*norm.*", "dtype": "f32"}]
})json";

constexpr int kLayers = 2;
constexpr int64_t kHidden = 64, kKv = 16, kFfn = 128, kVocab = 100;

std::vector<SourceTensorInfo> LlamaCheckpoint() {
  std::vector<SourceTensorInfo> out = {
      T("model.embed_tokens.weight", {kVocab, kHidden}),
      T("model.norm.weight", {kHidden}),
      T("lm_head.weight", {kVocab, kHidden}),
  };
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    out.push_back(T(p + "self_attn.q_proj.weight", {kHidden, kHidden}));
    out.push_back(T(p + "self_attn.k_proj.weight", {kKv, kHidden}));
    out.push_back(T(p + "self_attn.v_proj.weight", {kKv, kHidden}));
    out.push_back(T(p + "self_attn.o_proj.weight", {kHidden, kHidden}));
    out.push_back(T(p + "mlp.gate_proj.weight", {kFfn, kHidden}));
    out.push_back(T(p + "mlp.up_proj.weight", {kFfn, kHidden}));
    out.push_back(T(p + "mlp.down_proj.weight", {kHidden, kFfn}));
    out.push_back(T(p + "input_layernorm.weight", {kHidden}));
    out.push_back(T(p + "post_attention_layernorm.weight", {kHidden}));
  }
  return out;
}

TEST(ProfileLlamaTest, MapsQkvGateUpNormsAndPassThrough) {
  Profile p = MustParse(kLlamaProfile);
  absl::StatusOr<ServedLayout> layout = p.Map(LlamaCheckpoint());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(
      ServedNames(*layout),
      (Names{"embed_tokens.weight", "layers.0.gate_up.weight",
             "layers.0.input_layernorm.weight", "layers.0.mlp.down_proj.weight",
             "layers.0.post_attention_layernorm.weight", "layers.0.qkv.weight",
             "layers.0.self_attn.o_proj.weight", "layers.1.gate_up.weight",
             "layers.1.input_layernorm.weight", "layers.1.mlp.down_proj.weight",
             "layers.1.post_attention_layernorm.weight", "layers.1.qkv.weight",
             "layers.1.self_attn.o_proj.weight", "lm_head.weight",
             "norm.weight"}));
  const std::vector<Placement> tp = {Placement::Replicate(),
                                     Placement::Shard(0)};
  const std::vector<Placement> rr = {Placement::Replicate(),
                                     Placement::Replicate()};

  const ServedTensorPlan* qkv = layout->Find("layers.1.qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (Shape{kHidden + 2 * kKv, kHidden}));
  EXPECT_EQ(qkv->part_rows, (Shape{kHidden, kKv, kKv}));
  EXPECT_EQ(Sources(*qkv), (Names{"model.layers.1.self_attn.q_proj.weight",
                                  "model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.1.self_attn.v_proj.weight"}));
  EXPECT_EQ(qkv->placements, tp);
  EXPECT_TRUE(qkv->per_part);
  EXPECT_FALSE(qkv->dtype_override.has_value());

  const ServedTensorPlan* gate_up = layout->Find("layers.0.gate_up.weight");
  ASSERT_NE(gate_up, nullptr);
  EXPECT_EQ(gate_up->shape, (Shape{2 * kFfn, kHidden}));
  EXPECT_EQ(gate_up->part_rows, (Shape{kFfn, kFfn}));
  EXPECT_TRUE(gate_up->per_part);

  for (const char* name : {"norm.weight", "layers.0.input_layernorm.weight",
                           "layers.1.post_attention_layernorm.weight"}) {
    const ServedTensorPlan* norm = layout->Find(name);
    ASSERT_NE(norm, nullptr) << name;
    EXPECT_EQ(norm->dtype, DType::kBF16) << name;
    EXPECT_EQ(norm->dtype_override, DType::kF32) << name;
    EXPECT_EQ(norm->placements, rr) << name;
    EXPECT_FALSE(norm->per_part) << name;
  }

  const ServedTensorPlan* o = layout->Find("layers.0.self_attn.o_proj.weight");
  ASSERT_NE(o, nullptr);
  EXPECT_FALSE(o->placements.has_value());  // default placements apply
  EXPECT_EQ(Sources(*o), Names{"model.layers.0.self_attn.o_proj.weight"});
  EXPECT_EQ(layout->reverse.at("lm_head.weight"), Names{"lm_head.weight"});
  EXPECT_EQ(layout->reverse.size(), layout->tensors.size());
  EXPECT_EQ(*p.default_placements(), tp);
  EXPECT_TRUE(layout->report.empty());
}

TEST(ProfileLlamaTest, PerPartOnSinglePartTensorBehavesPlain) {
  Profile p = MustParse(R"json({
    "name_mapping": [{"match": "(a|b)", "target": "ab", "merge_index": 0, "num_merges": 2},
                     {"match": "b2", "target": "ab", "merge_index": 1, "num_merges": 2}],
    "placements": [{"match": ".*", "placements": ["S0"], "per_part": true}]})json");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("a", {4, 2}), T("b2", {4, 2}), T("single", {4, 2})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE(layout->Find("ab")->per_part);
  const ServedTensorPlan* single = layout->Find("single");
  ASSERT_NE(single, nullptr);
  EXPECT_FALSE(single->per_part);
  EXPECT_EQ(single->placements, std::vector<Placement>{Placement::Shard(0)});
}

TEST(ProfileLlamaTest, PlacementRulesMatchServedNamesNotCheckpointNames) {
  Profile p = MustParse(R"json({
    "name_mapping": [{"match": "model\\.(.*)", "target": "\\1"}],
    "placements": [{"match": "model\\..*", "placements": ["R"]},
                   {"match": "w", "placements": ["S0"]}]})json");
  absl::StatusOr<ServedLayout> layout = p.Map({T("model.w", {4})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors[0].placements,
            std::vector<Placement>{Placement::Shard(0)});
}

// --- expected / strict / allow_new -------------------------------------------

// The Llama profile plus an "expected" block for every served tensor, the
// extra entries in `extra_expected`, and the given strict / allow_new.
std::string LlamaWithExpected(const std::string& extra_expected, bool strict,
                              const std::string& allow_new = "[]",
                              const std::vector<std::string>& omit = {}) {
  Profile base = MustParse(kLlamaProfile);
  absl::StatusOr<ServedLayout> layout = base.Map(LlamaCheckpoint());
  EXPECT_TRUE(layout.ok());
  std::vector<std::string> entries;
  for (const ServedTensorPlan& t : layout->tensors) {
    if (std::find(omit.begin(), omit.end(), t.name) != omit.end()) continue;
    entries.push_back(absl::StrCat("\"", t.name, "\": {\"shape\": [",
                                   absl::StrJoin(t.shape, ", "), "]}"));
  }
  if (!extra_expected.empty()) entries.push_back(extra_expected);
  std::string json(kLlamaProfile);
  json.pop_back();  // the closing brace
  absl::StrAppend(&json, ", \"expected\": {", absl::StrJoin(entries, ", "),
                  "}, \"strict\": ", strict ? "true" : "false",
                  ", \"allow_new\": ", allow_new, "}");
  return json;
}

TEST(ProfileExpectedTest, MatchingCheckpointPassesStrict) {
  Profile p = MustParse(LlamaWithExpected("", /*strict=*/true));
  absl::StatusOr<ServedLayout> layout = p.Map(LlamaCheckpoint());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors.size(), 15u);
  EXPECT_TRUE(layout->report.empty());
}

TEST(ProfileExpectedTest, UnexpectedIsErrorWhenStrictSummarized) {
  Profile p = MustParse(LlamaWithExpected(
      "", /*strict=*/true, "[]",
      {"layers.0.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"}));
  EXPECT_STATUS(p.Map(LlamaCheckpoint()), absl::StatusCode::kInvalidArgument,
                "2 served tensor(s) not in expected (strict): "
                "layers.{0,1}.mlp.down_proj.weight");
}

TEST(ProfileExpectedTest, UnexpectedIsDroppedAndReportedWhenNotStrict) {
  Profile p = MustParse(LlamaWithExpected(
      "", /*strict=*/false, "[]",
      {"layers.0.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"}));
  absl::StatusOr<ServedLayout> layout = p.Map(LlamaCheckpoint());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors.size(), 13u);
  EXPECT_EQ(layout->Find("layers.0.mlp.down_proj.weight"), nullptr);
  EXPECT_FALSE(layout->reverse.contains("layers.0.mlp.down_proj.weight"));
  EXPECT_EQ(layout->report.unexpected,
            (Names{"layers.0.mlp.down_proj.weight",
                   "layers.1.mlp.down_proj.weight"}));
}

TEST(ProfileExpectedTest, ExtraStateKeysAreSkippedAndReported) {
  Profile p = MustParse(LlamaWithExpected(
      R"("layers.0.mlp._extra_state": {"shape": [8]})", /*strict=*/true));
  std::vector<SourceTensorInfo> ckpt = LlamaCheckpoint();
  for (int l = 0; l < kLayers; ++l) {
    ckpt.push_back(T(absl::StrCat("model.layers.", l, ".mlp._extra_state"), {8},
                     DType::kU8));
  }
  absl::StatusOr<ServedLayout> layout = p.Map(ckpt);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors.size(), 15u);
  EXPECT_EQ(layout->report.skipped_extra_state,
            (Names{"model.layers.0.mlp._extra_state",
                   "model.layers.1.mlp._extra_state"}));
  EXPECT_TRUE(layout->report.zero_filled.empty());
  // Without `expected` they are ordinary tensors.
  absl::StatusOr<ServedLayout> plain = MustParse(kLlamaProfile).Map(ckpt);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_NE(plain->Find("layers.1.mlp._extra_state"), nullptr);
}

TEST(ProfileExpectedTest, AllowNewZeroFillsMissingKeys) {
  std::string extra;
  for (int l = 0; l < kLayers; ++l) {
    if (l) extra += ", ";
    absl::StrAppend(&extra, "\"layers.", l,
                    ".attn.gate_compress.weight\": {\"shape\": [4, 64]}");
  }
  extra += R"(, "proj_l.bias": {"shape": [4], "dtype": "f32"})";
  Profile p = MustParse(LlamaWithExpected(extra, /*strict=*/true,
                                          R"(["gate_compress", "proj_l"])"));
  absl::StatusOr<ServedLayout> layout = p.Map(LlamaCheckpoint());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors.size(), 18u);
  const ServedTensorPlan* gc =
      layout->Find("layers.1.attn.gate_compress.weight");
  ASSERT_NE(gc, nullptr);
  EXPECT_TRUE(gc->parts.empty());
  EXPECT_TRUE(gc->part_rows.empty());
  EXPECT_EQ(gc->shape, (Shape{4, 64}));
  EXPECT_EQ(gc->dtype, DType::kBF16);  // the checkpoint's common float dtype
  EXPECT_FALSE(gc->per_part);
  EXPECT_TRUE(layout->reverse.at("layers.1.attn.gate_compress.weight").empty());
  const ServedTensorPlan* proj = layout->Find("proj_l.bias");
  ASSERT_NE(proj, nullptr);
  EXPECT_EQ(proj->dtype, DType::kF32);  // from expected
  EXPECT_EQ(layout->report.zero_filled,
            (Names{"layers.0.attn.gate_compress.weight",
                   "layers.1.attn.gate_compress.weight", "proj_l.bias"}));
  EXPECT_TRUE(
      std::is_sorted(layout->tensors.begin(), layout->tensors.end(),
                     [](const ServedTensorPlan& a, const ServedTensorPlan& b) {
                       return a.name < b.name;
                     }));
}

TEST(ProfileExpectedTest, ZeroFillDefaultDTypeIsMostCommonFloat) {
  Profile p =
      MustParse(R"({"expected": {"a": {"shape": [2]}, "b": {"shape": [2]},
      "c": {"shape": [2]}, "d": {"shape": [2]}, "new.x": {"shape": [3]}},
      "allow_new": ["new"]})");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("a", {2}, DType::kF16), T("b", {2}, DType::kF32),
             T("c", {2}, DType::kF16), T("d", {2}, DType::kI64)});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->Find("new.x")->dtype, DType::kF16);
  // No floating tensors at all: F32.
  Profile q =
      MustParse(R"({"expected": {"d": {"shape": [2]}, "new.x": {"shape": [3]}},
      "allow_new": ["new"]})");
  absl::StatusOr<ServedLayout> ints = q.Map({T("d", {2}, DType::kI64)});
  ASSERT_TRUE(ints.ok()) << ints.status();
  EXPECT_EQ(ints->Find("new.x")->dtype, DType::kF32);
}

TEST(ProfileExpectedTest, MissingKeysNotAllowedNewAreFailedPrecondition) {
  std::string extra;
  for (int l = 0; l < kLayers; ++l) {
    if (l) extra += ", ";
    absl::StrAppend(&extra, "\"layers.", l,
                    ".adaln.weight\": {\"shape\": [4]}");
  }
  Profile p = MustParse(
      LlamaWithExpected(extra, /*strict=*/false, R"(["gate_compress"])"));
  EXPECT_STATUS(p.Map(LlamaCheckpoint()), absl::StatusCode::kFailedPrecondition,
                "2 expected tensor(s) missing from the checkpoint and not "
                "allowed new (allow_new): layers.{0,1}.adaln.weight");
}

TEST(ProfileExpectedTest, ShapeMismatchNamesBothShapes) {
  Profile p = MustParse(R"json({
    "name_mapping": [{"match": "model\\.(.*)", "target": "\\1"}],
    "expected": {"w": {"shape": [3072, 2048]}}})json");
  EXPECT_STATUS(p.Map({T("model.w", {3072, 1024})}),
                absl::StatusCode::kInvalidArgument,
                "served tensor \"w\" (from \"model.w\") has shape [3072, 1024] "
                "but expected shape is [3072, 2048]");
}

TEST(ProfileExpectedTest, MergedShapeIsCheckedAgainstExpected) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "a", "target": "ab", "merge_index": 0, "num_merges": 2},
      {"match": "b", "target": "ab", "merge_index": 1, "num_merges": 2}],
      "expected": {"ab": {"shape": [4, 2]}}})json");
  ASSERT_TRUE(p.Map({T("a", {2, 2}), T("b", {2, 2})}).ok());
  EXPECT_STATUS(p.Map({T("a", {2, 2}), T("b", {3, 2})}),
                absl::StatusCode::kInvalidArgument,
                "has shape [5, 2] but expected shape is [4, 2]");
}

TEST(ProfileExpectedTest, ReportSummaryUsesPatterns) {
  ProfileReport report;
  report.skipped_extra_state = {"l.0._extra_state", "l.1._extra_state"};
  report.zero_filled = {"layers.0.gc", "layers.1.gc", "layers.2.gc"};
  EXPECT_EQ(report.Summary(),
            (Names{"2 *_extra_state checkpoint key(s) skipped:",
                   "  l.{0,1}._extra_state",
                   "3 missing tensor(s) zero-filled (allow_new):",
                   "  layers.{0..2}.gc"}));
  EXPECT_TRUE(ProfileReport().Summary().empty());
}

// --- dtype rules and quantize
// -------------------------------------------------

TEST(ProfileRulesTest, DTypeRulesFirstMatchWins) {
  Profile p = MustParse(R"json({"dtype_rules": [
      {"match": "final\\.norm", "dtype": "bf16"},
      {"match": ".*norm", "dtype": "F32"}]})json");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("final.norm", {2}, DType::kF16), T("l0.norm", {2}, DType::kF16),
             T("w", {2}, DType::kF16)});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->Find("final.norm")->dtype_override, DType::kBF16);
  EXPECT_EQ(layout->Find("l0.norm")->dtype_override, DType::kF32);
  EXPECT_FALSE(layout->Find("w")->dtype_override.has_value());
}

TEST(ProfileRulesTest, DTypeRuleThatCannotCastIsInvalid) {
  Profile p = MustParse(R"json({"dtype_rules": [
      {"match": "x", "dtype": "f16"}, {"match": ".*ids", "dtype": "f32"}]})json");
  EXPECT_STATUS(p.Map({T("pos_ids", {2}, DType::kI64)}),
                absl::StatusCode::kInvalidArgument,
                "dtype_rules[1]: cannot cast \"pos_ids\" from I64 to F32");
}

TEST(ProfileRulesTest, QuantizeMarksFloatingTensors) {
  Profile p = MustParse(R"json({"quantize": [
      {"match": ".*_proj\\.weight", "scheme": "fp8_e4m3_per_tensor"}]})json");
  absl::StatusOr<ServedLayout> layout =
      p.Map({T("q_proj.weight", {4, 4}), T("norm.weight", {4})});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE(layout->Find("q_proj.weight")->quantize_fp8);
  EXPECT_FALSE(layout->Find("norm.weight")->quantize_fp8);
}

TEST(ProfileRulesTest, QuantizeOnIntegerTensorIsInvalid) {
  Profile p = MustParse(R"json({"quantize": [
      {"match": "idx", "scheme": "fp8_e4m3_per_tensor"}]})json");
  EXPECT_STATUS(p.Map({T("idx", {4}, DType::kI32)}),
                absl::StatusCode::kInvalidArgument,
                "quantize[0]: \"idx\" is I32; only floating tensors");
}

TEST(ProfileRulesTest, QuantizeScaleCompanionMustNotCollide) {
  Profile p = MustParse(R"json({"quantize": [
      {"match": "w", "scheme": "fp8_e4m3_per_tensor"}]})json");
  EXPECT_STATUS(p.Map({T("w", {4}), T("w_scale", {1}, DType::kF32)}),
                absl::StatusCode::kInvalidArgument,
                "would be named \"w_scale\", which is already served");
}


// --- Which problem is reported first -----------------------------------------
// Parse reads the sections in a fixed order and Map runs its phases over
// every served name before the next phase; these pin the order, so a
// document or checkpoint with several problems always gets the same answer.

TEST(ProfileOrderTest, SectionsAreCheckedInTheHeadersOrderNotTheDocuments) {
  EXPECT_STATUS(Profile::Parse(R"json({"allow_new": [""], "quantize": [{"match": "(",
      "scheme": "x"}], "name_mapping": [{"match": "a", "target": ""}]})json"),
                absl::StatusCode::kInvalidArgument,
                "name_mapping[0].target: must not be empty");
  EXPECT_STATUS(Profile::Parse(R"json({"allow_new": [""], "strict": 1,
      "dtype_rules": [{"match": "a"}]})json"),
                absl::StatusCode::kInvalidArgument,
                "dtype_rules[0].dtype: required");
}

TEST(ProfileOrderTest, IncompleteMergeGroupIsReportedAfterEveryGroupIsChecked) {
  // "a.qkv" (incomplete) sorts before "b", whose two plain sources clash:
  // the clash is reported, the incomplete group only once all groups pass.
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "a\\.q", "target": "a.qkv", "merge_index": 0, "num_merges": 3},
      {"match": "b[12]", "target": "b"}]})json");
  EXPECT_STATUS(p.Map({T("a.q", {2, 2}), T("b1", {2}), T("b2", {2})}),
                absl::StatusCode::kInvalidArgument,
                "both map to served tensor \"b\"");
  EXPECT_STATUS(p.Map({T("a.q", {2, 2}), T("b1", {2})}),
                absl::StatusCode::kFailedPrecondition,
                "merge group \"a.qkv\" is incomplete");
}

TEST(ProfileOrderTest, RulesAreAppliedTensorByTensorInServedNameOrder) {
  // "a" fails its quantize rule and "b" its dtype rule: "a" comes first.
  Profile p = MustParse(R"json({
      "dtype_rules": [{"match": "b", "dtype": "f32"}],
      "quantize": [{"match": "a", "scheme": "fp8_e4m3_per_tensor"}]})json");
  EXPECT_STATUS(p.Map({T("b", {2}, DType::kI64), T("a", {2}, DType::kI32)}),
                absl::StatusCode::kInvalidArgument, "quantize[0]: \"a\" is I32");
  EXPECT_STATUS(p.Map({T("b", {2}, DType::kI64), T("c", {2}, DType::kI32)}),
                absl::StatusCode::kInvalidArgument,
                "dtype_rules[0]: cannot cast \"b\" from I64 to F32");
}

// --- Hostile sizes and shapes (issue 16: F2, F10, F17, F20) -----------------

TEST(ProfileHostileTest, DeepNestingIsInvalidArgumentNotAStackOverflow) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_STATUS(Profile::Parse(deep), absl::StatusCode::kInvalidArgument,
                "nests deeper than 64 levels");
  EXPECT_STATUS(Profile::Parse(absl::StrCat(R"({"expected": {"w": {"shape": )",
                                            deep, "}}}")),
                absl::StatusCode::kInvalidArgument,
                "nests deeper than 64 levels");
  // Unterminated: the depth is what the parser would have had to hold.
  EXPECT_STATUS(Profile::Parse(absl::StrCat(R"({"strict": )",
                                            std::string(100000, '{'))),
                absl::StatusCode::kInvalidArgument,
                "nests deeper than 64 levels");
  // Brackets inside strings do not count.
  MustParse(absl::StrCat(R"({"allow_new": [")", std::string(1000, '['),
                         R"("]})"));
}

TEST(ProfileHostileTest, ExpectedShapeWhoseElementCountOverflowsIsInvalid) {
  // 2^62 * 2 elements wrap int64; the table showed [4611686018427387905].
  EXPECT_STATUS(Profile::Parse(R"json({"expected": {"huge.w":
                    {"shape": [4611686018427387904, 2]}}})json"),
                absl::StatusCode::kInvalidArgument,
                "expected[\"huge.w\"].shape: [4611686018427387904, 2] is too "
                "large");
  // The element count fits but the bytes (8 per element at most) do not.
  EXPECT_STATUS(Profile::Parse(R"json({"expected": {"bytes.w":
                    {"shape": [2305843009213693952, 2], "dtype": "f32"}}})json"),
                absl::StatusCode::kInvalidArgument,
                "expected[\"bytes.w\"].shape: [2305843009213693952, 2] is too "
                "large");
  // A zero dim does not excuse the others (strides use them).
  EXPECT_STATUS(Profile::Parse(R"json({"expected": {"z.w":
                    {"shape": [0, 4611686018427387904, 4]}}})json"),
                absl::StatusCode::kInvalidArgument, "z.w");
  EXPECT_STATUS(Profile::Parse(R"json({"expected": {"r.w":
                    {"shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}}})json"),
                absl::StatusCode::kInvalidArgument, "more than 16 dims");
  // The largest that fits in every dtype still parses.
  MustParse(R"json({"expected": {"ok.w": {"shape": [1152921504606846975]}}})json");
}

TEST(ProfileHostileTest, MergedDimZeroThatOverflowsIsInvalidAtMap) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "a", "target": "ab", "merge_index": 0, "num_merges": 2},
      {"match": "b", "target": "ab", "merge_index": 1, "num_merges": 2}]})json");
  // Zero-element parts, each a valid safetensors shape; their sum is 2^63.
  const int64_t half = int64_t{1} << 62;
  EXPECT_STATUS(p.Map({T("a", {half, 0}), T("b", {half, 0})}),
                absl::StatusCode::kInvalidArgument,
                "served tensor \"ab\": merged dim 0");
  // Fits in int64, but not as bytes of the widest dtype.
  EXPECT_STATUS(p.Map({T("a", {half / 4, 1}), T("b", {half / 4, 1})}),
                absl::StatusCode::kInvalidArgument,
                "served tensor \"ab\": shape [2305843009213693952, 1] is too "
                "large");
}

TEST(ProfileHostileTest, ServedNamesWithControlCharactersAreInvalid) {
  Profile p = MustParse(R"json({"name_mapping": [
      {"match": "w", "target": "w\ntensor: forged"}]})json");
  EXPECT_STATUS(p.Map({T("w", {2})}), absl::StatusCode::kInvalidArgument,
                "control character");
  EXPECT_STATUS(Profile::Parse(R"json({"expected": {"x\u001b[2J":
                    {"shape": [2]}}})json"),
                absl::StatusCode::kInvalidArgument, "control character");
}

TEST(ProfileHostileTest, ErrorMessagesQuoteLongNamesBounded) {
  const std::string key(1 << 20, 'k');
  absl::StatusOr<Profile> p = Profile::Parse(
      absl::StrCat(R"({"expected": {")", key, R"(": {"shape": [-1]}}})"));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(p.status().message().size(), 1024u) << p.status().message().size();
  EXPECT_TRUE(absl::StrContains(p.status().message(), "must be >= 0"));
}

}  // namespace
}  // namespace weightd
