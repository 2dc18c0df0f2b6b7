#include "server/memory/host_memory.h"

#include <sys/mman.h>

#include <cstring>

#include <gtest/gtest.h>

#include "server/memory/buffer.h"

namespace weightd {
namespace {

constexpr uint64_t kChunk = 1 << 20;

TEST(BufferTest, ASegmentIsHostMemoryWithItsSealedMemfdToShare) {
  HostMemoryManager memory({});
  auto seg = memory.Allocate(4096, {.purpose = "test"});
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset((*seg)->mutable_data(), 0x5A, 4096);
  // Not shareable while it can still change.
  EXPECT_EQ((*seg)->ShareableFd().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*seg)->Seal().ok());
  BufferPtr buffer = SegmentPtr(std::move(*seg));
  EXPECT_EQ(buffer->kind(), MemoryKind::kHost);
  EXPECT_EQ(buffer->location(), MemoryLocation{});
  EXPECT_EQ(buffer->location().device, -1);
  EXPECT_EQ(MemoryKindName(buffer->kind()), "host");
  EXPECT_EQ(buffer->size(), 4096u);
  ASSERT_NE(buffer->host_data(), nullptr);
  EXPECT_EQ(buffer->host_data()[4095], 0x5A);
  // The fd maps to the same bytes, read-only; a writable mapping is refused
  // (the seals hold).
  auto fd = buffer->ShareableFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  void* ro = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(ro, MAP_FAILED);
  EXPECT_EQ(std::memcmp(ro, buffer->host_data(), 4096), 0);
  ::munmap(ro, 4096);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0), MAP_FAILED);
}

