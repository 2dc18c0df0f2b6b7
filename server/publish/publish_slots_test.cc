#include "server/publish/publish_slots.h"

#include <gtest/gtest.h>

namespace weightd {
namespace {

TEST(PublishSlotsTest, PerCallerCapRefusesThatCallerOnly) {
  PublishSlots slots({/*total=*/10, /*per_caller=*/2});
  ASSERT_TRUE(slots.Acquire("uid:1000", "uid 1000").ok());
  ASSERT_TRUE(slots.Acquire("uid:1000", "uid 1000").ok());
  absl::Status third = slots.Acquire("uid:1000", "uid 1000");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.message().find("uid 1000 holds 2 open publish sessions"), std::string::npos);
  EXPECT_NE(third.message().find("--max-publish-sessions-per-caller"), std::string::npos);
  EXPECT_TRUE(slots.Acquire("uid:0", "uid 0").ok());
  EXPECT_EQ(slots.open(), 3u);
  EXPECT_EQ(slots.open_by("uid:1000"), 2u);
  // One ended: the caller may open another.
  slots.Release("uid:1000");
  EXPECT_TRUE(slots.Acquire("uid:1000", "uid 1000").ok());
}

TEST(PublishSlotsTest, TotalCapRefusesEveryone) {
  PublishSlots slots({/*total=*/3, /*per_caller=*/2});
  ASSERT_TRUE(slots.Acquire("a", "a").ok());
  ASSERT_TRUE(slots.Acquire("b", "b").ok());
  ASSERT_TRUE(slots.Acquire("", "the daemon").ok());
  for (const char* who : {"c", "a", ""}) {
    absl::Status s = slots.Acquire(who, who);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << who;
    EXPECT_NE(s.message().find("--max-publish-sessions)"), std::string::npos) << s;
  }
  EXPECT_EQ(slots.open(), 3u);
  slots.Release("b");
  EXPECT_TRUE(slots.Acquire("c", "c").ok());
}

TEST(PublishSlotsTest, TheDaemonItselfHasNoPerCallerCap) {
  PublishSlots slots({/*total=*/0, /*per_caller=*/1});
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(slots.Acquire("", "the daemon").ok());
  EXPECT_TRUE(slots.Acquire("x", "x").ok());
  EXPECT_FALSE(slots.Acquire("x", "x").ok());
  EXPECT_EQ(slots.open(), 6u);
}

TEST(PublishSlotsTest, ZeroMeansNoCap) {
  PublishSlots slots({/*total=*/0, /*per_caller=*/0});
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(slots.Acquire("x", "x").ok());
  EXPECT_EQ(slots.open_by("x"), 1000u);
}

}  // namespace
}  // namespace weightd
