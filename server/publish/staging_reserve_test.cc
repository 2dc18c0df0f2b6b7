// StagingReserve on a real HostMemoryManager: what the stager prepares,
// who takes it, and how it is given back (another size, the reclaimer when
// the budget is short, housekeeping, a model unloaded meanwhile).
#include "server/publish/staging_reserve.h"

#include <atomic>

#include <gtest/gtest.h>

namespace weightd {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Waits (bounded) for the stager to have prepared `bytes`: the stager is a
// thread of its own, so the test asks until it has (no time is asserted).
bool WaitForPrepared(const StagingReserve& reserve, uint64_t bytes) {
  for (int i = 0; i < 3000; ++i) {
    if (reserve.Bytes() == bytes) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

StagingReserve::Options OptionsFor(HostMemoryManager* memory) {
  StagingReserve::Options options;
  options.memory = memory;
  options.still_loaded = [](const std::string&, uint64_t) { return true; };
  return options;
}

TEST(StagingReserveTest, PreparesTheWantedSizeAndHandsItOver) {
  HostMemoryManager memory(HostMemoryManager::Options{});
  StagingReserve reserve(OptionsFor(&memory));
  reserve.Want("m", 7, 2 * kMiB);
  ASSERT_TRUE(WaitForPrepared(reserve, 2 * kMiB));
  std::unique_ptr<Segment> taken = reserve.Take(7, 2 * kMiB);
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(taken->size(), 2 * kMiB);
  EXPECT_EQ(reserve.Bytes(), 0u);
  // Taken once: the next session allocates its own until the next commit.
  EXPECT_EQ(reserve.Take(7, 2 * kMiB), nullptr);
}

TEST(StagingReserveTest, ASessionOfAnotherSizeFreesWhatWasPrepared) {
  HostMemoryManager memory(HostMemoryManager::Options{});
  StagingReserve reserve(OptionsFor(&memory));
  reserve.Want("m", 7, 2 * kMiB);
  ASSERT_TRUE(WaitForPrepared(reserve, 2 * kMiB));
  const uint64_t before = memory.stats().used_bytes;
  EXPECT_EQ(reserve.Take(7, 3 * kMiB), nullptr);
  EXPECT_EQ(reserve.Bytes(), 0u);
  EXPECT_EQ(memory.stats().used_bytes, before - 2 * kMiB);
  // Another instance's entry is not this one's.
  EXPECT_EQ(reserve.Take(8, 2 * kMiB), nullptr);
}

TEST(StagingReserveTest, TheReclaimerGivesItBackWhenTheBudgetIsShort) {
  HostMemoryManager::Options limits;
  limits.limit_bytes = 5 * kMiB;
  HostMemoryManager memory(limits);
  StagingReserve reserve(OptionsFor(&memory));
  reserve.Want("m", 1, 4 * kMiB);
  ASSERT_TRUE(WaitForPrepared(reserve, 4 * kMiB));
  HostMemoryManager::AllocateOptions alloc;
  auto segment = memory.Allocate(3 * kMiB, alloc);
  ASSERT_TRUE(segment.ok()) << segment.status();
  EXPECT_EQ(reserve.Bytes(), 0u);
}

TEST(StagingReserveTest, HousekeepingFreesOnlyWhatWasUnusedForTheIdleTime) {
  HostMemoryManager memory(HostMemoryManager::Options{});
  StagingReserve reserve(OptionsFor(&memory));
  reserve.Want("m", 1, kMiB);
  ASSERT_TRUE(WaitForPrepared(reserve, kMiB));
  EXPECT_EQ(reserve.Reclaim(absl::Hours(1)), 0u);
  EXPECT_EQ(reserve.Bytes(), kMiB);
  EXPECT_EQ(reserve.Reclaim(), kMiB);
  EXPECT_EQ(reserve.Bytes(), 0u);
}

TEST(StagingReserveTest, NothingIsPreparedForAModelUnloadedSinceItsPublish) {
  HostMemoryManager memory(HostMemoryManager::Options{});
  std::atomic<int> asked{0};
  StagingReserve::Options options = OptionsFor(&memory);
  options.still_loaded = [&](const std::string& name, uint64_t instance) {
    EXPECT_EQ(name, "m");
    EXPECT_EQ(instance, 3u);
    ++asked;
    return false;
  };
  StagingReserve reserve(std::move(options));
  reserve.Want("m", 3, kMiB);
  for (int i = 0; i < 3000 && asked.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(asked.load(), 1);
  EXPECT_EQ(reserve.Take(3, kMiB), nullptr);
  EXPECT_EQ(reserve.Bytes(), 0u);
  EXPECT_EQ(memory.stats().used_bytes, 0u);
}

TEST(StagingReserveTest, DroppedInstancesAndADisabledReserveHoldNothing) {
  HostMemoryManager memory(HostMemoryManager::Options{});
  {
    StagingReserve reserve(OptionsFor(&memory));
    reserve.Want("m", 1, kMiB);
    ASSERT_TRUE(WaitForPrepared(reserve, kMiB));
    reserve.Drop(1);
    EXPECT_EQ(reserve.Bytes(), 0u);
    reserve.Want("m", 2, kMiB);
    ASSERT_TRUE(WaitForPrepared(reserve, kMiB));
  }  // Stop frees what was prepared
  EXPECT_EQ(memory.stats().used_bytes, 0u);
  StagingReserve::Options off = OptionsFor(&memory);
  off.enabled = false;
  StagingReserve disabled(std::move(off));
  disabled.Want("m", 1, kMiB);
  EXPECT_EQ(disabled.Take(1, kMiB), nullptr);
  EXPECT_EQ(disabled.Bytes(), 0u);
}

}  // namespace
}  // namespace weightd
