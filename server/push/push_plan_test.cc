#include "server/push/push_plan.h"

#include <vector>

#include <gtest/gtest.h>

#include "server/memory/segment.h"

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
  // A plain copy (as the tables below write them) writes what it reads.
  const uint64_t a_dst = a.cast ? a.dst_length : a.length;
  const uint64_t b_dst = b.cast ? b.dst_length : b.length;
  return a.buffer == b.buffer && a.src_offset == b.src_offset && a.dst_offset == b.dst_offset &&
         a.length == b.length && a.stream == b.stream && a.cast == b.cast && a_dst == b_dst &&
         a.merge == b.merge && a.first_element == b.first_element &&
         (!a.cast || (a.src_dtype == b.src_dtype && a.dst_dtype == b.dst_dtype));
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
    EXPECT_EQ(c.first_element, elements);
    EXPECT_EQ(c.merge, nullptr);
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

TEST(PlanPushCopiesTest, MergesGoWithTheirPiecesAndTheirFirstElement) {
  // A merged F32 -> BF16 tensor of 3 rows x 5 from row 2 of a 6-row
  // parameter: 15 elements, 8-byte scratch = 2 elements a piece.
  auto merge = std::make_shared<PushMerge>();
  merge->cols = 5;
  merge->row_begin = 2;
  LeaseTensor t = Cast(0, 40, 60, DType::kF32, DType::kBF16);
  t.merge = merge;
  std::vector<PushCopy> plan =
      PlanPushCopies({t}, Layout({256}, {30}), {.streams = 2, .max_cast_bytes = 8});
  ASSERT_EQ(plan.size(), 8u);
  for (size_t i = 0; i < plan.size(); ++i) {
    EXPECT_EQ(plan[i].merge, merge.get());
    EXPECT_EQ(plan[i].first_element, 2 * i);
    EXPECT_EQ(plan[i].src_offset, 40 + 8 * i);
    EXPECT_EQ(plan[i].dst_offset, 256 + 4 * i);
    EXPECT_EQ(plan[i].stream, static_cast<int>(i % 2));
  }
  EXPECT_EQ(plan.back().length, 4u);
}

TEST(PlanPushCopiesTest, CheckLeaseTensorsRefusesAMergeThatWouldReadPastItsTerms) {
  std::vector<float> x(6 * 2), y(2 * 5), v(4 * 5);
  auto lease_of = [&](MergeTerm term, int64_t row_begin, uint64_t rows) {
    auto merge = std::make_shared<PushMerge>();
    merge->cols = 5;
    merge->row_begin = row_begin;
    merge->terms = {term};
    LeaseTensor t = Cast(0, 0, rows * 5 * 4, DType::kF32, DType::kF32);
    t.merge = merge;
    LeaseContents lease;
    auto account = std::make_shared<MemoryAccount>(0);
    auto seg = Segment::Create(account, "src", 4096, false);
    EXPECT_TRUE(seg.ok());
    lease.buffers.push_back(SegmentPtr(std::move(*seg)));
    lease.tensors = std::make_shared<std::vector<LeaseTensor>>(std::vector<LeaseTensor>{t});
    return CheckLeaseTensors(lease);
  };
  // B [6, 2] @ A [2, 5]: rows 2..5 fit, rows 3..6 do not.
  MergeTerm low;
  low.kind = MergeTerm::kLowRank;
  low.rank = 2;
  low.x = x.data(), low.x_r = 2, low.x_k = 1, low.x_len = x.size();
  low.y = y.data(), low.y_k = 5, low.y_c = 1, low.y_len = y.size();
  EXPECT_TRUE(lease_of(low, 2, 4).ok());
  EXPECT_EQ(lease_of(low, 3, 4).code(), absl::StatusCode::kInternal);
  MergeTerm short_y = low;
  short_y.y_len = 9;
  EXPECT_EQ(lease_of(short_y, 0, 1).code(), absl::StatusCode::kInternal);
  // A dense term narrowed to rows 1..4.
  MergeTerm dense;
  dense.kind = MergeTerm::kAdd;
  dense.v = v.data(), dense.v_row0 = 1, dense.v_len = v.size();
  EXPECT_TRUE(lease_of(dense, 1, 4).ok());
  EXPECT_EQ(lease_of(dense, 0, 2).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(lease_of(dense, 2, 4).code(), absl::StatusCode::kInternal);
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
