#include "server/service/fetch_plan.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "server/adapter/lora_patch.h"

namespace weightd {
namespace {

StoredTensor Stored(std::string name, std::vector<int64_t> shape, DType dtype = DType::kF32) {
  StoredTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

ServedTensorPlan Plan(std::string name, std::vector<int64_t> shape, DType dtype = DType::kF32) {
  ServedTensorPlan p;
  p.name = std::move(name);
  p.dtype = dtype;
  p.shape = std::move(shape);
  return p;
}

MeshCoord Mesh(std::vector<int64_t> shape, std::vector<int64_t> coord) {
  MeshCoord m;
  m.shape = std::move(shape);
  m.coord = std::move(coord);
  return m;
}

FetchPlanOptions Options(MeshCoord mesh) {
  FetchPlanOptions o;
  o.defaults = *ResolveDefaultPlacements(mesh, std::nullopt, std::nullopt);
  o.mesh = std::move(mesh);
  return o;
}

TEST(FetchPlanTest, DefaultPlacementsComeFromTheRequestThenTheProfileThenFsdp) {
  MeshCoord m = Mesh({2, 4}, {1, 3});
  auto fsdp = ResolveDefaultPlacements(m, std::nullopt, std::nullopt);
  ASSERT_TRUE(fsdp.ok());
  EXPECT_EQ(PlacementsToString(*fsdp), "R,S0");
  std::vector<Placement> profile = *ParsePlacements("S0,R");
  EXPECT_EQ(PlacementsToString(*ResolveDefaultPlacements(m, std::nullopt, profile)), "S0,R");
  std::vector<Placement> request = *ParsePlacements("R,S1");
  EXPECT_EQ(PlacementsToString(*ResolveDefaultPlacements(m, request, profile)), "R,S1");
  auto bad = ResolveDefaultPlacements(m, *ParsePlacements("S0"), std::nullopt);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "name 1 mesh dims but the mesh has 2"));
  auto bad_profile = ResolveDefaultPlacements(m, std::nullopt, *ParsePlacements("S0"));
  EXPECT_TRUE(absl::StrContains(bad_profile.status().message(), "pass --placements"));
}

TEST(FetchPlanTest, SelectByNameKeepsRequestOrderAndRefusesRepeatsAndUnknowns) {
  std::vector<std::string> served = {"a", "b", "c"};
  EXPECT_EQ(*SelectByName(served, {}, "m"), (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(*SelectByName(served, {"c", "a"}, "m"), (std::vector<size_t>{2, 0}));
  auto twice = SelectByName(served, {"a", "c", "a"}, "m");
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.status().message(), "\"a\" is given more than once"));
  auto unknown = SelectByName(served, {"a", "zz"}, "m");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(unknown.status().message(), "model \"m\" has no tensor named \"zz\""));
}

TEST(FetchPlanTest, ShardsLikeTorchChunkAndKeepsTheStoredDtype) {
  // 10 rows over 4 ranks: 3, 3, 3, 1 (docs/DESIGN.md §2.1).
  StoredTensor w = Stored("w", {10, 6});
  ServedTensorPlan p = Plan("w", {10, 6});
  const int64_t rows[] = {3, 3, 3, 1};
  for (int64_t r = 0; r < 4; ++r) {
    auto plan = PlanFetch({PlannedTensor{&p, {&w}}}, Options(Mesh({4}, {r})));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->items.size(), 1u);
    const FetchedTensor& t = plan->tensors[0];
    EXPECT_EQ(t.shape, (std::vector<int64_t>{rows[r], 6}));
    EXPECT_EQ(t.global_offset, (std::vector<int64_t>{3 * r, 0}));
    EXPECT_EQ(t.global_shape, (std::vector<int64_t>{10, 6}));
    EXPECT_EQ(t.dtype, DType::kF32);
    ASSERT_EQ(plan->items[0].slices.size(), 1u);
    EXPECT_EQ(plan->items[0].slices[0].stored, &w);
    EXPECT_EQ(plan->items[0].slices[0].box.offset[0], 3 * r);
  }
}

