#include "common/fd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <string>

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

// The permissions /proc/self/maps shows for the mapping holding `addr`.
std::string MapPerms(const void* addr) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &lo, &hi, perms) == 3 && a >= lo && a < hi) {
      return perms;
    }
  }
  return "";
}

TEST(MemfdSegmentTest, SealedSegmentCannotBeChangedThroughAnyHolderOfTheFd) {
  auto seg = MemfdSegment::Create("test", 3 * 4096, /*prefault=*/false);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 0x5A, 3 * 4096);
  ASSERT_TRUE(seg->Truncate(2 * 4096).ok());
  EXPECT_EQ(MapPerms(seg->data()), "rw-s");
  const uint8_t* before = seg->data();
  ASSERT_TRUE(seg->Seal(/*populate=*/true).ok());
  // Linux 5.10+: sealed in place (F_SEAL_FUTURE_WRITE), nothing remapped.
  if (seg->kept_mapping()) {
    EXPECT_EQ(seg->data(), before);
  }
  // The daemon's own mapping is read-only now, with the same bytes.
  EXPECT_EQ(MapPerms(seg->data()), "r--s");
  EXPECT_EQ(seg->data()[2 * 4096 - 1], 0x5A);
  const int seals = ::fcntl(seg->fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_GROW) << seals;
  EXPECT_TRUE(seals & F_SEAL_SHRINK) << seals;
  EXPECT_TRUE(seals & F_SEAL_SEAL) << seals;
  EXPECT_TRUE(seals & (F_SEAL_WRITE | 0x0010 /* F_SEAL_FUTURE_WRITE */)) << seals;
  // No route to write: punching a hole, reopening the fd for writing, or a
  // read-only shared mapping turned writable.
  EXPECT_NE(::fallocate(seg->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  const std::string path = "/proc/self/fd/" + std::to_string(seg->fd());
  int rw = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(rw, 0);
  EXPECT_EQ(::pwrite(rw, "x", 1, 0), -1);
  ::close(rw);
  auto ro = MappedRegion::Map(seg->fd(), 2 * 4096, MappedRegion::Mode::kReadOnly);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_NE(::mprotect(ro->data(), 2 * 4096, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(ro->data()[0], 0x5A);
  EXPECT_EQ(seg->data()[0], 0x5A);
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
// A FIFO where a config, index or profile should be is refused at once,
// not waited on for a writer.
TEST(ReadFileToStringTest, FifoIsRefusedWithoutBlocking) {
  char tmpl[] = "/tmp/weightd-fifo-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string fifo = std::string(tmpl) + "/config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  auto read = std::async(std::launch::async, [&] { return ReadFileToString(fifo, 1 << 20); });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ::close(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK));  // let the reader go
    read.wait();
    ADD_FAILURE() << "ReadFileToString blocked on a FIFO";
  } else {
    auto text = read.get();
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
    EXPECT_NE(text.status().message().find(fifo), std::string::npos) << text.status();
  }
  ::unlink(fifo.c_str());
  ::rmdir(tmpl);
}

}  // namespace weightd
