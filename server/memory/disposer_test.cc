#include "server/memory/disposer.h"

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "server/lease/lease_table.h"
#include "server/memory/segment.h"

namespace weightd {
namespace {

constexpr uint64_t kMin = 1 << 20;

// A holder whose drop records the thread it ran on.
std::shared_ptr<const void> Holder(std::atomic<std::thread::id>* freed_on,
                                   absl::Notification* wait_for = nullptr,
                                   absl::Notification* started = nullptr) {
  return std::shared_ptr<const void>(new int(0), [=](const void* p) {
    if (started != nullptr) started->Notify();
    if (wait_for != nullptr) wait_for->WaitForNotification();
    freed_on->store(std::this_thread::get_id());
    delete static_cast<const int*>(p);
  });
}

bool Eventually(const std::function<bool()>& cond) {
  for (int i = 0; i < 1000; ++i) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return cond();
}

TEST(DisposerTest, SmallDropsAreFreedAtOnceOnTheCallersThread) {
  Disposer d(kMin);
  std::atomic<std::thread::id> freed_on{};
  d.Dispose(Holder(&freed_on), kMin - 1);
  EXPECT_EQ(freed_on.load(), std::this_thread::get_id());
  EXPECT_EQ(d.disposed(), 0u);
  EXPECT_EQ(d.pending_bytes(), 0u);
}

TEST(DisposerTest, LargeDropsAreFreedOnItsThread) {
  Disposer d(kMin);
  std::atomic<std::thread::id> freed_on{};
  d.Dispose(Holder(&freed_on), kMin);
  ASSERT_TRUE(Eventually([&] { return freed_on.load() != std::thread::id(); }));
  EXPECT_NE(freed_on.load(), std::this_thread::get_id());
  EXPECT_EQ(d.disposed(), 1u);
  EXPECT_TRUE(Eventually([&] { return d.pending_bytes() == 0; }));
}

TEST(DisposerTest, DrainWaitsForTheDropInProgressAndFreesTheQueue) {
  Disposer d(kMin);
  absl::Notification a_started, a_may_finish;
  std::atomic<std::thread::id> a{}, b{}, c{};
  d.Dispose(Holder(&a, &a_may_finish, &a_started), 3 * kMin);
  a_started.WaitForNotification();  // the thread is busy with a
  d.Dispose(Holder(&b), 2 * kMin);
  d.Dispose(Holder(&c), kMin);
  EXPECT_EQ(d.pending_bytes(), 6 * kMin);
  std::atomic<bool> drained{false};
  std::atomic<uint64_t> freed{0};
  std::thread drainer([&] {
    freed = d.Drain();
    drained = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(drained.load());  // a is still being freed
  a_may_finish.Notify();
  drainer.join();
  EXPECT_EQ(freed.load(), 6 * kMin);
  EXPECT_NE(a.load(), std::thread::id());
  EXPECT_NE(b.load(), std::thread::id());  // freed before Drain returned
  EXPECT_NE(c.load(), std::thread::id());
  EXPECT_EQ(d.pending_bytes(), 0u);
}

TEST(DisposerTest, DestructionFreesWhatIsQueued) {
  std::atomic<std::thread::id> a{}, b{};
  {
    Disposer d(kMin);
    d.Dispose(Holder(&a), kMin);
    d.Dispose(Holder(&b), kMin);
  }
  EXPECT_NE(a.load(), std::thread::id());
  EXPECT_NE(b.load(), std::thread::id());
}

absl::string_view TokenOf(const LeaseGrant& g) {
  return absl::string_view(reinterpret_cast<const char*>(g.token.data()), g.token.size());
}

TEST(DisposerTest, LeaseTableHandsOffOnlyTheLastHoldOnLargeSegments) {
  auto account = std::make_shared<MemoryAccount>(0);
  Disposer d(kMin);
  LeaseTable table(absl::Seconds(60), &d);
  auto big = Segment::Create(account, "test", 2 * kMin, false);
  ASSERT_TRUE(big.ok());
  SegmentPtr seg(std::move(*big));
  LeaseContents c1, c2;
  c1.buffers.push_back(seg);
  c2.buffers.push_back(seg);
  LeaseGrant g1 = table.Grant(std::move(c1));
  LeaseGrant g2 = table.Grant(std::move(c2));
  seg.reset();
  // Another lease still holds the segment: dropping this one frees nothing.
  ASSERT_TRUE(table.Release(g1.id, TokenOf(g1)).ok());
  EXPECT_EQ(d.disposed(), 0u);
  EXPECT_EQ(account->used(), 2 * kMin);
  // The last hold goes to the disposer, which frees it.
  ASSERT_TRUE(table.Release(g2.id, TokenOf(g2)).ok());
  EXPECT_EQ(d.disposed(), 1u);
  EXPECT_TRUE(Eventually([&] { return account->used() == 0; }));
  // Small segments are freed by the releasing call itself.
  auto small = Segment::Create(account, "test", 4096, false);
  ASSERT_TRUE(small.ok());
  LeaseContents c3;
  c3.buffers.push_back(SegmentPtr(std::move(*small)));
  LeaseGrant g3 = table.Grant(std::move(c3));
  ASSERT_TRUE(table.Release(g3.id, TokenOf(g3)).ok());
  EXPECT_EQ(account->used(), 0u);
  EXPECT_EQ(d.disposed(), 1u);
}

TEST(DisposerTest, ReservationShortOfBudgetDrainsTheDisposer) {
  auto account = std::make_shared<MemoryAccount>(3 * kMin);
  Disposer d(kMin);
  const uint64_t reclaimer =
      account->AddReclaimer(MemoryAccount::kRankDisposer, [&](uint64_t) { return d.Drain(); });
  absl::Notification started, may_finish;
  std::atomic<std::thread::id> freed_on{};
  auto seg = Segment::Create(account, "test", 2 * kMin, false);
  ASSERT_TRUE(seg.ok());
  std::shared_ptr<const Segment> held(std::move(*seg));
  // The drop blocks on the disposer's thread until released below.
  d.Dispose(std::shared_ptr<const void>(
                new int(0),
                [&, held](const void* p) mutable {
                  started.Notify();
                  may_finish.WaitForNotification();
                  held.reset();
                  freed_on = std::this_thread::get_id();
                  delete static_cast<const int*>(p);
                }),
            2 * kMin);
  held.reset();
  started.WaitForNotification();
  std::thread finisher([&] {
    absl::SleepFor(absl::Milliseconds(50));
    may_finish.Notify();
  });
  // 2 MiB of 3 are still charged; this reservation waits for the drop.
  EXPECT_TRUE(account->Reserve(2 * kMin, "test").ok());
  finisher.join();
  EXPECT_NE(freed_on.load(), std::thread::id());
  account->Return(2 * kMin);
  account->RemoveReclaimer(reclaimer);
}

}  // namespace
}  // namespace weightd