TEST(FetchPlanTest, MergedTensorShardedWholeTakesRowsFromEachPart) {
  // q (4 rows) + k (2 rows) + v (2 rows) = 8 rows; rank 1 of 2 gets rows 4..8:
  // all of k and v, nothing of q.
  StoredTensor q = Stored("q", {4, 3}), k = Stored("k", {2, 3}), v = Stored("v", {2, 3});
  ServedTensorPlan p = Plan("qkv", {8, 3});
  p.part_rows = {4, 2, 2};
  auto plan = PlanFetch({PlannedTensor{&p, {&q, &k, &v}}}, Options(Mesh({2}, {1})));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto& slices = plan->items[0].slices;
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[0].stored, &k);
  EXPECT_EQ(slices[1].stored, &v);
  EXPECT_EQ(plan->tensors[0].shape, (std::vector<int64_t>{4, 3}));
  // per_part (tensor-parallel): each part sharded on its own, pieces stacked.
  p.per_part = true;
  plan = PlanFetch({PlannedTensor{&p, {&q, &k, &v}}}, Options(Mesh({2}, {1})));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto& pieces = plan->items[0].slices;
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].box.offset[0], 2);  // rows 2..4 of q
  EXPECT_EQ(pieces[1].box.offset[0], 1);  // row 1 of k
  EXPECT_EQ(pieces[2].box.offset[0], 1);  // row 1 of v
  EXPECT_EQ(plan->tensors[0].shape, (std::vector<int64_t>{4, 3}));
}

TEST(FetchPlanTest, DtypeRulesQuantizationAndTheRequestsDtype) {
  StoredTensor w = Stored("w", {4, 4}), ids = Stored("ids", {4}, DType::kI64);
  ServedTensorPlan pw = Plan("w", {4, 4}), pids = Plan("ids", {4}, DType::kI64);
  FetchPlanOptions o = Options(Mesh({1}, {0}));
  o.dtype = DType::kBF16;
  auto plan = PlanFetch({PlannedTensor{&pw, {&w}}, PlannedTensor{&pids, {&ids}}}, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(plan->tensors[1].dtype, DType::kI64) << "integers keep their dtype";
  pw.dtype_override = DType::kF32;  // a profile dtype rule beats the request
  plan = PlanFetch({PlannedTensor{&pw, {&w}}}, o);
  EXPECT_EQ(plan->tensors[0].dtype, DType::kF32);
  pw.quantize_fp8 = true;  // quantization beats both, with a scale companion
  o.fp8_scale = [](size_t index) -> absl::StatusOr<float> { return 0.5f; };
  plan = PlanFetch({PlannedTensor{&pw, {&w}}}, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->items.size(), 2u);
  EXPECT_EQ(plan->tensors[0].dtype, DType::kF8E4M3);
  EXPECT_EQ(*plan->items[0].fp8_scale, 0.5f);
  EXPECT_EQ(plan->tensors[1].name, "w_scale");
  EXPECT_EQ(*plan->items[1].scalar, 0.5f);
  FetchPlanOptions ints = Options(Mesh({1}, {0}));
  ints.dtype = DType::kI32;
  pw.quantize_fp8 = false;
  pw.dtype_override.reset();
  auto refused = PlanFetch({PlannedTensor{&pw, {&w}}}, ints);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FetchPlanTest, PatchesFollowTheirPartsAndProfilePlacementsMustFitTheMesh) {
  StoredTensor w = Stored("model.w", {4, 4});
  ServedTensorPlan p = Plan("w", {4, 4});
  FetchPlanOptions o = Options(Mesh({2}, {0}));
  std::vector<std::string> asked;
  o.patches = [&](const std::string& key) {
    asked.push_back(key);
    return std::vector<AppliedPatch>{};
  };
  ASSERT_TRUE(PlanFetch({PlannedTensor{&p, {&w}}}, o).ok());
  EXPECT_EQ(asked, (std::vector<std::string>{"model.w"})) << "keyed by checkpoint name";
  p.placements = *ParsePlacements("R,S0");
  auto bad = PlanFetch({PlannedTensor{&p, {&w}}}, o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "tensor \"w\": its profile placements"));
}

