#include "server/base/fault_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/digest.h"
#include "common/fd.h"

namespace weightd {
namespace {

const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

// A shared mapping of `pages` pages of a memfd whose file then shrinks to
// `kept` pages: touching a page past the file's end faults with SIGBUS
// (what a punched staging page does on an empty hugetlb pool, on any box).
struct ShrunkMapping {
  ShrunkMapping(size_t pages, size_t kept) : fd(::memfd_create("fault-guard-test", MFD_CLOEXEC)) {
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(pages * kPage)), 0);
    auto m = MappedRegion::Map(fd.get(), pages * kPage, MappedRegion::Mode::kReadWrite);
    EXPECT_TRUE(m.ok()) << m.status();
    map = std::move(*m);
    std::memset(map.data(), 0x5A, pages * kPage);
    EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kept * kPage)), 0);
  }
  UniqueFd fd;
  MappedRegion map;
};

TEST(FaultGuardTest, AccessThatRunsToItsEndReturnsNothing) {
  std::vector<uint8_t> a(4096, 1), b(4096, 0);
  auto fault = RunFaultGuarded(b.data(), b.size(), [&] { std::memcpy(b.data(), a.data(), 4096); });
  EXPECT_FALSE(fault.has_value());
  EXPECT_EQ(b, a);
}

TEST(FaultGuardTest, ReadPastTheFileIsCutShortAtTheFaultingPage) {
  ShrunkMapping m(4, 1);
  std::vector<uint8_t> out(4 * kPage, 0);
  auto fault = RunFaultGuarded(m.map.data(), m.map.size(),
                               [&] { std::memcpy(out.data(), m.map.data(), out.size()); });
  ASSERT_TRUE(fault.has_value());
  // memcpy may copy in any order: some byte past the file's first page.
  EXPECT_GE(fault->offset, kPage);
  EXPECT_LT(fault->offset, 4 * kPage);
}

TEST(FaultGuardTest, WriteIntoAPageWithoutBackingIsCutShort) {
  ShrunkMapping m(3, 2);
  std::vector<uint8_t> in(kPage, 7);
  auto fault = RunFaultGuarded(m.map.data(), m.map.size(), [&] {
    std::memcpy(m.map.data() + 2 * kPage + 100, in.data(), 64);
  });
  ASSERT_TRUE(fault.has_value());
  EXPECT_GE(fault->offset, 2 * kPage + 100);
  EXPECT_LT(fault->offset, 2 * kPage + 164);
}

TEST(FaultGuardTest, DigestKernelsRunUnderTheGuard) {
  ShrunkMapping m(64, 40);
  Digest d;
  auto fault = RunFaultGuarded(m.map.data(), m.map.size(),
                               [&] { d = DigestBytes(m.map.data(), m.map.size()); });
  ASSERT_TRUE(fault.has_value());
  EXPECT_GE(fault->offset, 40 * kPage);
  EXPECT_LT(fault->offset, 41 * kPage);
  // The pages that are there digest as before.
  fault = RunFaultGuarded(m.map.data(), m.map.size(),
                          [&] { d = DigestBytes(m.map.data(), 40 * kPage); });
  EXPECT_FALSE(fault.has_value());
  std::vector<uint8_t> same(40 * kPage, 0x5A);
  EXPECT_EQ(d, DigestBytes(same.data(), same.size()));
}

TEST(FaultGuardTest, RecoversEveryTimeAndLeavesTheSignalMaskAsItWas) {
  ShrunkMapping m(2, 1);
  // A mask of the thread's own: the jump back must leave it as it was.
  sigset_t usr1, before;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &usr1, &before), 0);
  for (int i = 0; i < 1000; ++i) {
    volatile uint8_t sink = 0;
    auto fault = RunFaultGuarded(m.map.data(), m.map.size(),
                                 [&] { sink = m.map.data()[kPage + (i % 64)]; });
    ASSERT_TRUE(fault.has_value()) << i;
    ASSERT_EQ(fault->offset, kPage + (i % 64));
    (void)sink;
  }
  sigset_t blocked;
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, nullptr, &blocked), 0);
  EXPECT_FALSE(sigismember(&blocked, SIGBUS));
  EXPECT_TRUE(sigismember(&blocked, SIGUSR1));
  EXPECT_FALSE(sigismember(&blocked, SIGUSR2));
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &before, nullptr), 0);
}

TEST(FaultGuardTest, NestedGuardsEachTakeTheirOwnRange) {
  ShrunkMapping outer_map(2, 1), inner_map(2, 1);
  std::optional<MemoryFault> inner;
  // The inner access faults in its own range: it returns, the outer one goes on.
  auto outer = RunFaultGuarded(outer_map.map.data(), outer_map.map.size(), [&] {
    inner = RunFaultGuarded(inner_map.map.data(), inner_map.map.size(),
                            [&] { inner_map.map.data()[kPage + 1] = 1; });
  });
  EXPECT_FALSE(outer.has_value());
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->offset, kPage + 1);
  // A fault in the outer range inside the inner access ends both.
  inner.reset();
  bool after_inner = false;
  outer = RunFaultGuarded(outer_map.map.data(), outer_map.map.size(), [&] {
    inner = RunFaultGuarded(inner_map.map.data(), inner_map.map.size(),
                            [&] { outer_map.map.data()[kPage + 2] = 1; });
    after_inner = true;
  });
  ASSERT_TRUE(outer.has_value());
  EXPECT_EQ(outer->offset, kPage + 2);
  EXPECT_FALSE(inner.has_value());
  EXPECT_FALSE(after_inner);
  // Both frames are gone: a later guard still works.
  auto again = RunFaultGuarded(inner_map.map.data(), inner_map.map.size(),
                               [&] { inner_map.map.data()[kPage] = 1; });
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->offset, kPage);
}

