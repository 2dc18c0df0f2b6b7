// LoadingCheckpoints (loading_checkpoints.h): what a load still running
// offers peers, against a plain reference of which bytes it has read.
#include "server/store/loading_checkpoints.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace weightd {
namespace {

Digest Key(uint8_t b) {
  Digest d;
  d.bytes.fill(b);
  return d;
}

const auto kAnyone = [](const ReaderList&) { return true; };

struct Fixture {
  std::string a = std::string(1000, 'a');
  std::string b = std::string(300, 'b');
  LoadingCheckpoints loading;
  std::shared_ptr<LoadingCopy> copy = loading.Add(Key(1), ReaderList(), {a.size(), b.size()});
  Fixture() {
    copy->Attach(
        {reinterpret_cast<const uint8_t*>(a.data()), reinterpret_cast<const uint8_t*>(b.data())});
  }
};

TEST(LoadingCheckpointsTest, OffersOnlyTheMergedRangesRead) {
  Fixture f;
  for (size_t i = 0; i < f.a.size(); ++i) f.a[i] = static_cast<char>(i * 7);
  f.copy->MarkRead(0, 100, 50);
  f.copy->MarkRead(0, 150, 50);  // adjacent: merged
  f.copy->MarkRead(0, 400, 10);
  f.copy->MarkRead(0, 120, 300);  // bridges both
  f.copy->MarkRead(1, 0, 300);
  const std::vector<CheckpointRange> samples = {{0, 100, 10}, {0, 0, 10}, {1, 290, 10}};
  auto offers = f.loading.Find(Key(1), samples, kAnyone);
  ASSERT_EQ(offers.size(), 1u);
  ASSERT_EQ(offers[0].have.size(), 2u);
  EXPECT_EQ(offers[0].have[0].file, 0u);
  EXPECT_EQ(offers[0].have[0].offset, 100u);
  EXPECT_EQ(offers[0].have[0].length, 320u);  // 100..420
  EXPECT_EQ(offers[0].have[1].file, 1u);
  EXPECT_EQ(offers[0].have[1].length, 300u);
  ASSERT_EQ(offers[0].sample_digests.size(), 3u);
  EXPECT_EQ(offers[0].sample_digests[0], DigestBytes(f.a.data() + 100, 10));
  EXPECT_FALSE(offers[0].sample_digests[1].has_value());  // not read yet
  EXPECT_EQ(offers[0].sample_digests[2], DigestBytes(f.b.data() + 290, 10));
  EXPECT_TRUE(f.loading.Find(Key(2), samples, kAnyone).empty());

  auto got = f.loading.Read(Key(1), offers[0].copy, {0, 110, 300}, kAnyone);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*got)->host_data()), (*got)->size()),
            f.a.substr(110, 300));
  // A byte past what was read, another copy id, a reader not admitted.
  EXPECT_EQ(f.loading.Read(Key(1), offers[0].copy, {0, 110, 311}, kAnyone).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.loading.Read(Key(1), Key(9), {0, 110, 10}, kAnyone).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.loading.Read(Key(1), offers[0].copy, {0, 110, 10},
                           [](const ReaderList&) { return false; })
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.loading.Read(Key(1), offers[0].copy, {1, 200, 200}, kAnyone).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.loading.Read(Key(1), offers[0].copy, {7, 0, 1}, kAnyone).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LoadingCheckpointsTest, CloseEndsTheOfferAndWaitsForCopies) {
  Fixture f;
  f.copy->MarkRead(0, 0, 1000);
  const Digest id = f.copy->copy();
  const std::string want = f.a;  // the memory as it was
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0};
  std::thread reader([&] {
    while (!stop) {
      auto got = f.loading.Read(Key(1), id, {0, 0, 1000}, kAnyone);
      if (got.ok()) {
        // Every copy is whole and equal to the memory as it was.
        ASSERT_EQ(std::string(reinterpret_cast<const char*>((*got)->host_data()), 1000), want);
        ++ok;
      }
    }
  });
  while (ok == 0) std::this_thread::yield();
  f.copy->Close();
  // After Close no copy reads the memory: it may change (or go).
  f.a.assign(1000, 'z');
  EXPECT_EQ(f.loading.Read(Key(1), id, {0, 0, 10}, kAnyone).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(f.loading.Find(Key(1), {}, kAnyone).empty());
  stop = true;
  reader.join();
  // Gone once its handle is.
  f.copy.reset();
  EXPECT_TRUE(f.loading.Find(Key(1), {}, kAnyone).empty());
}

TEST(LoadingCheckpointsTest, TwoLoadsOfOneKeyHaveTheirOwnIds) {
  Fixture f;
  std::string c(1000, 'c');
  auto other = f.loading.Add(Key(1), ReaderList(), {c.size()});
  // Registered, nothing attached or read yet: offered with nothing.
  other->MarkRead(0, 0, 10);  // before Attach: ignored
  auto early = f.loading.Find(Key(1), {{0, 0, 10}}, kAnyone);
  ASSERT_EQ(early.size(), 2u);
  for (const auto& o : early) {
    if (o.copy == other->copy()) {
      EXPECT_TRUE(o.have.empty());
      EXPECT_FALSE(o.sample_digests[0].has_value());
    }
  }
  EXPECT_EQ(f.loading.Read(Key(1), other->copy(), {0, 0, 10}, kAnyone).status().code(),
            absl::StatusCode::kNotFound);
  other->Attach({reinterpret_cast<const uint8_t*>(c.data())});
  EXPECT_NE(other->copy(), f.copy->copy());
  other->MarkRead(0, 0, 10);
  auto offers = f.loading.Find(Key(1), {}, kAnyone);
  ASSERT_EQ(offers.size(), 2u);
  auto got = f.loading.Read(Key(1), other->copy(), {0, 0, 10}, kAnyone);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*got)->host_data()), 10), c.substr(0, 10));
}

TEST(LoadingCheckpointsTest, CopiesForPeersAreBounded) {
  std::string a(1000, 'a');
  LoadingCheckpoints loading(/*max_copy_bytes=*/250);
  auto copy = loading.Add(Key(1), ReaderList(), {a.size()});
  copy->Attach({reinterpret_cast<const uint8_t*>(a.data())});
  copy->MarkRead(0, 0, 900);
  auto first = loading.Read(Key(1), copy->copy(), {0, 0, 200}, kAnyone);
  ASSERT_TRUE(first.ok());
  // 200 alive: 100 more would pass the bound.
  EXPECT_EQ(loading.Read(Key(1), copy->copy(), {0, 0, 100}, kAnyone).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(loading.Read(Key(1), copy->copy(), {0, 0, 50}, kAnyone).ok());
  first->reset();  // its stream ended: room again
  EXPECT_TRUE(loading.Read(Key(1), copy->copy(), {0, 0, 240}, kAnyone).ok());
  // A refused read takes nothing.
  EXPECT_EQ(loading.Read(Key(1), copy->copy(), {0, 850, 100}, kAnyone).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(loading.Read(Key(1), copy->copy(), {0, 0, 250}, kAnyone).ok());
}

}  // namespace
}  // namespace weightd
