#include "server/grpc/call_drain.h"

#include <thread>

#include <gtest/gtest.h>

namespace weightd {
namespace {

TEST(CallDrainTest, CountsHoldsAndRefusesOnceDraining) {
  CallDrain drain;
  auto a = drain.Enter();
  ASSERT_TRUE(a.ok());
  {
    auto b = drain.Enter();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(drain.in_flight(), 2);
    CallDrain::Hold moved = std::move(*b);
    EXPECT_FALSE(b->held());
    EXPECT_TRUE(moved.held());
    EXPECT_EQ(drain.in_flight(), 2);
  }
  EXPECT_EQ(drain.in_flight(), 1);
  EXPECT_TRUE(drain.CheckOpen().ok());
  drain.BeginDrain();
  EXPECT_TRUE(drain.draining());
  auto refused = drain.Enter();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(drain.CheckOpen().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(drain.CheckOpen().message().find("shutting down"), absl::string_view::npos);
  EXPECT_EQ(drain.in_flight(), 1);  // the refused call took no hold
  EXPECT_EQ(drain.WaitIdle(absl::Now() + absl::Milliseconds(20)), 1);
  a->Reset();
  EXPECT_EQ(drain.WaitIdle(absl::Now()), 0);
}

TEST(CallDrainTest, ClosedRefusesWithItsStatusUntilReopened) {
  CallDrain drain;
  drain.SetClosed(absl::UnavailableError("restoring"));
  auto refused = drain.Enter();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(refused.status().message(), "restoring");
  EXPECT_EQ(drain.CheckOpen().message(), "restoring");
  EXPECT_EQ(drain.in_flight(), 0);
  drain.SetClosed(absl::OkStatus());
  auto admitted = drain.Enter();
  EXPECT_TRUE(admitted.ok());
  EXPECT_EQ(drain.in_flight(), 1);
  // Draining wins over a closed gate.
  drain.SetClosed(absl::UnavailableError("restoring"));
  drain.BeginDrain();
  EXPECT_NE(drain.CheckOpen().message().find("shutting down"), absl::string_view::npos);
}

TEST(CallDrainTest, WaitIdleReturnsWhenTheLastHoldEnds) {
  CallDrain drain;
  auto hold = drain.Enter();
  ASSERT_TRUE(hold.ok());
  drain.BeginDrain();
  std::thread t([h = std::move(*hold)]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    h.Reset();
  });
  absl::Time start = absl::Now();
  EXPECT_EQ(drain.WaitIdle(absl::Now() + absl::Seconds(10)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  t.join();
}

}  // namespace
}  // namespace weightd
