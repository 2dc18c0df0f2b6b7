// ChangeCommitter: refused changes use no seq and reach no journal; the
// journal sees every committed change in seq order, before it is published,
// also when many threads commit at once.
#include "server/service/change_committer.h"

#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace weightd {
namespace {

TEST(ChangeCommitterTest, ARefusedChangeIsNeitherNumberedNorJournaled) {
  absl::Mutex catalog;
  std::vector<uint64_t> journaled;
  ChangeCommitter committer([&](const StateRecord& r) { journaled.push_back(r.seq); }, &catalog);
  StateRecord refused;
  bool published = false;
  absl::Status s = committer.Commit(
      refused, [] { return absl::AbortedError("lost the race"); }, [&] { published = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(published);
  EXPECT_TRUE(journaled.empty());
  StateRecord taken;
  ASSERT_TRUE(committer.Commit(taken, [] { return absl::OkStatus(); }, [&] { published = true; })
                  .ok());
  EXPECT_TRUE(published);
  EXPECT_EQ(taken.seq, 1u);
  EXPECT_EQ(journaled, std::vector<uint64_t>{1});
  EXPECT_EQ(committer.last_seq(), 1u);
}

TEST(ChangeCommitterTest, TheJournalSeesChangesInOrderBeforeTheyArePublished) {
  absl::Mutex catalog;
  std::vector<uint64_t> journaled;  // written by the sink, under the committer's lock
  uint64_t visible = 0;             // the catalog's state, under `catalog`
  bool journal_first = true;
  ChangeCommitter committer(
      [&](const StateRecord& r) {
        journaled.push_back(r.seq);
        absl::MutexLock lock(&catalog);
        // Nothing later than the previous change is visible yet.
        journal_first = journal_first && visible == r.seq - 1;
      },
      &catalog);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        StateRecord r;
        absl::Status s = committer.Commit(
            r, [] { return absl::OkStatus(); },
            [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { visible = r.seq; });
        EXPECT_TRUE(s.ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(journaled.size(), 800u);
  for (size_t i = 0; i < journaled.size(); ++i) EXPECT_EQ(journaled[i], i + 1);
  EXPECT_TRUE(journal_first);
  EXPECT_EQ(visible, 800u);
}

}  // namespace
}  // namespace weightd
