#include "server/memory/segment_pool.h"

#include <cstring>

#include <gtest/gtest.h>

#include "server/materialize/materializer.h"

namespace weightd {
namespace {

constexpr uint64_t kChunk = 1 << 20;

TEST(SegmentPoolTest, FillsToTargetAndHandsOutWritableChunks) {
  auto account = std::make_shared<MemoryAccount>(0);
  SegmentPool pool({account, 3 * kChunk + 100, kChunk});
  ASSERT_TRUE(pool.WaitFull(absl::Seconds(30)));
  SegmentPoolStats s = pool.stats();
  EXPECT_EQ(s.target_bytes, 3 * kChunk);  // whole chunks only
  EXPECT_EQ(s.ready_bytes, 3 * kChunk);
  EXPECT_EQ(account->used(), 3 * kChunk);

  std::unique_ptr<Segment> seg = pool.Take();
  ASSERT_NE(seg, nullptr);
  EXPECT_EQ(seg->size(), kChunk);
  ASSERT_NE(seg->mutable_data(), nullptr);
  std::memset(seg->mutable_data(), 0xAB, seg->size());
  ASSERT_TRUE(seg->Truncate(1000).ok());
  EXPECT_EQ(seg->size(), 1000u);
  EXPECT_FALSE(seg->Truncate(2000).ok());  // only shrinks
  ASSERT_TRUE(seg->Seal().ok());
  EXPECT_EQ(seg->data()[999], 0xAB);
  // The truncated tail went back to the account; the filler replaces the
  // chunk taken.
  ASSERT_TRUE(pool.WaitFull(absl::Seconds(30)));
  EXPECT_EQ(account->used(), 3 * kChunk + 1000);
  EXPECT_EQ(pool.stats().taken, 1u);
  EXPECT_GE(pool.stats().filled, 4u);
  seg.reset();
  EXPECT_EQ(account->used(), 3 * kChunk);
}

TEST(SegmentPoolTest, EmptyReserveGivesNothing) {
  auto account = std::make_shared<MemoryAccount>(0);
  SegmentPool pool({account, 0, kChunk});
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(pool.stats().missed, 1u);
  EXPECT_TRUE(pool.WaitFull(absl::Milliseconds(1)));  // target 0 is full
}

TEST(SegmentPoolTest, BudgetReclaimsTheReserveBeforeFailing) {
  auto account = std::make_shared<MemoryAccount>(6 * kChunk);
  SegmentPool pool({account, 4 * kChunk, kChunk, absl::Seconds(60)});
  ASSERT_TRUE(pool.WaitFull(absl::Seconds(30)));
  EXPECT_EQ(account->used(), 4 * kChunk);
  // 5 chunks fit only when the reserve gives 3 back.
  auto big = Segment::Create(account, "load", 5 * kChunk, /*prefault=*/false);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(pool.stats().ready_bytes, kChunk);
  EXPECT_EQ(pool.stats().reclaimed, 3u);
  EXPECT_EQ(account->used(), 6 * kChunk);
  // Nothing more to reclaim: a precise RESOURCE_EXHAUSTED.
  auto more = Segment::Create(account, "load", 2 * kChunk, false);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.stats().ready_bytes, 0u);
}

TEST(SegmentPoolTest, FillerLeavesAChunkOfTheBudgetFree) {
  auto account = std::make_shared<MemoryAccount>(4 * kChunk);
  SegmentPool pool({account, 4 * kChunk, kChunk});
  EXPECT_FALSE(pool.WaitFull(absl::Seconds(2)));
  EXPECT_EQ(pool.stats().ready_bytes, 3 * kChunk);  // used + 2 chunks <= limit
}

TEST(SegmentPoolTest, DisposedSegmentsAreFreedWhenIdleOrWhenTheBudgetNeedsThem) {
  auto account = std::make_shared<MemoryAccount>(4 * kChunk);
  SegmentPool pool({account, 0, kChunk});
  auto seg = Segment::Create(account, "shard", 2 * kChunk, true);
  ASSERT_TRUE(seg.ok());
  SegmentPtr held(std::move(*seg));
  SegmentPtr extra = held;  // someone else still holds it
  pool.BeginWork();
  pool.Dispose(std::move(held));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(pool.stats().disposing, 1u);  // busy: nothing happens
  pool.EndWork();
  for (int i = 0; i < 100 && pool.stats().disposing != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(pool.stats().disposing, 0u);
  EXPECT_EQ(account->used(), 2 * kChunk);  // `extra` keeps it alive
  extra.reset();
  EXPECT_EQ(account->used(), 0u);

  // While busy, a reservation the budget cannot hold frees the graveyard.
  auto again = Segment::Create(account, "shard", 3 * kChunk, true);
  ASSERT_TRUE(again.ok());
  pool.BeginWork();
  pool.Dispose(SegmentPtr(std::move(*again)));
  EXPECT_EQ(account->used(), 3 * kChunk);
  auto big = Segment::Create(account, "load", 4 * kChunk, false);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(pool.stats().disposing, 0u);
  pool.EndWork();
}

// A stored F32 tensor of n values i * 0.5 in its own sealed segment.
StoredTensor MakeTensor(const std::shared_ptr<MemoryAccount>& account, std::string name,
                        int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  auto seg = Segment::Create(account, "base", n * 4, false);
  EXPECT_TRUE(seg.ok());
  for (int64_t i = 0; i < n; ++i) {
    float v = static_cast<float>(i) * 0.5f;
    std::memcpy((*seg)->mutable_data() + i * 4, &v, 4);
  }
  EXPECT_TRUE((*seg)->Seal().ok());
  StoredTensor t;
  t.name = std::move(name);
  t.dtype = DType::kF32;
  t.shape = {rows, cols};
  t.length = n * 4;
  t.buffer = SegmentPtr(std::move(*seg));
  t.digest = DigestBytes(t.buffer->host_data(), t.length);
  return t;
}

TEST(SegmentPoolTest, MaterializerPacksMissesIntoReserveChunks) {
  HostMemoryManager memory({.warm_reserve_bytes = 8 * kChunk, .reserve_chunk_bytes = kChunk});
  HostMemoryManager plain({});  // no reserve
  auto account = memory.account();
  ASSERT_TRUE(memory.WaitReserveFull(absl::Seconds(30)));
  // Five tensors of 0.4 MiB as BF16 (0.2 MiB out) and one of 3 MiB F32 ->
  // 1.5 MiB BF16, bigger than a chunk.
  std::vector<StoredTensor> tensors;
  for (int i = 0; i < 5; ++i) tensors.push_back(MakeTensor(account, "t" + std::to_string(i), 100, 1024));
  tensors.push_back(MakeTensor(account, "big", 768, 1024));
  std::vector<MaterializeItem> items;
  for (const StoredTensor& t : tensors) {
    MaterializeItem item;
    item.name = t.name;
    item.slices.push_back(PartSlice{&t, t.dtype, t.shape, ShardBox{{0, 0}, t.shape}, {}});
    item.out_dtype = DType::kBF16;
    items.push_back(std::move(item));
  }
  Materializer with_pool({&memory, 2});
  Materializer without({&plain, 2});
  auto a = with_pool.Materialize(items);
  auto b = without.Materialize(items);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const MaterializedTensor& x = (*a)[i];
    const MaterializedTensor& y = (*b)[i];
    ASSERT_EQ(x.length, y.length);
    EXPECT_EQ(x.digest, y.digest) << items[i].name;
    // Digests are computed while filling; they must be those of the bytes.
    EXPECT_EQ(x.digest, DigestBytes(x.buffer->host_data() + x.offset, x.length)) << items[i].name;
    EXPECT_EQ(std::memcmp(x.buffer->host_data() + x.offset, y.buffer->host_data() + y.offset, x.length),
              0);
    EXPECT_TRUE(x.buffer->ShareableFd().ok());
    EXPECT_LE(x.offset + x.length, x.buffer->size());
  }
  // The five small ones share one chunk (truncated to what they use); the
  // big one has a fresh segment of its own; no fetch gets one segment per
  // tensor.
  EXPECT_EQ((*a)[0].buffer, (*a)[4].buffer);
  EXPECT_LT((*a)[0].buffer->size(), kChunk);
  EXPECT_NE((*a)[5].buffer, (*a)[0].buffer);
  EXPECT_EQ((*a)[5].buffer->size(), 768u * 1024 * 2);
  EXPECT_EQ(memory.stats().reserve.taken, 1u);
  // Without a pool, everything goes in one segment.
  EXPECT_EQ((*b)[0].buffer, (*b)[5].buffer);
}

TEST(SegmentPoolTest, MaterializerSplitsAcrossChunksWhenOneIsFull) {
  HostMemoryManager memory({.warm_reserve_bytes = 4 * kChunk, .reserve_chunk_bytes = kChunk});
  auto account = memory.account();
  ASSERT_TRUE(memory.WaitReserveFull(absl::Seconds(30)));
  std::vector<StoredTensor> tensors;
  for (int i = 0; i < 6; ++i) tensors.push_back(MakeTensor(account, "t" + std::to_string(i), 256, 1024));
  std::vector<MaterializeItem> items;
  for (const StoredTensor& t : tensors) {
    MaterializeItem item;
    item.name = t.name;
    item.slices.push_back(PartSlice{&t, t.dtype, t.shape, ShardBox{{0, 0}, t.shape}, {}});
    item.out_dtype = DType::kBF16;  // 0.5 MiB each: two per chunk
    items.push_back(std::move(item));
  }
  Materializer m({&memory, 2});
  auto r = m.Materialize(items);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].buffer, (*r)[1].buffer);
  EXPECT_NE((*r)[1].buffer, (*r)[2].buffer);
  EXPECT_EQ((*r)[4].buffer, (*r)[5].buffer);
  EXPECT_EQ(memory.stats().reserve.taken, 3u);
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<uint16_t> got((*r)[i].length / 2);
    std::memcpy(got.data(), (*r)[i].buffer->host_data() + (*r)[i].offset, (*r)[i].length);
    // i * 0.5 is exact in BF16 for small i; check a few.
    EXPECT_EQ(got[0], 0);
    EXPECT_EQ(got[1], 0x3F00);  // 0.5
    EXPECT_EQ(got[2], 0x3F80);  // 1.0
  }
}

}  // namespace
}  // namespace weightd
