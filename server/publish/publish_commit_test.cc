// The publish commit's phases on real memfd segments: sealing (and the
// refusal of a staging memfd a writer sealed itself), digests, storing one
// copy of repeated bytes, and moving the changed bytes out of the staging
// segment only when that saves memory.
#include "server/publish/publish_commit.h"

#include <fcntl.h>

#include <cstring>

#include <gtest/gtest.h>

#include "common/digest.h"

namespace weightd {
namespace {

constexpr uint64_t kKiB = 1024;

class PublishCommitTest : public ::testing::Test {
 protected:
  // A staging segment of `size` bytes whose byte k is `fill(k)`.
  std::unique_ptr<Segment> Staging(uint64_t size, uint8_t (*fill)(uint64_t)) {
    HostMemoryManager::AllocateOptions alloc;
    alloc.purpose = "publish";
    auto segment = memory_.Allocate(size, alloc);
    EXPECT_TRUE(segment.ok()) << segment.status();
    for (uint64_t k = 0; k < size; ++k) (*segment)->mutable_data()[k] = fill(k);
    return std::move(*segment);
  }
  static StagedPiece Piece(size_t spec, uint64_t offset, uint64_t length, const uint8_t* base) {
    StagedPiece p;
    p.spec = spec;
    p.key = "t" + std::to_string(spec);
    p.offset = offset;
    p.length = length;
    p.digest = DigestBytes(base + offset, length);
    return p;
  }

  HostMemoryManager memory_{HostMemoryManager::Options{}};
};

uint8_t Repeating(uint64_t k) { return static_cast<uint8_t>(k % 251); }
// Bytes [0, 4 KiB) and [4 KiB, 8 KiB) equal, the rest different.
uint8_t TwoEqualPages(uint64_t k) { return static_cast<uint8_t>(k < 8 * kKiB ? k % 4096 % 199 : k % 7 + 1); }

TEST_F(PublishCommitTest, SealingStagingNotHandedOutForbidsWrites) {
  auto sealed = SealStaging(Staging(8 * kKiB, Repeating), /*handed_out=*/false);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  // F_SEAL_WRITE, or F_SEAL_FUTURE_WRITE where the daemon keeps its own
  // mapping writable (common/fd.cc): either way no one else may write.
  const int seals = ::fcntl((*sealed)->fd(), F_GET_SEALS);
  EXPECT_NE(seals & (F_SEAL_WRITE | 0x0010), 0);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_EQ((*sealed)->data()[5], Repeating(5));
}

TEST_F(PublishCommitTest, AStagingMemfdSealedByItsWriterIsRefused) {
  std::unique_ptr<Segment> staging = Staging(8 * kKiB, Repeating);
  ASSERT_EQ(::fcntl(staging->fd(), F_ADD_SEALS, F_SEAL_SEAL), 0);
  auto sealed = SealStaging(std::move(staging), /*handed_out=*/true);
  ASSERT_FALSE(sealed.ok());
  EXPECT_EQ(sealed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sealed.status().message(), kSealedByWriter);
}

TEST_F(PublishCommitTest, DigestsAreThoseOfEachPiecesBytes) {
  auto segment = SealStaging(Staging(16 * kKiB, Repeating), false);
  ASSERT_TRUE(segment.ok());
  std::vector<StagedPiece> pieces(3);
  const uint64_t offsets[] = {0, 256, 4096};
  const uint64_t lengths[] = {100, 3000, 12288};
  for (size_t i = 0; i < pieces.size(); ++i) {
    pieces[i].offset = offsets[i];
    pieces[i].length = lengths[i];
  }
  PublishSession session;
  ASSERT_TRUE(DigestPieces(pieces, **segment, 2, session).ok());
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].digest, DigestBytes((*segment)->data() + offsets[i], lengths[i])) << i;
  }
}

TEST_F(PublishCommitTest, RepeatedBytesAreStoredOnceAndSharedOnesNotAtAll) {
  auto segment = SealStaging(Staging(16 * kKiB, TwoEqualPages), false);
  ASSERT_TRUE(segment.ok());
  const uint8_t* base = (*segment)->data();
  std::vector<StagedPiece> pieces = {Piece(0, 0, 4 * kKiB, base), Piece(1, 4 * kKiB, 4 * kKiB, base),
                                     Piece(2, 8 * kKiB, 100, base), Piece(3, 12 * kKiB, 4 * kKiB, base)};
  ASSERT_EQ(pieces[0].digest, pieces[1].digest);
  std::vector<const StagedPiece*> fresh;
  for (const StagedPiece& p : pieces) fresh.push_back(&p);
  std::vector<std::optional<HeldElsewhere>> resident(fresh.size());
  resident[3] = HeldElsewhere{*segment, 0, "other"};
  const StorePlan plan = PlanStore(fresh, resident, base);
  EXPECT_EQ(plan.same_as, (std::vector<int64_t>{-1, 0, -1, -1}));
  EXPECT_EQ(plan.pieces, 2u);
  EXPECT_EQ(plan.bytes, 4 * kKiB + 128);
}

TEST_F(PublishCommitTest, ChangedBytesMoveOutOnlyWhenTheyAreASmallPartOfTheStaging) {
  auto segment = SealStaging(Staging(16 * kKiB, Repeating), false);
  ASSERT_TRUE(segment.ok());
  const uint8_t* base = (*segment)->data();
  std::vector<StagedPiece> pieces = {Piece(0, 4 * kKiB, 1000, base)};
  std::vector<const StagedPiece*> fresh = {&pieces[0]};
  std::vector<std::optional<HeldElsewhere>> resident(1);
  const StorePlan small = PlanStore(fresh, resident, base);
  StoredRuns packed = CompactStored(fresh, resident, small, *segment, 16 * kKiB, {}, memory_, 2);
  ASSERT_NE(packed.holder, *segment);
  EXPECT_EQ(packed.offsets, std::vector<uint64_t>{0});
  EXPECT_EQ(std::memcmp(packed.holder->data(), base + 4 * kKiB, 1000), 0);
  PublishResult result;
  PublishSession session;
  session.id = 9;
  session.specs.push_back(PublishTensorSpec{"t0", DType::kU8, {1000}});
  std::vector<StoredTensor> tensors =
      StoredTensorsOf(session, fresh, resident, small, packed, *segment, &result);
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].name, "t0");
  EXPECT_EQ(tensors[0].file, "(published in session 9)");
  EXPECT_EQ(result.bytes_stored, 1024u);  // rounded up to 64

  // Most of what was sent changed: the staging segment is kept whole, and
  // then a copy from a segment the generation does not hold is not shared.
  pieces.push_back(Piece(1, 0, 15 * kKiB, base));
  fresh = {&pieces[0], &pieces[1]};
  auto other = memory_.Allocate(kKiB, HostMemoryManager::AllocateOptions{});
  ASSERT_TRUE(other.ok());
  resident = {HeldElsewhere{SegmentPtr(std::move(*other)), 0, "other"}, std::nullopt};
  const StorePlan large = PlanStore(fresh, resident, base);
  StoredRuns kept = CompactStored(fresh, resident, large, *segment, 16 * kKiB, {}, memory_, 2);
  EXPECT_EQ(kept.holder, *segment);
  EXPECT_EQ(kept.offsets, (std::vector<uint64_t>{4 * kKiB, 0}));
  EXPECT_FALSE(resident[0].has_value());
}

}  // namespace
}  // namespace weightd