TEST(HostMemoryManagerTest, AllocationsAndChargesCountAgainstOneBudget) {
  HostMemoryManager memory({.limit_bytes = 3 * kChunk});
  auto a = memory.Allocate(kChunk, {.purpose = "checkpoint"});
  ASSERT_TRUE(a.ok()) << a.status();
  auto c = memory.Charge(kChunk, "metadata of 7 tensors");
  ASSERT_TRUE(c.ok()) << c.status();
  HostMemoryStats s = memory.stats();
  EXPECT_EQ(s.limit_bytes, 3 * kChunk);
  EXPECT_EQ(s.used_bytes, 2 * kChunk);
  EXPECT_EQ(s.segments, 1u);
  auto refused = memory.Allocate(2 * kChunk, {.purpose = "checkpoint"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("segment for checkpoint"), std::string::npos)
      << refused.status();
  auto refused_charge = memory.Charge(2 * kChunk, "adapter \"x\"");
  EXPECT_EQ(refused_charge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused_charge.status().message().find("adapter \"x\""), std::string::npos);
  c->reset();
  a->reset();
  EXPECT_EQ(memory.stats().used_bytes, 0u);
  EXPECT_EQ(memory.stats().segments, 0u);
}

TEST(HostMemoryManagerTest, WarmAllocationsComeFromTheReserveTruncatedToSize) {
  HostMemoryManager memory({.warm_reserve_bytes = 2 * kChunk, .reserve_chunk_bytes = kChunk});
  EXPECT_EQ(memory.reserve_chunk_bytes(), kChunk);
  ASSERT_TRUE(memory.WaitReserveFull(absl::Seconds(30)));
  auto warm = memory.Allocate(1000, {.purpose = "shard", .warm = true});
  ASSERT_TRUE(warm.ok()) << warm.status();
  EXPECT_EQ((*warm)->size(), 1000u);
  EXPECT_EQ(memory.stats().reserve.taken, 1u);
  // Larger than a chunk, or not asked warm: a fresh segment.
  auto big = memory.Allocate(kChunk + 1, {.purpose = "shard", .warm = true});
  ASSERT_TRUE(big.ok());
  auto cold = memory.Allocate(1000, {.purpose = "checkpoint"});
  ASSERT_TRUE(cold.ok());
  EXPECT_EQ(memory.stats().reserve.taken, 1u);
  // Without a reserve, warm is just prefaulted.
  HostMemoryManager plain({});
  EXPECT_EQ(plain.reserve_chunk_bytes(), 0u);
  EXPECT_TRUE(plain.WaitReserveFull(absl::Milliseconds(1)));
  auto p = plain.Allocate(1000, {.purpose = "shard", .warm = true});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(plain.stats().reserve.taken, 0u);
}

TEST(HostMemoryManagerTest, TheChainFreesDisposerThenReserveThenOwnersBeforeRefusing) {
  // Budget 8 chunks: a reserve of 2, a retired chunk waiting on the
  // disposer, an owner's reclaimable chunk (rank 20, like the cache).
  HostMemoryManager memory({.limit_bytes = 8 * kChunk,
                            .warm_reserve_bytes = 2 * kChunk,
                            .reserve_chunk_bytes = kChunk,
                            .dispose_min_bytes = 1});
  ASSERT_TRUE(memory.WaitReserveFull(absl::Seconds(30)));
  std::vector<int> order;
  std::unique_ptr<Segment> owned = *memory.Allocate(kChunk, {.purpose = "cache"});
  const uint64_t id = memory.AddReclaimer(MemoryAccount::kRankCache, [&](uint64_t) {
    order.push_back(MemoryAccount::kRankCache);
    if (owned == nullptr) return uint64_t{0};
    owned.reset();
    return kChunk;
  });
  auto held = memory.Allocate(3 * kChunk, {.purpose = "held"});
  ASSERT_TRUE(held.ok());
  {
    auto retired = memory.Allocate(kChunk, {.purpose = "retired"});
    ASSERT_TRUE(retired.ok());
    // Hand it to the disposer, which may free it at once; either way the
    // budget gets it back before anything else is given up.
    memory.disposer()->Dispose(std::shared_ptr<const void>(std::move(*retired)), kChunk);
  }
  // used: reserve 2 + owned 1 + held 3 (+ retired 1 until freed) of 8.
  // 2 more fit once the retired chunk is gone: the reserve is untouched.
  auto two = memory.Allocate(2 * kChunk, {.purpose = "two"});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(memory.stats().reserve.reclaimed, 0u);
  EXPECT_TRUE(order.empty()) << "the owner is asked last";
  // 1 more: the reserve gives a chunk back, the owner still keeps its own.
  auto one = memory.Allocate(kChunk, {.purpose = "one"});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_GE(memory.stats().reserve.reclaimed, 1u);
  EXPECT_TRUE(order.empty());
  // 2 more: what is left of the reserve, then the owner's chunk.
  auto last = memory.Allocate(2 * kChunk, {.purpose = "last"});
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(order, std::vector<int>{MemoryAccount::kRankCache});
  EXPECT_EQ(owned, nullptr);
  // Nothing left to give: refused, and the chain was asked once more.
  auto refused = memory.Allocate(kChunk, {.purpose = "refused"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(order.size(), 2u);
  memory.RemoveReclaimer(id);
}

TEST(HostMemoryManagerTest, RetireFreesNowOrOffTheCallersThread) {
  HostMemoryManager memory({.dispose_min_bytes = 1});
  SegmentPtr a = *memory.Allocate(kChunk, {.purpose = "a"});
  memory.Retire(std::move(a), /*now=*/true);
  EXPECT_EQ(memory.stats().used_bytes, 0u) << "freed by the retiring call";
  SegmentPtr b = *memory.Allocate(kChunk, {.purpose = "b"});
  memory.Retire(std::move(b), /*now=*/false);
  EXPECT_EQ(memory.disposer()->disposed(), 1u) << "handed to the disposer's thread";
  memory.disposer()->Drain();
  EXPECT_EQ(memory.stats().used_bytes, 0u);
}

TEST(SegmentTest, ReleaseHooksRunLastFirstWhileTheMappingIsStillThere) {
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "hooked", 4096, false);
  ASSERT_TRUE(seg.ok());
  (*seg)->mutable_data()[0] = 42;
  ASSERT_TRUE((*seg)->Seal().ok());
  SegmentPtr shared = std::move(*seg);
  std::vector<int> order;
  const uint8_t* data = shared->data();
  int seen = -1;
  shared->AddReleaseHook([&] { order.push_back(1); });
  shared->AddReleaseHook([&] {
    order.push_back(2);
    seen = data[0];  // e.g. cudaHostUnregister: the mapping must still be there
  });
  EXPECT_EQ(account->used(), 4096u);
  shared.reset();
  EXPECT_EQ(order, (std::vector<int>{2, 1}));
  EXPECT_EQ(seen, 42);
  EXPECT_EQ(account->used(), 0u);
}

TEST(HostMemoryManagerTest, ReclaimUpToAsksOnlyTheCheapRanksAndStopsWhenEnough) {
  // What a hugetlb pool short of pages runs (Segment::Create): the warm
  // reserve and prepared staging (rank <= kRankWarmReserve), never the cache.
  auto account = std::make_shared<MemoryAccount>(0);
  std::vector<int> asked;
  account->AddReclaimer(MemoryAccount::kRankCache, [&](uint64_t) {
    asked.push_back(MemoryAccount::kRankCache);
    return uint64_t{100};
  });
  std::vector<uint64_t> needs;
  account->AddReclaimer(MemoryAccount::kRankWarmReserve, [&](uint64_t need) {
    asked.push_back(MemoryAccount::kRankWarmReserve);
    needs.push_back(need);
    return uint64_t{70};
  });
  account->AddReclaimer(MemoryAccount::kRankDisposer, [&](uint64_t need) {
    asked.push_back(MemoryAccount::kRankDisposer);
    needs.push_back(need);
    return uint64_t{30};
  });
  EXPECT_EQ(account->ReclaimUpTo(MemoryAccount::kRankWarmReserve, 100), 100u);
  EXPECT_EQ(asked, (std::vector<int>{MemoryAccount::kRankDisposer,
                                     MemoryAccount::kRankWarmReserve}));
  EXPECT_EQ(needs, (std::vector<uint64_t>{100, 70}));  // each asked for what is still missing
  asked.clear();
  // Enough after the first: the next is not asked.
  EXPECT_EQ(account->ReclaimUpTo(MemoryAccount::kRankWarmReserve, 30), 30u);
  EXPECT_EQ(asked, (std::vector<int>{MemoryAccount::kRankDisposer}));
}

}  // namespace
}  // namespace weightd
