#include "server/memory/huge_pages.h"

#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace weightd {

std::optional<HugePageMode> ParseHugePageMode(absl::string_view text) {
  if (text == "off") return HugePageMode::kOff;
  if (text == "auto") return HugePageMode::kAuto;
  if (text == "require") return HugePageMode::kRequire;
  return std::nullopt;
}

const char* HugePageModeName(HugePageMode mode) {
  switch (mode) {
    case HugePageMode::kOff:
      return "off";
    case HugePageMode::kAuto:
      return "auto";
    case HugePageMode::kRequire:
      return "require";
  }
  return "?";
}

std::string ParseShmemThp(absl::string_view shmem_enabled) {
  const size_t open = shmem_enabled.find('[');
  const size_t close = shmem_enabled.find(']');
  if (open == absl::string_view::npos || close == absl::string_view::npos || close < open) {
    return "";
  }
  return std::string(shmem_enabled.substr(open + 1, close - open - 1));
}

namespace {
// A small /proc or /sys file (they report size 0: read until EOF); "" when
// it cannot be read.
std::string ReadProcFile(const char* path) {
  std::string out;
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > (1 << 16)) break;
  }
  return out;
}

uint64_t ReadCount(const char* path) {
  uint64_t n = 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadProcFile(path)), &n) ? n : 0;
}
}  // namespace

std::pair<std::string, std::string> HugetlbCgroupFiles(absl::string_view proc_self_cgroup,
                                                       absl::string_view root) {
  std::pair<std::string, std::string> v2;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    std::string path(f[2]);
    if (path == "/") path.clear();
    for (absl::string_view controller : absl::StrSplit(f[1], ',')) {
      if (controller == "hugetlb") {  // v1
        const std::string dir = absl::StrCat(root, "/hugetlb", path, "/");
        return {dir + "hugetlb.2MB.limit_in_bytes", dir + "hugetlb.2MB.usage_in_bytes"};
      }
    }
    if (f[0] == "0" && f[1].empty()) {
      const std::string dir = absl::StrCat(root, path, "/");
      v2 = {dir + "hugetlb.2MB.max", dir + "hugetlb.2MB.current"};
    }
  }
  return v2;
}

HostPages ReadHostPages() {
  constexpr const char* kPool = "/sys/kernel/mm/hugepages/hugepages-2048kB/";
  HostPages h;
  const auto [limit_file, usage_file] = HugetlbCgroupFiles(ReadProcFile("/proc/self/cgroup"), "/sys/fs/cgroup");
  if (!limit_file.empty()) {
    // "max" (v2) or a huge number (v1) when there is no limit; a missing
    // file (no hugetlb controller enabled here) means none either.
    uint64_t limit = 0, usage = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadProcFile(limit_file.c_str())), &limit) &&
        limit < (uint64_t{1} << 60)) {
      (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadProcFile(usage_file.c_str())), &usage);
      h.cgroup_free = limit > usage ? (limit - usage) / kHugePageBytes : 0;
    }
  }
  h.hugetlb_total = ReadCount(absl::StrCat(kPool, "nr_hugepages").c_str());
  const uint64_t free = ReadCount(absl::StrCat(kPool, "free_hugepages").c_str());
  const uint64_t reserved = ReadCount(absl::StrCat(kPool, "resv_hugepages").c_str());
  h.hugetlb_free = free > reserved ? free - reserved : 0;
  h.shmem_thp = ParseShmemThp(ReadProcFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled"));
  return h;
}

bool ShmemThpHonoured(absl::string_view shmem_thp) {
  return shmem_thp == "always" || shmem_thp == "within_size" || shmem_thp == "advise" ||
         shmem_thp == "force";
}

std::vector<PageKind> PageKindsToTry(HugePageMode mode, bool shmem_thp_usable, uint64_t size) {
  if (mode == HugePageMode::kOff || size < kHugePageBytes) return {PageKind::kSmall};
  if (mode == HugePageMode::kRequire) return {PageKind::kHugetlb};
  std::vector<PageKind> kinds = {PageKind::kHugetlb};
  if (shmem_thp_usable) kinds.push_back(PageKind::kTransparentHuge);
  kinds.push_back(PageKind::kSmall);
  return kinds;
}

}  // namespace weightd
