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

#include "common/testing/maps.h"
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

TEST(MemfdSegmentTest, SealedSegmentCannotBeChangedThroughAnyHolderOfTheFd) {
  auto seg = MemfdSegment::Create("test", 3 * 4096, /*prefault=*/false);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 0x5A, 3 * 4096);
  ASSERT_TRUE(seg->Truncate(2 * 4096).ok());
  EXPECT_EQ(MappingPerms(seg->data()), "rw-s");
  const uint8_t* before = seg->data();
  ASSERT_TRUE(seg->Seal(/*populate=*/true).ok());
  // Linux 5.10+: sealed in place (F_SEAL_FUTURE_WRITE), nothing remapped.
  if (seg->kept_mapping()) {
    EXPECT_EQ(seg->data(), before);
  }
  // The daemon's own mapping is read-only now, with the same bytes.
  EXPECT_EQ(MappingPerms(seg->data()), "r--s");
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

// Seal(keep_writable): the daemon's mapping stays writable (for a CUDA
// registration that needs one, server/gpu/host_pinner.h), and still no other
// holder of the fd has any way to write: the same seals as a plain Seal.
TEST(MemfdSegmentTest, SealKeepingTheMappingWritableStillShutsOutEveryOtherWriter) {
  auto seg = MemfdSegment::Create("pinned", 2 * 4096, /*prefault=*/true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 0x6B, 2 * 4096);
  EXPECT_EQ(seg->writable_mapping(), nullptr);  // unsealed: not yet
  const uint8_t* before = seg->data();
  ASSERT_TRUE(seg->Seal(/*populate=*/true, /*keep_writable=*/true).ok());
  ASSERT_TRUE(seg->sealed());
  EXPECT_EQ(seg->mutable_data(), nullptr);
  if (!seg->kept_mapping()) {
    // Before Linux 5.10 the seal remaps read-only: nothing stays writable.
    EXPECT_EQ(seg->writable_mapping(), nullptr);
    GTEST_SKIP() << "kernel before 5.10: sealed as without keep_writable";
  }
  EXPECT_EQ(seg->data(), before);
  EXPECT_EQ(seg->writable_mapping(), before);
  EXPECT_EQ(MappingPerms(seg->data()), "rw-s");
  const int seals = ::fcntl(seg->fd(), F_GET_SEALS);
  constexpr int kFutureWrite = 0x0010;  // F_SEAL_FUTURE_WRITE
  EXPECT_EQ(seals & (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL | kFutureWrite),
            F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL | kFutureWrite)
      << seals;
  // Every route another holder of the fd has is shut.
  EXPECT_EQ(::pwrite(seg->fd(), "x", 1, 0), -1);
  const std::string path = "/proc/self/fd/" + std::to_string(seg->fd());
  int rw = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(rw, 0);
  EXPECT_EQ(::pwrite(rw, "x", 1, 0), -1);
  ::close(rw);
  EXPECT_NE(::ftruncate(seg->fd(), 4096), 0);
  EXPECT_NE(::ftruncate(seg->fd(), 4 * 4096), 0);
  EXPECT_NE(::fallocate(seg->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  EXPECT_FALSE(MappedRegion::Map(seg->fd(), 2 * 4096, MappedRegion::Mode::kReadWrite).ok());
  auto ro = MappedRegion::Map(seg->fd(), 2 * 4096, MappedRegion::Mode::kReadOnly);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_NE(::mprotect(ro->data(), 2 * 4096, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(::fcntl(seg->fd(), F_ADD_SEALS, 0), -1);  // F_SEAL_SEAL
  EXPECT_EQ(ro->data()[4096], 0x6B);
}

// A memfd handed out writable (a publisher's staging) is sealed only once
// nobody else maps it writable: F_SEAL_FUTURE_WRITE would leave such a
// mapping writing into sealed, digested bytes.
TEST(MemfdSegmentTest, SealExclusiveRefusesWhileAnotherMappingMayWrite) {
  auto seg = MemfdSegment::Create("staging", 2 * 4096, /*prefault=*/true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 0x11, 2 * 4096);
  // Another holder of the fd (a publisher) maps it shared and writes.
  auto other = MappedRegion::Map(seg->fd(), 2 * 4096, MappedRegion::Mode::kReadWrite);
  ASSERT_TRUE(other.ok()) << other.status();
  other->data()[4096] = 0x22;
  absl::Status refused = seg->SealExclusive();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("unmap"), std::string::npos) << refused;
  // As it was: unsealed, writable, the same bytes.
  EXPECT_FALSE(seg->sealed());
  ASSERT_NE(seg->mutable_data(), nullptr);
  EXPECT_EQ(seg->data()[4096], 0x22);
  seg->mutable_data()[0] = 0x33;
  EXPECT_EQ(other->data()[0], 0x33);
  EXPECT_EQ(::fcntl(seg->fd(), F_GET_SEALS) & F_SEAL_WRITE, 0);
  // Unmapped: sealed against every writer, our mapping read-only.
  other->Reset();
  ASSERT_TRUE(seg->SealExclusive().ok());
  EXPECT_TRUE(seg->sealed());
  EXPECT_EQ(seg->mutable_data(), nullptr);
  EXPECT_EQ(MappingPerms(seg->data()), "r--s");
  EXPECT_EQ(seg->data()[0], 0x33);
  EXPECT_EQ(seg->data()[4096], 0x22);
  EXPECT_TRUE(::fcntl(seg->fd(), F_GET_SEALS) & F_SEAL_WRITE);
  EXPECT_EQ(::pwrite(seg->fd(), "x", 1, 0), -1);
  EXPECT_FALSE(MappedRegion::Map(seg->fd(), 2 * 4096, MappedRegion::Mode::kReadWrite).ok());
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

namespace {

// Free pages of the host's 2 MiB hugetlb pool (free less reserved).
uint64_t FreeHugePages() {
  auto read = [](const char* name) -> uint64_t {
    std::ifstream f(std::string("/sys/kernel/mm/hugepages/hugepages-2048kB/") + name);
    uint64_t n = 0;
    return (f >> n) ? n : 0;
  };
  const uint64_t free = read("free_hugepages"), rsvd = read("resv_hugepages");
  return free > rsvd ? free - rsvd : 0;
}

// The kernel page size /proc/self/smaps reports for the mapping holding
// `addr`, in KiB; 0 when not found.
uint64_t KernelPageKiB(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  bool in = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    if (std::sscanf(line.c_str(), "%lx%c%lx ", &lo, &dash, &hi) == 3 && dash == '-') {
      in = a >= lo && a < hi;
      continue;
    }
    unsigned long kib = 0;
    if (in && std::sscanf(line.c_str(), "KernelPageSize: %lu kB", &kib) == 1) return kib;
  }
  return 0;
}

bool HugeAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kHugePageBytes == 0; }

TEST(MemfdSegmentTest, HugetlbSegmentIsWholePagesAlignedSealedAndSharedWithoutReserving) {
  if (FreeHugePages() < 3) GTEST_SKIP() << "needs 3 free 2 MiB hugetlb pages (vm.nr_hugepages)";
  const uint64_t before = FreeHugePages();
  {
    // 3 MiB + 5 bytes rounds up to two pages.
    auto seg = MemfdSegment::Create("huge", (3u << 20) + 5, /*prefault=*/false, PageKind::kHugetlb);
    ASSERT_TRUE(seg.ok()) << seg.status();
    EXPECT_EQ(seg->size(), 2 * kHugePageBytes);
    EXPECT_EQ(seg->pages(), PageKind::kHugetlb);
    EXPECT_TRUE(HugeAligned(seg->data()));
    EXPECT_EQ(FreeHugePages(), before - 2);  // reserved by the mapping up front
    std::memset(seg->mutable_data(), 0x3C, seg->size());
    EXPECT_EQ(KernelPageKiB(seg->data()), 2048u);
    ASSERT_TRUE(seg->Seal().ok());
    EXPECT_EQ(::pwrite(seg->fd(), "x", 1, 0), -1);
    EXPECT_FALSE(MappedRegion::Map(seg->fd(), seg->size(), MappedRegion::Mode::kReadWrite).ok());
    // A client's read-only map of a length that is not whole pages.
    auto ro = MappedRegion::Map(seg->fd(), (3u << 20) + 5, MappedRegion::Mode::kReadOnly);
    ASSERT_TRUE(ro.ok()) << ro.status();
    EXPECT_EQ(ro->size(), 2 * kHugePageBytes);
    EXPECT_TRUE(HugeAligned(ro->data()));
    EXPECT_EQ(ro->data()[(3u << 20) + 4], 0x3C);
    EXPECT_EQ(KernelPageKiB(ro->data()), 2048u);
    // Copy-on-write maps reserve nothing from the pool up front.
    auto cow = MappedRegion::Map(seg->fd(), seg->size(), MappedRegion::Mode::kCopyOnWrite);
    ASSERT_TRUE(cow.ok()) << cow.status();
    EXPECT_EQ(FreeHugePages(), before - 2);
    EXPECT_EQ(cow->data()[0], 0x3C);
    cow->data()[0] = 1;  // copies one page from the pool
    EXPECT_EQ(seg->data()[0], 0x3C);
  }
  EXPECT_EQ(FreeHugePages(), before);  // all given back
}

TEST(MemfdSegmentTest, HugetlbSegmentLargerThanThePoolIsResourceExhausted) {
  const uint64_t pages = FreeHugePages() + 1;
  auto seg = MemfdSegment::Create("too-big", pages * kHugePageBytes, false, PageKind::kHugetlb);
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted) << seg.status();
  EXPECT_NE(seg.status().message().find("hugetlb pool"), std::string::npos) << seg.status();
}

TEST(MemfdSegmentTest, HugetlbTruncateKeepsWholePages) {
  if (FreeHugePages() < 3) GTEST_SKIP() << "needs 3 free 2 MiB hugetlb pages (vm.nr_hugepages)";
  auto seg = MemfdSegment::Create("huge", 3 * kHugePageBytes, true, PageKind::kHugetlb);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE(seg->Truncate(kHugePageBytes + 1).ok());
  EXPECT_EQ(seg->size(), 2 * kHugePageBytes);
  struct stat st;
  ASSERT_EQ(::fstat(seg->fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 2 * kHugePageBytes);
}

TEST(MemfdSegmentTest, TransparentHugeSegmentIsRoundedAlignedAndAdvised) {
  // Whether the kernel then backs it with huge pages is the host's shmem
  // THP setting; the rounding, alignment and seals are ours.
  auto seg = MemfdSegment::Create("thp", kHugePageBytes + 1, true, PageKind::kTransparentHuge);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(seg->size(), 2 * kHugePageBytes);
  EXPECT_TRUE(HugeAligned(seg->data()));
  std::memset(seg->mutable_data(), 7, seg->size());
  ASSERT_TRUE(seg->Seal().ok());
  EXPECT_EQ(::pwrite(seg->fd(), "x", 1, 0), -1);
  auto ro = MappedRegion::Map(seg->fd(), seg->size(), MappedRegion::Mode::kReadOnly);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_TRUE(HugeAligned(ro->data()));
  EXPECT_EQ(ro->data()[seg->size() - 1], 7);
}

TEST(MappedRegionTest, LargeMapsStartOnA2MiBBoundaryAndSmallOnesAnywhere) {
  auto seg = MemfdSegment::Create("plain", 5 * kHugePageBytes / 2, true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(seg->size(), 5 * kHugePageBytes / 2);  // 4 KiB pages: not rounded
  for (int i = 0; i < 4; ++i) {
    auto map = MappedRegion::Map(seg->fd(), seg->size(), MappedRegion::Mode::kReadOnly);
    ASSERT_TRUE(map.ok()) << map.status();
    EXPECT_TRUE(HugeAligned(map->data()));
    EXPECT_EQ(map->size(), seg->size());
  }
}

}  // namespace

}  // namespace weightd