TEST(FaultGuardTest, ThreadsGuardTheirOwnAccesses) {
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<ShrunkMapping>> maps;
  for (int t = 0; t < kThreads; ++t) maps.push_back(std::make_unique<ShrunkMapping>(3, 1 + t % 2));
  std::atomic<int> caught{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ShrunkMapping& m = *maps[t];
      for (int i = 0; i < 200; ++i) {
        std::vector<uint8_t> out(3 * kPage);
        auto fault = RunFaultGuarded(m.map.data(), m.map.size(),
                                     [&] { std::memcpy(out.data(), m.map.data(), out.size()); });
        if (fault.has_value() && fault->offset >= (1 + t % 2) * kPage) caught.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(caught.load(), kThreads * 200);
}

// Each ends the process: the guard must not take these faults.
void FaultOutsideTheRange() {
  ShrunkMapping guarded(2, 2), other(2, 1);
  (void)RunFaultGuarded(guarded.map.data(), guarded.map.size(), [&] {
    volatile uint8_t sink = other.map.data()[kPage];
    (void)sink;
  });
  std::exit(0);
}
void FaultAfterTheGuard() {
  ShrunkMapping m(2, 1);
  (void)RunFaultGuarded(m.map.data(), m.map.size(), [&] { m.map.data()[kPage] = 1; });
  m.map.data()[kPage] = 1;  // no guard now
  std::exit(0);
}
void SigbusSentByAProcess() {
  ShrunkMapping m(2, 2);
  (void)RunFaultGuarded(m.map.data(), m.map.size(), [&] { ::raise(SIGBUS); });
  std::exit(0);
}

TEST(FaultGuardDeathTest, FaultsNoGuardCoversStillCrash) {
#if defined(__SANITIZE_THREAD__)
  // The fatal SIGBUS is reported by ThreadSanitizer (as it should be), and
  // the TSan run fails on any report (scripts/test.sh).
  GTEST_SKIP() << "ThreadSanitizer reports the expected fatal SIGBUS";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(FaultOutsideTheRange(), "");
  EXPECT_DEATH(FaultAfterTheGuard(), "");
  EXPECT_DEATH(SigbusSentByAProcess(), "");
}

// The real thing on hugetlb pages: a page punched out of a shared memfd
// while the pool has no free page left faults with SIGBUS on next touch.
TEST(FaultGuardTest, PunchedHugetlbPageWithAnEmptyPool) {
  auto free_pages = [] {
    std::ifstream f("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages");
    std::ifstream r("/sys/kernel/mm/hugepages/hugepages-2048kB/resv_hugepages");
    long free = 0, resv = 0;
    f >> free;
    r >> resv;
    return free - resv;
  };
  if (free_pages() < 2) GTEST_SKIP() << "needs 2 free 2 MiB hugetlb pages";
  auto seg = MemfdSegment::Create("fault-guard-huge", 2 * kHugePageBytes, /*prefault=*/true,
                                  PageKind::kHugetlb);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::memset(seg->mutable_data(), 1, seg->size());
  ASSERT_EQ(::fallocate(seg->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(kHugePageBytes)),
            0);
  // Every free page of the pool, held by a mapping of our own.
  const long take = free_pages();
  UniqueFd hold(::memfd_create("fault-guard-hold", MFD_CLOEXEC | MFD_HUGETLB));
  ASSERT_TRUE(hold.valid());
  MappedRegion held;
  if (take > 0) {
    ASSERT_EQ(::ftruncate(hold.get(), take * static_cast<off_t>(kHugePageBytes)), 0);
    auto m = MappedRegion::Map(hold.get(), take * kHugePageBytes, MappedRegion::Mode::kReadWrite);
    ASSERT_TRUE(m.ok()) << m.status();
    held = std::move(*m);
  }
  ASSERT_EQ(free_pages(), 0);
  std::vector<uint8_t> in(4096, 9);
  auto fault = RunFaultGuarded(seg->mutable_data(), seg->size(), [&] {
    std::memcpy(seg->mutable_data() + 8192, in.data(), in.size());
  });
  ASSERT_TRUE(fault.has_value());
  EXPECT_GE(fault->offset, 8192u);
  EXPECT_LT(fault->offset, 8192u + 4096);
  // The page still there reads as written.
  uint8_t second = 0;
  fault = RunFaultGuarded(seg->data(), seg->size(),
                          [&] { second = seg->data()[kHugePageBytes + 5]; });
  EXPECT_FALSE(fault.has_value());
  EXPECT_EQ(second, 1);
}

}  // namespace
}  // namespace weightd
