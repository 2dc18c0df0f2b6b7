#include "server/transport/export_cache.h"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

namespace weightd {
namespace {

ExportCache::Fill Filler(uint64_t size, int* fills, int* released) {
  return [=]() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
    ++*fills;
    auto b = std::make_unique<ExportedBuffer>();
    b->size = size;
    b->release = [released] { ++*released; };
    return b;
  };
}

TEST(ExportCacheTest, FillsOncePerTableAndDeviceAndRefillsForANewTable) {
  ExportCache cache(0);
  auto table = std::make_shared<int>(1);
  int fills = 0, released = 0;
  bool filled = false;
  auto a = cache.Get(table, "GPU-1", 100, Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(filled);
  auto b = cache.Get(table, "GPU-1", 100, Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(filled);
  EXPECT_EQ(a->get(), b->get());
  auto other = cache.Get(table, "host", 100, Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(filled);
  EXPECT_EQ(fills, 2);
  EXPECT_EQ(cache.bytes("GPU-1"), 100u);
  // The table dies: its buffers go once unheld, and the next Get fills.
  a = absl::InternalError("drop");
  b = absl::InternalError("drop");
  other = absl::InternalError("drop");
  table.reset();
  auto fresh = std::make_shared<int>(2);
  ASSERT_TRUE(cache.Get(fresh, "GPU-1", 100, Filler(100, &fills, &released), &filled).ok());
  EXPECT_TRUE(filled);
  EXPECT_EQ(released, 1);  // the dead table's GPU-1 buffer
  EXPECT_EQ(cache.stats().fills, 3u);
  EXPECT_EQ(cache.stats().hits, 1u);
}

TEST(ExportCacheTest, BudgetEvictsTheLeastRecentlyUsedUnheldBuffersOnly) {
  ExportCache cache(250);
  auto t1 = std::make_shared<int>(1), t2 = std::make_shared<int>(2),
       t3 = std::make_shared<int>(3), t4 = std::make_shared<int>(4);
  int fills = 0, released = 0;
  auto b1 = cache.Get(t1, "d", 100, Filler(100, &fills, &released));
  auto b2 = cache.Get(t2, "d", 100, Filler(100, &fills, &released));
  ASSERT_TRUE(b1.ok() && b2.ok());
  // Both held: a third does not fit.
  auto b3 = cache.Get(t3, "d", 100, Filler(100, &fills, &released));
  EXPECT_EQ(b3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b3.status().message().find("--device-memory-bytes"), absl::string_view::npos);
  // Over the budget alone: refused whatever is held.
  EXPECT_EQ(cache.Get(t4, "d", 300, Filler(300, &fills, &released)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Another device has its own budget.
  EXPECT_TRUE(cache.Get(t3, "e", 200, Filler(200, &fills, &released)).ok());
  // Let both go; touch t1 so t2 is the least recently used: t2 is evicted.
  b1 = absl::InternalError("drop");
  b2 = absl::InternalError("drop");
  ASSERT_TRUE(cache.Get(t1, "d", 100, Filler(100, &fills, &released)).ok());
  b3 = cache.Get(t3, "d", 100, Filler(100, &fills, &released));
  ASSERT_TRUE(b3.ok()) << b3.status();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(cache.bytes("d"), 200u);
  bool filled = true;
  ASSERT_TRUE(cache.Get(t1, "d", 100, Filler(100, &fills, &released), &filled).ok());
  EXPECT_FALSE(filled);  // t1 was kept
  EXPECT_EQ(cache.stats().evictions, 1u);
  // A fill that fails leaves nothing behind.
  auto t5 = std::make_shared<int>(5);
  auto failed = cache.Get(t5, "x", 10, []() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
    return absl::UnavailableError("no");
  });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.bytes("x"), 0u);
}

}  // namespace
}  // namespace weightd
