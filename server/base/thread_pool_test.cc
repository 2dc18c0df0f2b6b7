#include "server/base/thread_pool.h"

#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace weightd {
namespace {

TEST(ParallelForTest, RunsEveryIndexOnceOnThePoolsThreadsAndTheCallers) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  absl::Mutex mu;
  std::set<std::thread::id> threads;
  absl::Status s = ParallelFor(&pool, hits.size(), 4, [&](size_t i) {
    hits[i].fetch_add(1);
    absl::SleepFor(absl::Microseconds(50));
    absl::MutexLock lock(&mu);
    threads.insert(std::this_thread::get_id());
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < hits.size(); ++i) EXPECT_EQ(hits[i].load(), 1) << i;
  EXPECT_GE(threads.size(), 2u) << "the pool's workers helped";
  EXPECT_LE(threads.size(), 4u) << "at most `parallelism` threads";
}

TEST(ParallelForTest, CompletesOnTheCallersThreadWhenThePoolIsBusy) {
  absl::Notification release;  // outlives the pool's worker that waits on it
  ThreadPool pool(1);
  pool.Schedule([&release] { release.WaitForNotification(); });  // the only worker
  std::atomic<int> done{0};
  const std::thread::id caller = std::this_thread::get_id();
  absl::Status s = ParallelFor(&pool, 50, 2, [&](size_t) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    done.fetch_add(1);
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(done.load(), 50);
  // The helper queued behind the blocked task starts after the call
  // returned, finds nothing left and touches nothing of the caller's.
  release.Notify();
}

TEST(ParallelForTest, ReturnsTheFirstErrorAndSkipsWhatHasNotStarted) {
  std::atomic<int> ran{0};
  absl::Status s = ParallelFor(nullptr, 10000, 1, [&](size_t i) {
    ran.fetch_add(1);
    return i == 3 ? absl::DataLossError("index 3") : absl::OkStatus();
  });
  EXPECT_EQ(s, absl::DataLossError("index 3"));
  EXPECT_EQ(ran.load(), 4) << "one thread: indices after the failure are skipped";
  EXPECT_TRUE(ParallelFor(nullptr, 0, 4, [](size_t) { return absl::InternalError("x"); }).ok());
}

TEST(ParallelCopyTest, CopiesEveryRunWhole) {
  // A run longer than a piece, a short one, an empty one: every byte lands
  // where its run says, and nothing outside the runs is written.
  const uint64_t big = kParallelCopyPiece * 2 + 12345;
  std::vector<uint8_t> src(big + 100), dst(big + 300, 0xee);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<CopyRun> runs = {{dst.data() + 200, src.data(), big},
                               {dst.data() + 10, src.data() + big, 100},
                               {dst.data() + 150, src.data(), 0}};
  ASSERT_TRUE(ParallelCopy(runs, 3).ok());
  EXPECT_EQ(std::memcmp(dst.data() + 200, src.data(), big), 0);
  EXPECT_EQ(std::memcmp(dst.data() + 10, src.data() + big, 100), 0);
  for (size_t i : {size_t{0}, size_t{9}, size_t{110}, size_t{199}}) EXPECT_EQ(dst[i], 0xee) << i;
  EXPECT_EQ(dst[big + 200], 0xee);
  EXPECT_TRUE(ParallelCopy({}, 2).ok());
}

TEST(TaskThreadsTest, JoinAllWaitsForEveryClosure) {
  TaskThreads threads;
  std::atomic<int> finished{0};
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(threads
                    .Start([&finished] {
                      absl::SleepFor(absl::Milliseconds(20));
                      finished.fetch_add(1);
                    })
                    .ok());
  }
  threads.JoinAll();
  EXPECT_EQ(finished.load(), 8);
  EXPECT_EQ(threads.size(), 0u);
}

TEST(TaskThreadsTest, FinishedThreadsAreJoinedByTheNextStart) {
  TaskThreads threads;
  for (int i = 0; i < 50; ++i) {
    absl::Notification ran;
    ASSERT_TRUE(threads.Start([&ran] { ran.Notify(); }).ok());
    ran.WaitForNotification();
  }
  // Each Start() found the earlier closures returned (or about to): the
  // list does not grow with every call ever made.
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(threads.Start([] {}).ok());
  EXPECT_LE(threads.size(), 2u);
}

TEST(TaskThreadsTest, TheDestructorJoins) {
  std::atomic<bool> finished{false};
  {
    TaskThreads threads;
    ASSERT_TRUE(threads
                    .Start([&finished] {
                      absl::SleepFor(absl::Milliseconds(50));
                      finished = true;
                    })
                    .ok());
  }
  EXPECT_TRUE(finished.load());
}

}  // namespace
}  // namespace weightd
