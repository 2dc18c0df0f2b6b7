// Housekeeper: the jobs run in order, round after round, on its thread,
// and none runs once Stop has returned.
#include "server/service/housekeeper.h"

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"

namespace weightd {
namespace {

TEST(HousekeeperTest, RunsTheJobsInOrderUntilStopped) {
  absl::Mutex mu;
  std::vector<std::string> ran;
  std::atomic<std::thread::id> on;
  Housekeeper keeper(absl::Milliseconds(1));
  keeper.Start({{"a", [&] { absl::MutexLock l(&mu); ran.push_back("a"); }},
                {"b", [&] {
                   on = std::this_thread::get_id();
                   absl::MutexLock l(&mu);
                   ran.push_back("b");
                 }}});
  // Bounded wait for two rounds (no time is asserted).
  for (int i = 0; i < 5000; ++i) {
    {
      absl::MutexLock l(&mu);
      if (ran.size() >= 4) break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  keeper.Stop();
  size_t after_stop = 0;
  {
    absl::MutexLock l(&mu);
    ASSERT_GE(ran.size(), 4u);
    for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i], i % 2 == 0 ? "a" : "b") << i;
    after_stop = ran.size();
  }
  EXPECT_NE(on.load(), std::this_thread::get_id());
  absl::SleepFor(absl::Milliseconds(20));
  {
    absl::MutexLock l(&mu);
    EXPECT_EQ(ran.size(), after_stop);
  }
  keeper.Stop();  // idempotent
}

}  // namespace
}  // namespace weightd
