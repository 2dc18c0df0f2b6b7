#include "server/materialize/pack_plan.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace weightd {
namespace {

// A stored tensor as planning sees it: no bytes are touched, so no buffer.
StoredTensor Stored(std::string name, DType dtype, std::vector<int64_t> shape,
                    uint64_t offset = 0) {
  StoredTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.offset = offset;
  t.length = static_cast<uint64_t>(t.NumElements()) * DTypeSize(dtype);
  return t;
}

MaterializeItem Item(const StoredTensor& t, ShardBox box, DType out) {
  MaterializeItem item;
  item.name = t.name;
  item.out_dtype = out;
  item.slices.push_back(PartSlice{&t, t.dtype, t.shape, std::move(box), {}});
  return item;
}

ShardBox Box(std::vector<int64_t> offset, std::vector<int64_t> shape) {
  return ShardBox{std::move(offset), std::move(shape)};
}

TEST(PackPlanTest, ContiguousRowsInTheStoredDtypeAreViewsAtTheirByteOffset) {
  StoredTensor w = Stored("w", DType::kBF16, {8, 6}, /*offset=*/4096);
  // Rows 4..7 of an [8, 6] bf16 tensor start at element 24, byte 48.
  std::vector<MaterializeItem> items = {Item(w, Box({4, 0}, {4, 6}), DType::kBF16)};
  auto plan = PlanPack(items, {0}, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->slots.size(), 1u);
  EXPECT_TRUE(plan->slots[0].view);
  EXPECT_EQ(plan->slots[0].offset, 4096u + 48u);
  EXPECT_EQ(plan->slots[0].length, 4u * 6 * 2);
  EXPECT_TRUE(plan->groups.empty());
}

TEST(PackPlanTest, AnEmptyBoxIsAViewAtTheTensorsStart) {
  // A [0, n] tensor split on dim 1: the box's linear start would lie past it.
  StoredTensor w = Stored("w", DType::kF32, {0, 8}, /*offset=*/128);
  std::vector<MaterializeItem> items = {Item(w, Box({0, 4}, {0, 4}), DType::kF32)};
  auto plan = PlanPack(items, {0}, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->slots[0].view);
  EXPECT_EQ(plan->slots[0].offset, 128u);
  EXPECT_EQ(plan->slots[0].length, 0u);
}

TEST(PackPlanTest, CastsAndColumnSlicesArePackedInOrderOn64ByteBoundaries) {
  StoredTensor a = Stored("a", DType::kF32, {4, 5});
  StoredTensor b = Stored("b", DType::kF32, {3, 3});
  std::vector<MaterializeItem> items = {
      Item(a, Box({0, 0}, {4, 5}), DType::kBF16),  // a cast: 40 bytes
      Item(a, Box({0, 0}, {4, 5}), DType::kF32),   // a view
      Item(b, Box({0, 1}, {3, 2}), DType::kF32),   // a column slice: 24 bytes
  };
  // Item 1 was a cache hit: only 0 and 2 are planned, in that order.
  auto plan = PlanPack(items, {0, 2}, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->slots.size(), 2u);
  ASSERT_EQ(plan->groups.size(), 1u);
  EXPECT_EQ(plan->slots[0].item, 0u);
  EXPECT_EQ(plan->slots[1].item, 2u);
  EXPECT_FALSE(plan->slots[0].view);
  EXPECT_EQ(plan->slots[0].offset, 0u);
  EXPECT_EQ(plan->slots[0].length, 40u);
  EXPECT_EQ(plan->slots[1].offset, 64u);
  EXPECT_EQ(plan->slots[1].length, 24u);
  EXPECT_EQ(plan->groups[0].bytes, 128u);
  EXPECT_EQ(plan->groups[0].slots, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(plan->groups[0].first_base, &a);
  EXPECT_FALSE(plan->groups[0].tagged);
}

TEST(PackPlanTest, ChunksFillInOrderAndAnItemLargerThanAChunkGetsItsOwn) {
  StoredTensor t = Stored("t", DType::kF32, {1024});
  std::vector<MaterializeItem> items = {
      Item(t, Box({0}, {100}), DType::kF16),   // 200 -> 256 bytes
      Item(t, Box({0}, {100}), DType::kBF16),  // 200 -> 256: chunk 0 is full (512)
      Item(t, Box({0}, {1000}), DType::kF16),  // 2000 > 512: its own group
      Item(t, Box({0}, {10}), DType::kF16),    // 20: a new chunk, not the big group
  };
  auto plan = PlanPack(items, {0, 1, 2, 3}, /*chunk_bytes=*/512);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->groups.size(), 3u);
  EXPECT_EQ(plan->slots[0].group, 0u);
  EXPECT_EQ(plan->slots[1].group, 0u);
  EXPECT_EQ(plan->slots[1].offset, 256u);
  EXPECT_EQ(plan->slots[2].group, 1u);
  EXPECT_EQ(plan->slots[2].offset, 0u);
  EXPECT_EQ(plan->groups[1].bytes, 2048u);
  EXPECT_EQ(plan->slots[3].group, 2u);
  EXPECT_EQ(plan->slots[3].offset, 0u);
  EXPECT_EQ(plan->groups[0].bytes, 512u);
  EXPECT_EQ(plan->groups[2].bytes, 64u);
}

TEST(PackPlanTest, PatchedQuantizedAndScalarItemsTagTheirGroup) {
  StoredTensor t = Stored("t", DType::kF32, {4, 4});
  MaterializeItem fp8 = Item(t, Box({0, 0}, {4, 4}), DType::kF8E4M3);
  fp8.fp8_scale = 0.5f;
  MaterializeItem scalar;
  scalar.name = "t_scale";
  scalar.scalar = 0.5f;
  std::vector<MaterializeItem> items = {Item(t, Box({0, 0}, {4, 4}), DType::kF16), fp8, scalar};
  auto untagged = PlanPack(items, {0}, 0);
  ASSERT_TRUE(untagged.ok());
  EXPECT_FALSE(untagged->groups[0].tagged);
  for (size_t i : {1, 2}) {
    auto plan = PlanPack(items, {0, i}, 0);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->groups[0].tagged) << i;
  }
  auto scalar_only = PlanPack(items, {2}, 0);
  ASSERT_TRUE(scalar_only.ok());
  EXPECT_EQ(scalar_only->slots[0].length, 4u);
  EXPECT_EQ(scalar_only->groups[0].first_base, nullptr);
}

TEST(PackPlanTest, AnUnsupportedCastFailsNamingTheTensorAndBothDtypes) {
  StoredTensor ids = Stored("token_ids", DType::kI64, {4});
  std::vector<MaterializeItem> items = {Item(ids, Box({0}, {4}), DType::kF32)};
  auto plan = PlanPack(items, {0}, 0);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(plan.status().message(),
                                "tensor \"token_ids\": cannot convert I64 to F32"))
      << plan.status();
}

}  // namespace
}  // namespace weightd
