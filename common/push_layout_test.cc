#include "common/push_layout.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(DefaultPushLayoutTest, AlignsEveryTensorTo256BytesInOrder) {
  auto layout = DefaultPushLayout({10, 0, 256, 1, 300});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->offsets, (std::vector<uint64_t>{0, 256, 256, 512, 768}));
  EXPECT_EQ(layout->lengths, (std::vector<uint64_t>{10, 0, 256, 1, 300}));
  EXPECT_EQ(layout->size, 768u + 300u);
}

TEST(DefaultPushLayoutTest, NothingNeedsNoBytes) {
  auto layout = DefaultPushLayout({});
  ASSERT_TRUE(layout.ok());
  EXPECT_TRUE(layout->offsets.empty());
  EXPECT_EQ(layout->size, 0u);
  auto empties = DefaultPushLayout({0, 0});
  ASSERT_TRUE(empties.ok());
  EXPECT_EQ(empties->offsets, (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(empties->size, 0u);
}

TEST(DefaultPushLayoutTest, RefusesALayoutPast2To63) {
  auto layout = DefaultPushLayout({uint64_t{1} << 62, uint64_t{1} << 62, 1});
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find("tensor 2"), std::string::npos);
}

TEST(CheckPushLayoutTest, TakesAnyOrderOfAlignedDisjointOffsets) {
  auto layout = CheckPushLayout({100, 300, 0}, {1024, 0, 512});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->size, 1124u);
  EXPECT_EQ(layout->offsets, (std::vector<uint64_t>{1024, 0, 512}));
  // Tensors may touch; empty ones may sit anywhere aligned, even inside another.
  EXPECT_TRUE(CheckPushLayout({256, 256, 0}, {0, 256, 256}).ok());
}

TEST(CheckPushLayoutTest, RefusesMisalignedOverlappingOrMiscountedOffsets) {
  auto misaligned = CheckPushLayout({8, 8}, {0, 128});
  ASSERT_FALSE(misaligned.ok());
  EXPECT_EQ(misaligned.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(misaligned.status().message().find("tensor 1's offset 128"), std::string::npos);

  auto overlap = CheckPushLayout({300, 8, 8}, {0, 1024, 256});
  ASSERT_FALSE(overlap.ok());
  EXPECT_EQ(overlap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.status().message().find("tensors 0 and 2"), std::string::npos)
      << overlap.status();

  auto count = CheckPushLayout({8, 8}, {0});
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("1 offsets for 2 tensors"), std::string::npos);

  auto huge = CheckPushLayout({16}, {(uint64_t{1} << 63) - 256 + 256});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightd
