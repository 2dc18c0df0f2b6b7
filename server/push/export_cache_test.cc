#include "server/push/export_cache.h"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "server/memory/host_memory.h"

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

ExportRequest Ask(const std::shared_ptr<const void>& table, const std::string& device,
                  uint64_t size, uid_t holder = 1000, uint64_t device_bytes = 1 << 20,
                  uint64_t holder_bytes = 1 << 20) {
  return ExportRequest{.table = table,
                       .device = device,
                       .size = size,
                       .holder = holder,
                       .device_bytes = device_bytes,
                       .holder_bytes = holder_bytes};
}

bool Mentions(const absl::Status& s, absl::string_view what) {
  return s.message().find(what) != absl::string_view::npos;
}

TEST(ExportCacheTest, FillsOncePerTableAndDeviceAndRefillsForANewTable) {
  ExportCache cache;
  auto table = std::make_shared<int>(1);
  int fills = 0, released = 0;
  bool filled = false;
  auto a = cache.Get(Ask(table, "GPU-1", 100), Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(filled);
  auto b = cache.Get(Ask(table, "GPU-1", 100), Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(filled);
  EXPECT_EQ(&a->buffer(), &b->buffer());
  auto other = cache.Get(Ask(table, "host", 100), Filler(100, &fills, &released), &filled);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(filled);
  EXPECT_EQ(fills, 2);
  EXPECT_EQ(cache.bytes("GPU-1"), 100u);
  EXPECT_EQ(cache.stats().held, 2u);
  // Let go while the table lives: kept, unheld.
  other = absl::InternalError("drop");
  EXPECT_EQ(cache.bytes("host"), 100u);
  EXPECT_EQ(released, 0);
  // The table dies: an unheld buffer of it goes with the next Get, a held
  // one when its last hold does, and the next Get fills afresh.
  table.reset();
  auto fresh = std::make_shared<int>(2);
  ASSERT_TRUE(cache.Get(Ask(fresh, "GPU-1", 100), Filler(100, &fills, &released), &filled).ok());
  EXPECT_TRUE(filled);
  EXPECT_EQ(released, 1);  // the dead table's unheld host buffer
  EXPECT_EQ(cache.bytes("host"), 0u);
  EXPECT_EQ(cache.bytes("GPU-1"), 200u);  // the dead one is still held
  a = absl::InternalError("drop");
  EXPECT_EQ(released, 1);
  b = absl::InternalError("drop");
  EXPECT_EQ(released, 2);  // its last hold went
  EXPECT_EQ(cache.bytes("GPU-1"), 100u);  // the fresh one, kept unheld
  EXPECT_EQ(cache.stats().fills, 3u);
  EXPECT_EQ(cache.stats().hits, 1u);
}

TEST(ExportCacheTest, BudgetEvictsTheLeastRecentlyUsedUnheldBuffersOnly) {
  ExportCache cache;
  auto t1 = std::make_shared<int>(1), t2 = std::make_shared<int>(2),
       t3 = std::make_shared<int>(3), t4 = std::make_shared<int>(4);
  int fills = 0, released = 0;
  auto ask = [](auto t, const std::string& d, uint64_t size) { return Ask(t, d, size, 1000, 250); };
  auto b1 = cache.Get(ask(t1, "d", 100), Filler(100, &fills, &released));
  auto b2 = cache.Get(ask(t2, "d", 100), Filler(100, &fills, &released));
  ASSERT_TRUE(b1.ok() && b2.ok());
  // Both held: a third does not fit.
  auto b3 = cache.Get(ask(t3, "d", 100), Filler(100, &fills, &released));
  EXPECT_EQ(b3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(b3.status(), "--device-memory-bytes")) << b3.status();
  EXPECT_TRUE(Mentions(b3.status(), "held")) << b3.status();
  // Over the budget alone: refused whatever is held.
  EXPECT_EQ(cache.Get(ask(t4, "d", 300), Filler(300, &fills, &released)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Another device has its own budget.
  auto on_e = cache.Get(ask(t3, "e", 200), Filler(200, &fills, &released));
  EXPECT_TRUE(on_e.ok());
  // Let both go; touch t1 so t2 is the least recently used: t2 is evicted.
  b1 = absl::InternalError("drop");
  b2 = absl::InternalError("drop");
  ASSERT_TRUE(cache.Get(ask(t1, "d", 100), Filler(100, &fills, &released)).ok());
  b3 = cache.Get(ask(t3, "d", 100), Filler(100, &fills, &released));
  ASSERT_TRUE(b3.ok()) << b3.status();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(cache.bytes("d"), 200u);
  bool filled = true;
  ASSERT_TRUE(cache.Get(ask(t1, "d", 100), Filler(100, &fills, &released), &filled).ok());
  EXPECT_FALSE(filled);  // t1 was kept
  EXPECT_EQ(cache.stats().evictions, 1u);
  // A fill that fails leaves nothing behind.
  auto t5 = std::make_shared<int>(5);
  auto failed = cache.Get(ask(t5, "x", 10), []() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
    return absl::UnavailableError("no");
  });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.bytes("x"), 0u);
}

TEST(ExportCacheTest, OneHolderGetsItsShareAndOthersStillExport) {
  ExportCache cache;
  auto t1 = std::make_shared<int>(1), t2 = std::make_shared<int>(2),
       t3 = std::make_shared<int>(3);
  int fills = 0, released = 0;
  // A device budget of 400, a share of 150 per holder.
  auto ask = [](auto t, uid_t holder) { return Ask(t, "host", 100, holder, 400, 150); };
  auto first = cache.Get(ask(t1, 1000), Filler(100, &fills, &released));
  ASSERT_TRUE(first.ok());
  auto second = cache.Get(ask(t2, 1000), Filler(100, &fills, &released));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(second.status(), "uid 1000 holds 100 bytes")) << second.status();
  EXPECT_TRUE(Mentions(second.status(), "--max-export-bytes-per-uid")) << second.status();
  EXPECT_EQ(fills, 1);  // refused before any fill
  // What it holds already counts once, however often it takes it.
  auto again = cache.Get(ask(t1, 1000), Filler(100, &fills, &released));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(cache.held_bytes("host", 1000), 100u);
  // Another uid, root included, has its own share: even of the same buffer.
  auto root = cache.Get(ask(t2, 0), Filler(100, &fills, &released));
  ASSERT_TRUE(root.ok()) << root.status();
  auto other = cache.Get(ask(t1, 1001), Filler(100, &fills, &released));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(cache.held_bytes("host", 1001), 100u);
  EXPECT_EQ(cache.stats().refusals, 1u);
  // Once it lets go of both its holds, its share is free again.
  first = absl::InternalError("drop");
  EXPECT_EQ(cache.held_bytes("host", 1000), 100u);
  again = absl::InternalError("drop");
  EXPECT_EQ(cache.held_bytes("host", 1000), 0u);
  auto now = cache.Get(ask(t3, 1000), Filler(100, &fills, &released));
  EXPECT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(released, 0);  // nothing had to go: 300 of 400
}

TEST(ExportCacheTest, BuffersAreCountedInAllAndPerHolder) {
  ExportCache cache({.max_buffers = 3, .max_buffers_per_holder = 2});
  std::vector<std::shared_ptr<int>> tables;
  for (int i = 0; i < 5; ++i) tables.push_back(std::make_shared<int>(i));
  int fills = 0, released = 0;
  auto a = cache.Get(Ask(tables[0], "host", 1, 1000), Filler(1, &fills, &released));
  auto b = cache.Get(Ask(tables[1], "GPU-1", 1, 1000), Filler(1, &fills, &released));
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = cache.Get(Ask(tables[2], "host", 1, 1000), Filler(1, &fills, &released));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(c.status(), "limit per uid (2)")) << c.status();
  c = cache.Get(Ask(tables[2], "host", 1, 1001), Filler(1, &fills, &released));
  ASSERT_TRUE(c.ok());
  // Three held: a fourth buffer has no room.
  auto d = cache.Get(Ask(tables[3], "host", 1, 1002), Filler(1, &fills, &released));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(d.status(), "the daemon's limit (3")) << d.status();
  // An unheld one makes room, on whichever device it is.
  b = absl::InternalError("drop");
  d = cache.Get(Ask(tables[3], "host", 1, 1002), Filler(1, &fills, &released));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(cache.bytes("GPU-1"), 0u);
}

