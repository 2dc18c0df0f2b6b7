#include "server/lease/lease_table.h"

#include <gtest/gtest.h>

#include "server/memory/segment.h"

namespace weightd {
namespace {

absl::string_view TokenOf(const LeaseGrant& g) {
  return absl::string_view(reinterpret_cast<const char*>(g.token.data()), g.token.size());
}

std::shared_ptr<MemoryAccount> Account() { return std::make_shared<MemoryAccount>(0); }

LeaseContents WithSegment(const std::shared_ptr<MemoryAccount>& account) {
  auto seg = Segment::Create(account, "test", 4096, false);
  EXPECT_TRUE(seg.ok());
  LeaseContents c;
  c.buffers.push_back(SegmentPtr(std::move(*seg)));
  return c;
}

TEST(LeaseTableTest, WrongTokenIsPermissionDeniedUnknownIsNotFound) {
  LeaseTable table(absl::Seconds(60));
  LeaseGrant g = table.Grant(LeaseContents{});
  std::string bad(TokenOf(g));
  bad[0] ^= 1;
  EXPECT_EQ(table.Use(g.id, bad).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Use(g.id + 1, TokenOf(g)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Use(g.id, TokenOf(g)).ok());
  EXPECT_TRUE(table.Release(g.id, TokenOf(g)).ok());
  EXPECT_EQ(table.Release(g.id, TokenOf(g)).code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, LeaseKeepsSegmentsAliveUntilReleased) {
  auto account = Account();
  LeaseTable table(absl::Seconds(60));
  LeaseGrant g = table.Grant(WithSegment(account));
  EXPECT_EQ(account->used(), 4096u);
  ASSERT_TRUE(table.Release(g.id, TokenOf(g)).ok());
  EXPECT_EQ(account->used(), 0u);
}

TEST(LeaseTableTest, ClosingConnectionEndsOnlyItsLeases) {
  auto account = Account();
  LeaseTable table(absl::Seconds(60));
  LeaseGrant a = table.Grant(WithSegment(account));
  LeaseGrant b = table.Grant(WithSegment(account));
  LeaseGrant c = table.Grant(WithSegment(account));
  ASSERT_TRUE(table.Attach(a.id, TokenOf(a), 7).ok());
  ASSERT_TRUE(table.Attach(b.id, TokenOf(b), 7).ok());
  ASSERT_TRUE(table.Attach(c.id, TokenOf(c), 8).ok());
  EXPECT_EQ(table.Attach(a.id, TokenOf(a), 9).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.ReleaseConnection(7), 2u);
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(account->used(), 4096u);
}

TEST(LeaseTableTest, APushOnlyLeaseIsAttachedForAPushOnlyAndKeptWhenRefused) {
  auto account = Account();
  LeaseTable table(absl::Seconds(60));
  LeaseContents c = WithSegment(account);
  c.push_only = true;
  LeaseGrant g = table.Grant(std::move(c));
  auto refused = table.Attach(g.id, TokenOf(g), 7);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("defer_casts"), absl::string_view::npos);
  // Not tied to the connection: closing it leaves the lease.
  EXPECT_EQ(table.ReleaseConnection(7), 0u);
  EXPECT_EQ(table.size(), 1u);
  ASSERT_TRUE(table.Attach(g.id, TokenOf(g), 8, /*for_push=*/true).ok());
  EXPECT_EQ(table.ReleaseConnection(8), 1u);
  EXPECT_EQ(account->used(), 0u);
}

TEST(LeaseTableTest, UnattachedLeasesExpireAttachedOnesDoNot) {
  LeaseTable table(absl::Seconds(10));
  LeaseGrant idle = table.Grant(LeaseContents{});
  LeaseGrant held = table.Grant(LeaseContents{});
  ASSERT_TRUE(table.Attach(held.id, TokenOf(held), 1).ok());
  EXPECT_EQ(table.Expire(absl::Now() + absl::Seconds(5)), 0u);
  EXPECT_EQ(table.Expire(absl::Now() + absl::Seconds(11)), 1u);
  EXPECT_EQ(table.Use(idle.id, TokenOf(idle)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Use(held.id, TokenOf(held)).ok());
}

TEST(LeaseTableTest, PeekNeedsNoTokenAndLeavesTheTtlAlone) {
  LeaseTable table(absl::Seconds(10));
  LeaseContents c;
  c.model = "m";
  LeaseGrant g = table.Grant(std::move(c));
  auto seen = table.Peek(g.id);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ((*seen)->model, "m");
  EXPECT_EQ((*seen)->owner, nullptr);
  EXPECT_EQ(table.Peek(g.id + 1).status().code(), absl::StatusCode::kNotFound);
  // Peeking does not extend the lease: it expires on the TTL of its grant.
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(table.Peek(g.id).ok());
  EXPECT_EQ(table.Expire(absl::Now() + absl::Seconds(10) - absl::Milliseconds(10)), 1u);
  EXPECT_EQ(table.Peek(g.id).status().code(), absl::StatusCode::kNotFound);
}

// After a hand-over the predecessor's ids are never granted again; using
// one is UNAVAILABLE (fetch again), releasing one is OK, and ids past the
// predecessor's stay NOT_FOUND.
TEST(LeaseTableTest, PredecessorIdsAreUnavailableAndReleasable) {
  LeaseTable table(absl::Seconds(60));
  table.InheritIdsBelow(100);
  LeaseGrant g = table.Grant(LeaseContents{});
  EXPECT_EQ(g.id, 100u);
  EXPECT_EQ(table.next_id(), 101u);
  const std::string token(16, 'x');
  auto used = table.Attach(42, token, 7);
  EXPECT_EQ(used.status().code(), absl::StatusCode::kUnavailable) << used.status();
  EXPECT_NE(used.status().message().find("took over"), std::string::npos) << used.status();
  EXPECT_EQ(table.Peek(42).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(table.Release(42, token).ok());
  EXPECT_EQ(table.Release(101, token).code(), absl::StatusCode::kNotFound);
  // The successor's own lease is still checked as usual.
  EXPECT_EQ(table.Release(g.id, token).code(), absl::StatusCode::kPermissionDenied);
  table.InheritIdsBelow(50);  // never moves back
  EXPECT_EQ(table.Grant(LeaseContents{}).id, 101u);
}

}  // namespace
}  // namespace weightd
