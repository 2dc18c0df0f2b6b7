// UcxPlane between two planes of one process over UCX's TCP transport
// (the real library, loopback): a grant reads the segment's bytes; a wrong
// token, a revoked grant and a grant of a segment since freed (its release
// hook unmapped it first) are refused NOT_FOUND with no bytes written; a
// range outside the grant is refused before anything is sent.
#include "server/fleet/ucx_plane.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/memory/segment.h"

namespace weightd {
namespace {

#ifdef WEIGHTD_HAVE_UCX

class UcxPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    auto h = UcxPlane::Start();
    ASSERT_TRUE(h.ok()) << h.status();
    holder_ = std::move(*h);
    auto l = UcxPlane::Start();
    ASSERT_TRUE(l.ok()) << l.status();
    loader_ = std::move(*l);
  }

  SegmentPtr MakeSegment(uint64_t size, uint8_t seed) {
    auto s = Segment::Create(account_, "test", size, /*prefault=*/true);
    EXPECT_TRUE(s.ok()) << s.status();
    uint8_t* p = const_cast<uint8_t*>((*s)->host_data());
    for (uint64_t i = 0; i < size; ++i) p[i] = static_cast<uint8_t>(seed + i * 7);
    EXPECT_TRUE((*s)->Seal().ok());
    return SegmentPtr(std::move(*s));
  }

  absl::Status Read(const UcxGrant& g, uint64_t off, uint64_t len, std::vector<uint8_t>& out) {
    out.assign(len, 0xEE);
    return loader_->Read("holder", holder_->worker_address(), g, off, len, out.data(),
                         absl::Seconds(10));
  }

  std::shared_ptr<MemoryAccount> account_ = std::make_shared<MemoryAccount>(0);
  std::unique_ptr<UcxPlane> holder_, loader_;
};

TEST_F(UcxPlaneTest, GrantReadsTheSegmentsBytesSmallAndLarge) {
  SegmentPtr seg = MakeSegment(8 << 20, 3);
  auto g = holder_->Grant(seg, 4096, (8 << 20) - 4096);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->token.size(), 16u);
  auto again = holder_->Grant(seg, 4096, (8 << 20) - 4096);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->id, g->id);  // the same range, the same grant
  std::vector<uint8_t> out;
  for (uint64_t len : {uint64_t{100}, uint64_t{5} << 20}) {
    ASSERT_TRUE(Read(*g, 1000, len, out).ok());
    EXPECT_EQ(0, std::memcmp(out.data(), seg->host_data() + 4096 + 1000, len)) << len;
  }
  EXPECT_EQ(holder_->stats().regions, 1u);
}

TEST_F(UcxPlaneTest, WrongTokenRevokedAndOutOfRangeAreRefusedWithoutBytes) {
  SegmentPtr seg = MakeSegment(2 << 20, 9);
  auto g = holder_->Grant(seg, 0, 1 << 20);
  ASSERT_TRUE(g.ok());
  std::vector<uint8_t> out;
  UcxGrant forged = *g;
  forged.token[0] ^= 1;
  absl::Status s = Read(forged, 0, 4096, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(out, std::vector<uint8_t>(4096, 0xEE));
  // Past the grant (though inside the segment): refused here...
  EXPECT_EQ(Read(*g, (1 << 20) - 10, 20, out).code(), absl::StatusCode::kInvalidArgument);
  // ...and by the holder when a loader lies about the grant's length.
  UcxGrant longer = *g;
  longer.length = 2 << 20;
  s = Read(longer, (1 << 20) - 10, 20, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(out, std::vector<uint8_t>(20, 0xEE));
  holder_->Revoke(seg->id());
  s = Read(*g, 0, 4096, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(out, std::vector<uint8_t>(4096, 0xEE));
  EXPECT_GE(holder_->stats().requests_refused, 3u);
}

TEST_F(UcxPlaneTest, AFreedSegmentsGrantReadsNothingEvenWhenItsMemoryIsReused) {
  SegmentPtr seg = MakeSegment(2 << 20, 1);
  auto g = holder_->Grant(seg, 0, 2 << 20);
  ASSERT_TRUE(g.ok());
  std::vector<uint8_t> out;
  ASSERT_TRUE(Read(*g, 0, 64, out).ok());
  seg.reset();  // the release hook unregisters it before the memory goes
  // (once the holder's reply has completed: a reply in flight holds it).
  for (int i = 0; i < 500 && holder_->stats().regions != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(holder_->stats().regions, 0u);
  SegmentPtr other = MakeSegment(2 << 20, 77);  // may take the same pages
  auto g2 = holder_->Grant(other, 0, 2 << 20);
  ASSERT_TRUE(g2.ok());
  absl::Status s = Read(*g, 0, 64, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(out, std::vector<uint8_t>(64, 0xEE));
  ASSERT_TRUE(Read(*g2, 0, 64, out).ok());
  EXPECT_EQ(0, std::memcmp(out.data(), other->host_data(), 64));
}

TEST_F(UcxPlaneTest, ADeadWorkerFailsTheReadUnavailable) {
  SegmentPtr seg = MakeSegment(1 << 20, 5);
  auto g = holder_->Grant(seg, 0, 1 << 20);
  ASSERT_TRUE(g.ok());
  const std::string address = holder_->worker_address();
  holder_.reset();  // its worker is gone
  std::vector<uint8_t> out(4096, 0xEE);
  absl::Status s = loader_->Read("holder", address, *g, 0, 4096, out.data(), absl::Seconds(5));
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s;
  EXPECT_EQ(out, std::vector<uint8_t>(4096, 0xEE));
}

#else

TEST(UcxPlaneTest, WithoutUcxStartSaysSo) {
  auto p = UcxPlane::Start();
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
}

#endif

TEST(PeerTransportTest, Parses) {
  EXPECT_EQ(*ParsePeerTransport("auto"), PeerTransport::kAuto);
  EXPECT_EQ(*ParsePeerTransport("ucx"), PeerTransport::kUcx);
  EXPECT_EQ(*ParsePeerTransport("grpc"), PeerTransport::kGrpc);
  EXPECT_EQ(ParsePeerTransport("rdma").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightd
