#include "server/memory/huge_pages.h"

#include <cstring>
#include <memory>

#include <gtest/gtest.h>

#include "server/memory/segment.h"

namespace weightd {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(HugePagesTest, ModesParseAndName) {
  for (HugePageMode m : {HugePageMode::kOff, HugePageMode::kAuto, HugePageMode::kRequire}) {
    EXPECT_EQ(ParseHugePageMode(HugePageModeName(m)), m);
  }
  EXPECT_FALSE(ParseHugePageMode("on").has_value());
  EXPECT_FALSE(ParseHugePageMode("").has_value());
}

TEST(HugePagesTest, ShmemThpSettingIsTheBracketedOne) {
  EXPECT_EQ(ParseShmemThp("always within_size advise [never] deny force\n"), "never");
  EXPECT_EQ(ParseShmemThp("always within_size [advise] never deny force"), "advise");
  EXPECT_EQ(ParseShmemThp(""), "");
  EXPECT_EQ(ParseShmemThp("garbage"), "");
  EXPECT_TRUE(ShmemThpHonoured("advise"));
  EXPECT_TRUE(ShmemThpHonoured("always"));
  EXPECT_TRUE(ShmemThpHonoured("within_size"));
  EXPECT_TRUE(ShmemThpHonoured("force"));
  EXPECT_FALSE(ShmemThpHonoured("never"));
  EXPECT_FALSE(ShmemThpHonoured("deny"));
  EXPECT_FALSE(ShmemThpHonoured(""));
}

TEST(HugePagesTest, KindsTriedBestFirst) {
  using K = PageKind;
  using V = std::vector<PageKind>;
  // Under 2 MiB: always small pages, whatever the mode.
  for (HugePageMode m : {HugePageMode::kOff, HugePageMode::kAuto, HugePageMode::kRequire}) {
    EXPECT_EQ(PageKindsToTry(m, true, 2 * kMiB - 1), V{K::kSmall});
  }
  EXPECT_EQ(PageKindsToTry(HugePageMode::kOff, true, 64 * kMiB), V{K::kSmall});
  EXPECT_EQ(PageKindsToTry(HugePageMode::kAuto, true, 2 * kMiB),
            (V{K::kHugetlb, K::kTransparentHuge, K::kSmall}));
  EXPECT_EQ(PageKindsToTry(HugePageMode::kAuto, false, 2 * kMiB), (V{K::kHugetlb, K::kSmall}));
  EXPECT_EQ(PageKindsToTry(HugePageMode::kRequire, true, 2 * kMiB), V{K::kHugetlb});
}

TEST(HugePagesTest, CgroupFilesForV1AndV2) {
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(HugetlbCgroupFiles("0::/kubepods/pod1/ctr\n", "/cg"),
            (P{"/cg/kubepods/pod1/ctr/hugetlb.2MB.max", "/cg/kubepods/pod1/ctr/hugetlb.2MB.current"}));
  EXPECT_EQ(HugetlbCgroupFiles("0::/\n", "/cg"), (P{"/cg/hugetlb.2MB.max", "/cg/hugetlb.2MB.current"}));
  // v1: the hugetlb hierarchy wins over the unified one.
  EXPECT_EQ(HugetlbCgroupFiles("12:hugetlb:/kubepods/x\n4:memory:/a\n0::/\n", "/cg"),
            (P{"/cg/hugetlb/kubepods/x/hugetlb.2MB.limit_in_bytes",
               "/cg/hugetlb/kubepods/x/hugetlb.2MB.usage_in_bytes"}));
  EXPECT_EQ(HugetlbCgroupFiles("4:memory:/a\n3:cpu,cpuacct:/\n", "/cg"), P{});
  EXPECT_EQ(HugetlbCgroupFiles("", "/cg"), P{});
  HostPages h;
  h.hugetlb_free = 10;
  EXPECT_EQ(h.usable(), 10u);
  h.cgroup_free = 3;
  EXPECT_EQ(h.usable(), 3u);
  h.cgroup_free = 30;
  EXPECT_EQ(h.usable(), 10u);
}

TEST(HugePagesTest, HostPagesAreReadable) {
  const HostPages h = ReadHostPages();
  EXPECT_LE(h.hugetlb_free, h.hugetlb_total);
}

// A pool too small for the segment (none here unless the run reserved one;
// then larger than all of it).
uint64_t BeyondThePool() { return (ReadHostPages().hugetlb_total + 1) * kHugePageBytes; }

TEST(HugePagesTest, RequireWithoutRoomFailsNamingTheShortfallAndChargesNothing) {
  auto account = std::make_shared<MemoryAccount>(0, HugePageMode::kRequire, false);
  const uint64_t size = BeyondThePool();
  auto seg = Segment::Create(account, "checkpoint", size, false);
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted) << seg.status();
  const std::string msg(seg.status().message());
  EXPECT_NE(msg.find("--huge-pages=require"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checkpoint"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(size / kHugePageBytes) + " 2 MiB huge pages"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("vm.nr_hugepages"), std::string::npos) << msg;
  EXPECT_EQ(account->used(), 0u);
  EXPECT_EQ(account->segments(), 0u);
  // Small segments are not huge-page candidates: require does not refuse them.
  auto small = Segment::Create(account, "meta", kMiB, false);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->pages(), PageKind::kSmall);
}

TEST(HugePagesTest, AutoWithoutRoomFallsBackCountsItAndChargesWhatItTook) {
  auto account = std::make_shared<MemoryAccount>(0, HugePageMode::kAuto, false);
  const uint64_t size = BeyondThePool() + 12345;
  auto seg = Segment::Create(account, "checkpoint", size, false);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ((*seg)->pages(), PageKind::kSmall);
  EXPECT_EQ((*seg)->size(), size);
  EXPECT_EQ(account->used(), size);
  EXPECT_EQ(account->page_bytes(PageKind::kSmall), size);
  EXPECT_EQ(account->page_bytes(PageKind::kHugetlb), 0u);
  EXPECT_EQ(account->page_fallbacks(), 1u);
  seg->reset();
  EXPECT_EQ(account->used(), 0u);
  EXPECT_EQ(account->page_bytes(PageKind::kSmall), 0u);
}

TEST(HugePagesTest, AutoFallsBackToAdvisedShmemWhereTheHostHonoursIt) {
  auto account = std::make_shared<MemoryAccount>(0, HugePageMode::kAuto, /*shmem_thp=*/true);
  auto seg = Segment::Create(account, "packed", BeyondThePool() + 1, false);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ((*seg)->pages(), PageKind::kTransparentHuge);
  EXPECT_EQ((*seg)->size() % kHugePageBytes, 0u);
  EXPECT_EQ(account->used(), (*seg)->size());
  EXPECT_EQ(account->page_bytes(PageKind::kTransparentHuge), (*seg)->size());
}

TEST(HugePagesTest, HugetlbSegmentsChargeWholePagesAndTruncateByThem) {
  if (ReadHostPages().hugetlb_free < 4) {
    GTEST_SKIP() << "needs 4 free 2 MiB hugetlb pages (vm.nr_hugepages)";
  }
  auto account = std::make_shared<MemoryAccount>(0, HugePageMode::kRequire, false);
  auto seg = Segment::Create(account, "reserve", 3 * kHugePageBytes + 1, true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ((*seg)->pages(), PageKind::kHugetlb);
  EXPECT_EQ((*seg)->size(), 4 * kHugePageBytes);
  EXPECT_EQ(account->used(), 4 * kHugePageBytes);
  EXPECT_EQ(account->page_bytes(PageKind::kHugetlb), 4 * kHugePageBytes);
  ASSERT_TRUE((*seg)->Truncate(kHugePageBytes + 7).ok());
  EXPECT_EQ((*seg)->size(), 2 * kHugePageBytes);
  EXPECT_EQ(account->used(), 2 * kHugePageBytes);
  EXPECT_EQ(account->page_bytes(PageKind::kHugetlb), 2 * kHugePageBytes);
  std::memset((*seg)->mutable_data(), 1, (*seg)->size());
  ASSERT_TRUE((*seg)->Seal().ok());
  auto fd = (*seg)->ShareableFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  seg->reset();
  EXPECT_EQ(account->used(), 0u);
  EXPECT_EQ(account->page_bytes(PageKind::kHugetlb), 0u);
}

TEST(HugePagesTest, BudgetCountsTheRoundedSize) {
  // 3 MiB asked, a budget of 3 MiB: the hugetlb try needs 4 MiB and is
  // refused by the budget (not by the pool), naming the budget.
  auto account = std::make_shared<MemoryAccount>(3 * kMiB, HugePageMode::kRequire, false);
  auto seg = Segment::Create(account, "checkpoint", 3 * kMiB, false);
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(seg.status().message().find("budget"), std::string::npos) << seg.status();
  EXPECT_NE(seg.status().message().find(std::to_string(4 * kMiB)), std::string::npos)
      << seg.status();
}

}  // namespace
}  // namespace weightd
