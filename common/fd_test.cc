#include "common/fd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

#include "common/unix_socket.h"

namespace weightd {
namespace {

TEST(MemfdSegmentTest, SealForbidsWritesGrowAndShrink) {
  auto seg = MemfdSegment::Create("test", 8192, /*prefault=*/true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 0xAB, 8192);
  ASSERT_TRUE(seg->Seal().ok());
  EXPECT_EQ(seg->mutable_data(), nullptr);
  EXPECT_EQ(seg->data()[8191], 0xAB);
  EXPECT_EQ(::pwrite(seg->fd(), "x", 1, 0), -1);
  EXPECT_NE(::ftruncate(seg->fd(), 4096), 0);
  EXPECT_NE(::ftruncate(seg->fd(), 16384), 0);
  EXPECT_FALSE(MappedRegion::Map(seg->fd(), 8192, MappedRegion::Mode::kReadWrite).ok());
  // Copy-on-write maps are allowed: writes stay private.
  auto cow = MappedRegion::Map(seg->fd(), 8192, MappedRegion::Mode::kCopyOnWrite);
  ASSERT_TRUE(cow.ok()) << cow.status();
  cow->data()[0] = 1;
  EXPECT_EQ(seg->data()[0], 0xAB);
}

TEST(UnixSocketTest, PassesFdsAndTheyReferToTheSameFile) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  auto seg = MemfdSegment::Create("pass", 4096, false);
  ASSERT_TRUE(seg.ok());
  seg->mutable_data()[10] = 42;
  ASSERT_TRUE(seg->Seal().ok());
  int fds[2] = {seg->fd(), seg->fd()};
  ASSERT_TRUE(SendWithFds(a.get(), "hello", absl::MakeConstSpan(fds, 2)).ok());
  char buf[5];
  std::vector<UniqueFd> got;
  ASSERT_TRUE(RecvWithFds(b.get(), buf, 5, &got).ok());
  EXPECT_EQ(std::string(buf, 5), "hello");
  ASSERT_EQ(got.size(), 2u);
  auto map = MappedRegion::Map(got[0].get(), 4096, MappedRegion::Mode::kReadOnly);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->data()[10], 42);
}

TEST(UnixSocketTest, PeerCloseIsUnavailable) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  a.Reset();
  char buf[4];
  EXPECT_EQ(RecvAll(b.get(), buf, 4).code(), absl::StatusCode::kUnavailable);
}

TEST(PreadFullTest, ShortFileIsDataLoss) {
  char path[] = "/tmp/weightd-fd-XXXXXX";
  UniqueFd fd(::mkstemp(path));
  ASSERT_TRUE(fd.valid());
  ASSERT_TRUE(WriteFull(fd.get(), "abcd", 4).ok());
  char buf[8];
  EXPECT_TRUE(PreadFull(fd.get(), buf, 4, 0).ok());
  EXPECT_EQ(PreadFull(fd.get(), buf, 8, 0).code(), absl::StatusCode::kDataLoss);
  ::unlink(path);
}

}  // namespace
}  // namespace weightd
