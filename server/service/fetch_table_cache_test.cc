#include "server/service/fetch_table_cache.h"

#include <gtest/gtest.h>

#include "server/memory/segment.h"

namespace weightd {
namespace {

struct Fixture {
  std::shared_ptr<MemoryAccount> account = std::make_shared<MemoryAccount>(0);
  SegmentPtr Segment(uint64_t size = 4096) {
    auto seg = Segment::Create(account, "test", size, false);
    EXPECT_TRUE(seg.ok());
    return SegmentPtr(std::move(*seg));
  }
};

std::shared_ptr<const FetchTable> Table(uint64_t generation) {
  auto t = std::make_shared<FetchTable>();
  t->generation = generation;
  return t;
}

TEST(FetchTableCacheTest, HitsOnlyTheSameGenerationWhileItsSegmentsLive) {
  Fixture f;
  FetchTableCache cache;
  auto gen = std::make_shared<int>(1);
  SegmentPtr seg = f.Segment();
  ReadGuard guard{"model \"m\"", ReaderList()};
  cache.Store("k", gen, Table(1), {seg}, {guard});
  auto hit = cache.Lookup("k", gen);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->table->generation, 1u);
  ASSERT_EQ(hit->buffers.size(), 1u);
  EXPECT_EQ(hit->buffers[0], seg) << "held for the lease";
  EXPECT_EQ(hit->guards.size(), 1u);
  // Another generation object under the same key (an unload and reload that
  // reached the same number): a miss, and the entry goes.
  EXPECT_FALSE(cache.Lookup("k", std::make_shared<int>(1)).has_value());
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_FALSE(cache.Lookup("other", gen).has_value());
}

TEST(FetchTableCacheTest, NeverKeepsSegmentsOrGenerationsAlive) {
  Fixture f;
  FetchTableCache cache;
  auto gen = std::make_shared<int>(1);
  SegmentPtr seg = f.Segment();
  cache.Store("k", gen, Table(1), {seg}, {});
  std::weak_ptr<const weightd::Segment> weak = seg;
  seg.reset();  // evicted by the materializer
  EXPECT_TRUE(weak.expired()) << "the cache held the segment";
  EXPECT_EQ(f.account->used(), 0u);
  EXPECT_FALSE(cache.Lookup("k", gen).has_value());
  // A retired generation's entries go with the next store.
  SegmentPtr live = f.Segment();
  auto old_gen = std::make_shared<int>(2);
  cache.Store("a", old_gen, Table(2), {live}, {});
  old_gen.reset();
  cache.Store("b", gen, Table(1), {live}, {});
  EXPECT_EQ(cache.size(), 1u);
}

TEST(FetchTableCacheTest, StaysBoundedByItsCapacity) {
  Fixture f;
  FetchTableCache cache(/*capacity=*/4);
  auto gen = std::make_shared<int>(1);
  SegmentPtr seg = f.Segment();
  for (int i = 0; i < 10; ++i) {
    cache.Store("k" + std::to_string(i), gen, Table(1), {seg}, {});
    EXPECT_LE(cache.size(), 4u);
  }
  EXPECT_TRUE(cache.Lookup("k9", gen).has_value());
}

}  // namespace
}  // namespace weightd