TEST(FetchPlanTest, MergeOnPushTakesPatchedRowRangesWithElementTermsOnly) {
  StoredTensor w = Stored("w", {6, 4}, DType::kBF16);
  auto lora = *LoraPatch::Create({Digest{}, "w"}, LowRankFactors{2, 4, 6, std::vector<float>(8, 1),
                                                                 std::vector<float>(12, 1)},
                                 0.5, false);
  std::vector<float> values(24);
  for (int i = 0; i < 24; ++i) values[i] = static_cast<float>(i);
  auto dense = *DensePatch::Create({Digest{}, "w"}, {6, 4}, values, DensePatch::Mode::kAdd);
  auto item = [&](ShardBox box, DType out) {
    MaterializeItem it;
    it.name = "w";
    it.out_dtype = out;
    PartSlice s;
    s.stored = &w;
    s.dtype = w.dtype;
    s.shape = w.shape;
    s.box = std::move(box);
    s.patches = {{lora, 1.0f}, {dense, 2.0f}};
    it.slices.push_back(std::move(s));
    return it;
  };
  MaterializeItem rows = item(ShardBox{{2, 0}, {3, 4}}, DType::kF32);
  auto merge = MergeOnPush(rows);
  ASSERT_NE(merge, nullptr);
  EXPECT_EQ(merge->cols, 4);
  EXPECT_EQ(merge->row_begin, 2);
  ASSERT_EQ(merge->terms.size(), 2u);
  EXPECT_EQ(merge->terms[0].kind, MergeTerm::kLowRank);
  EXPECT_EQ(merge->terms[1].kind, MergeTerm::kAdd);
  // the dense term narrowed to the box's rows, still indexed by global row
  EXPECT_EQ(merge->terms[1].v_len, 12u);
  EXPECT_EQ(merge->terms[1].v_row0, 2);
  EXPECT_EQ(merge->terms[1].v[(3 - 2) * 4 + 1], 13.0f);
  EXPECT_EQ(merge->hold.size(), 2u);
  // Same dtype too (the merge is the work).
  EXPECT_NE(MergeOnPush(item(ShardBox{{0, 0}, {6, 4}}, DType::kBF16)), nullptr);
  // Not: a column shard, an FP8 scale, an integer output, no patches, a
  // DoRA patch, several parts.
  EXPECT_EQ(MergeOnPush(item(ShardBox{{0, 1}, {6, 2}}, DType::kF32)), nullptr);
  MaterializeItem fp8 = item(ShardBox{{0, 0}, {6, 4}}, DType::kF8E4M3);
  fp8.fp8_scale = 1.0f;
  EXPECT_EQ(MergeOnPush(fp8), nullptr);
  EXPECT_EQ(MergeOnPush(item(ShardBox{{0, 0}, {6, 4}}, DType::kI32)), nullptr);
  MaterializeItem bare = rows;
  bare.slices[0].patches.clear();
  EXPECT_EQ(MergeOnPush(bare), nullptr);
  MaterializeItem dora = rows;
  dora.slices[0].patches.push_back(
      {*DoraPatch::Create({Digest{}, "w"}, lora->factors(), 1.0, std::vector<float>(6, 1.0f)),
       1.0f});
  EXPECT_EQ(MergeOnPush(dora), nullptr);
  MaterializeItem two = rows;
  two.slices.push_back(two.slices[0]);
  EXPECT_EQ(MergeOnPush(two), nullptr);
}

}  // namespace
}  // namespace weightd