// The host twin's buffers are segments charged to the host budget: a
// reservation short of budget has the reclaimer drop unheld ones (least
// recently used first), never held ones.
TEST(ExportCacheTest, ReclaimGivesUnheldHostBuffersBackToTheBudget) {
  constexpr uint64_t kPage = 4096;
  HostMemoryManager memory(HostMemoryManager::Options{.limit_bytes = 8 * kPage});
  ExportCache cache;
  const uint64_t reclaimer = memory.AddReclaimer(
      MemoryAccount::kRankCache, [&](uint64_t bytes) { return cache.Reclaim("host", bytes); });
  auto fill = [&memory]() -> absl::StatusOr<std::unique_ptr<ExportedBuffer>> {
    auto seg = memory.Allocate(2 * kPage, {.purpose = "export"});
    if (!seg.ok()) return seg.status();
    if (absl::Status s = (*seg)->Seal(); !s.ok()) return s;
    auto b = std::make_unique<ExportedBuffer>();
    b->size = (*seg)->size();
    b->segment = std::move(*seg);
    return b;
  };
  std::vector<std::shared_ptr<int>> tables;
  for (int i = 0; i < 4; ++i) tables.push_back(std::make_shared<int>(i));
  std::vector<ExportHold> holds;
  for (int i = 0; i < 3; ++i) {
    auto h = cache.Get(Ask(tables[i], "host", 2 * kPage), fill);
    ASSERT_TRUE(h.ok()) << h.status();
    holds.push_back(*std::move(h));
  }
  EXPECT_EQ(memory.stats().used_bytes, 6 * kPage);  // counted as resident
  // Held: nothing to reclaim; the budget refuses.
  EXPECT_EQ(memory.Allocate(4 * kPage, {.purpose = "load"}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.bytes("host"), 6 * kPage);
  // Let go of two (table 0 first): a load of 4 pages takes table 0's back.
  holds[0].Reset();
  holds[1].Reset();
  EXPECT_EQ(memory.stats().used_bytes, 6 * kPage);  // kept while nobody needs the room
  auto load = memory.Allocate(4 * kPage, {.purpose = "load"});
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(cache.bytes("host"), 4 * kPage);
  bool filled = true;
  ASSERT_TRUE(cache.Get(Ask(tables[1], "host", 2 * kPage), fill, &filled).ok());
  EXPECT_FALSE(filled);  // table 1's was kept
  EXPECT_EQ(cache.stats().evictions, 1u);
  // A fill short of budget reclaims too: table 3's fill takes table 1's.
  auto third = cache.Get(Ask(tables[3], "host", 2 * kPage), fill, &filled);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(filled);
  EXPECT_EQ(memory.stats().used_bytes, 8 * kPage);
  memory.RemoveReclaimer(reclaimer);
}

}  // namespace
}  // namespace weightd
