// Which pages the daemon's host segments use (--huge-pages), and what the
// host offers: the hugetlb pool (/proc/meminfo) and the shmem THP setting
// (/sys/kernel/mm/transparent_hugepage/shmem_enabled).
//
// Segments of at least 2 MiB are candidates for huge pages; smaller ones
// always use 4 KiB pages (rounding them up would waste more than they hold).
// For a candidate:
//   off      4 KiB pages.
//   auto     memfd_create(MFD_HUGETLB) 2 MiB pages while the hugetlb pool
//            has room for the whole segment; else shmem advised
//            MADV_HUGEPAGE where the host's shmem THP setting honours it;
//            else 4 KiB pages. Each segment chooses on its own: a pool that
//            runs out in the middle of a load serves the rest of the load
//            from the next kind down.
//   require  hugetlb pages or RESOURCE_EXHAUSTED naming the shortfall; the
//            load (or fetch) that asked fails whole and frees what it had.
// Huge segments are sized in whole 2 MiB pages and charged to the budget
// for what they take.
#ifndef WEIGHTD_SERVER_MEMORY_HUGE_PAGES_H_
#define WEIGHTD_SERVER_MEMORY_HUGE_PAGES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/fd.h"

namespace weightd {

enum class HugePageMode { kOff, kAuto, kRequire };

// "off", "auto", "require"; nullopt for anything else.
std::optional<HugePageMode> ParseHugePageMode(absl::string_view text);
const char* HugePageModeName(HugePageMode mode);

// What the host offers now.
struct HostPages {
  // The 2 MiB hugetlb pool (/sys/kernel/mm/hugepages/hugepages-2048kB):
  // its pages, and those a new mapping may take (free less reserved).
  uint64_t hugetlb_total = 0;
  uint64_t hugetlb_free = 0;
  // Pages this process's hugetlb cgroup still allows (a Kubernetes pod's
  // hugepages-2Mi limit less what it uses); nullopt when no limit applies.
  std::optional<uint64_t> cgroup_free;
  std::string shmem_thp;  // the bracketed shmem_enabled value; "" when unknown

  // Pages a new segment may take: the pool's free pages within the cgroup's.
  uint64_t usable() const {
    return cgroup_free.has_value() && *cgroup_free < hugetlb_free ? *cgroup_free : hugetlb_free;
  }
};

// The bracketed value of shmem_enabled's text ("always [never] ..." ->
// "never"); "" when there is none.
std::string ParseShmemThp(absl::string_view shmem_enabled);
// The hugetlb cgroup files for 2 MiB pages of this process, from the text
// of /proc/self/cgroup: cgroup v2 ("0::/path" -> <root>/path/hugetlb.2MB.max
// and .current) or v1 ("N:hugetlb:/path" -> <root>/hugetlb/path/
// hugetlb.2MB.limit_in_bytes and .usage_in_bytes). {limit, usage} paths;
// empty when there is no hugetlb controller.
std::pair<std::string, std::string> HugetlbCgroupFiles(absl::string_view proc_self_cgroup,
                                                       absl::string_view root);
// Reads the host's pool and THP setting, and this process's hugetlb cgroup
// room.
HostPages ReadHostPages();
// Whether MADV_HUGEPAGE on a memfd's mapping can give it huge pages under
// this shmem_enabled value (always, within_size, advise, force).
bool ShmemThpHonoured(absl::string_view shmem_thp);

// The page kinds a segment of `size` bytes tries, best first, under `mode`
// on a host whose shmem THP setting is `shmem_thp_usable`. A hugetlb pool
// of the wrong page size (not 2 MiB) is never used.
std::vector<PageKind> PageKindsToTry(HugePageMode mode, bool shmem_thp_usable, uint64_t size);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_HUGE_PAGES_H_
