#include "server/memory/segment.h"

#include <errno.h>
#include <sys/stat.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "common/status_macros.h"

namespace weightd {
namespace {
std::atomic<uint64_t> next_segment_id{1};
}  // namespace

absl::Status MemoryAccount::Reserve(uint64_t bytes, absl::string_view what) {
  absl::Status s = ReserveNoReclaim(bytes, what);
  if (s.ok()) return s;
  const uint64_t cur = used_.load(std::memory_order_relaxed);
  const uint64_t short_by = cur + bytes > limit_ ? cur + bytes - limit_ : 0;
  if (ReclaimUpTo(std::numeric_limits<int>::max(), short_by) == 0) return s;
  return ReserveNoReclaim(bytes, what);
}

uint64_t MemoryAccount::ReclaimUpTo(int max_rank, uint64_t bytes) {
  std::shared_ptr<const std::vector<Reclaimer>> chain;
  {
    absl::MutexLock lock(&mu_);
    if (reclaimers_ == nullptr || reclaimers_->empty()) return 0;
    chain = reclaimers_;
    ++calls_in_flight_;
  }
  uint64_t freed = 0;
  for (const Reclaimer& r : *chain) {  // called without the lock
    if (r.rank > max_rank) break;
    freed += r.fn(bytes - std::min(freed, bytes));
    if (freed >= bytes) break;
  }
  {
    absl::MutexLock lock(&mu_);
    --calls_in_flight_;
  }
  return freed;
}

uint64_t MemoryAccount::AddReclaimer(int rank, std::function<uint64_t(uint64_t)> fn) {
  absl::MutexLock lock(&mu_);
  auto next = std::make_shared<std::vector<Reclaimer>>();
  if (reclaimers_ != nullptr) *next = *reclaimers_;
  const uint64_t id = next_reclaimer_id_++;
  next->push_back(Reclaimer{id, rank, std::move(fn)});
  std::stable_sort(next->begin(), next->end(),
                   [](const Reclaimer& a, const Reclaimer& b) { return a.rank < b.rank; });
  reclaimers_ = std::move(next);
  return id;
}

void MemoryAccount::RemoveReclaimer(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto next = std::make_shared<std::vector<Reclaimer>>();
  if (reclaimers_ != nullptr) {
    for (const Reclaimer& r : *reclaimers_) {
      if (r.id != id) next->push_back(r);
    }
  }
  reclaimers_ = std::move(next);
  // A Reserve may still be calling the old chain: its owner must outlive it.
  mu_.Await(absl::Condition(
      +[](int* calls) { return *calls == 0; }, &calls_in_flight_));
}

absl::Status MemoryAccount::ReserveNoReclaim(uint64_t bytes, absl::string_view what) {
  uint64_t cur = used_.load(std::memory_order_relaxed);
  while (true) {
    if (limit_ != 0 && (bytes > limit_ || cur > limit_ - bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": needs ", bytes, " bytes but only ",
          limit_ > cur ? limit_ - cur : 0, " of the host memory budget of ",
          limit_, " bytes are free"));
    }
    if (used_.compare_exchange_weak(cur, cur + bytes,
                                    std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
  }
}

void MemoryAccount::Return(uint64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
}

absl::StatusOr<std::unique_ptr<MemoryCharge>> MemoryCharge::Reserve(
    std::shared_ptr<MemoryAccount> account, uint64_t bytes, absl::string_view what) {
  WD_RETURN_IF_ERROR(account->Reserve(bytes, what));
  return std::unique_ptr<MemoryCharge>(new MemoryCharge(std::move(account), bytes));
}

absl::StatusOr<std::unique_ptr<Segment>> Segment::Create(
    std::shared_ptr<MemoryAccount> account, absl::string_view purpose,
    uint64_t size, bool prefault, bool reclaim) {
  const std::string what = absl::StrCat("segment for ", purpose);
  const std::vector<PageKind> kinds =
      PageKindsToTry(account->huge_pages(), account->shmem_thp(), size);
  absl::Status huge_failed;
  for (PageKind kind : kinds) {
    const uint64_t bytes = kind == PageKind::kSmall ? size : RoundUpToHugePage(size);
    if (kind == PageKind::kHugetlb) {
      // Past a hugetlb cgroup's limit (a pod's hugepages-2Mi) a mapping may
      // still succeed and the first touch of a page then kills the process
      // (SIGBUS, where the limit is charged at fault): never go there.
      const HostPages host = ReadHostPages();
      if (host.cgroup_free.has_value() && *host.cgroup_free < bytes / kHugePageBytes) {
        huge_failed = absl::ResourceExhaustedError(absl::StrCat(
            "the hugetlb cgroup allows ", *host.cgroup_free, " more 2 MiB pages, not ",
            bytes / kHugePageBytes));
        continue;
      }
    }
    WD_RETURN_IF_ERROR(reclaim ? account->Reserve(bytes, what)
                               : account->ReserveNoReclaim(bytes, what));
    auto memfd = MemfdSegment::Create(absl::StrCat("weightd:", purpose), size, prefault, kind);
    if (!memfd.ok() && kind == PageKind::kHugetlb && reclaim &&
        account->ReclaimUpTo(MemoryAccount::kRankWarmReserve, bytes) > 0) {
      // The pool was short: what is cheap to drop (the warm reserve,
      // prepared publish staging) may have held its pages.
      memfd = MemfdSegment::Create(absl::StrCat("weightd:", purpose), size, prefault, kind);
    }
    if (memfd.ok()) {
      if (!huge_failed.ok()) NoteHugePageFallback(*account, purpose, huge_failed, kind);
      return std::unique_ptr<Segment>(new Segment(std::move(account), std::move(*memfd)));
    }
    account->Return(bytes);
    if (kind == PageKind::kSmall) return memfd.status();
    if (huge_failed.ok()) huge_failed = memfd.status();
  }
  // --huge-pages=require, and hugetlb could not be had.
  const HostPages host = ReadHostPages();
  return absl::ResourceExhaustedError(absl::StrCat(
      "--huge-pages=require: ", what, " needs ", RoundUpToHugePage(size) / kHugePageBytes,
      " 2 MiB huge pages (", size, " bytes) but the hugetlb pool has ", host.hugetlb_free,
      " free of ", host.hugetlb_total,
      host.cgroup_free.has_value() ? absl::StrCat(" and the cgroup allows ", *host.cgroup_free)
                                   : std::string(),
      " (raise vm.nr_hugepages on the node, or the pod's hugepages-2Mi limit): ",
      huge_failed.message()));
}

absl::StatusOr<std::unique_ptr<Segment>> Segment::Adopt(std::shared_ptr<MemoryAccount> account,
                                                       absl::string_view purpose, UniqueFd fd,
                                                       PageKind pages) {
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat on an adopted memfd");
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  WD_RETURN_IF_ERROR(account->Reserve(bytes, absl::StrCat("adopted segment for ", purpose)));
  auto memfd = MemfdSegment::Adopt(std::move(fd), pages);
  if (!memfd.ok()) {
    account->Return(bytes);
    return memfd.status();
  }
  return std::unique_ptr<Segment>(new Segment(std::move(account), std::move(*memfd)));
}

void Segment::NoteHugePageFallback(MemoryAccount& account, absl::string_view purpose,
                                   const absl::Status& why, PageKind got) {
  // Counted always (stats), logged the first time: a pool too small for the
  // daemon's working set would otherwise log on every allocation.
  if (account.page_fallbacks_.fetch_add(1, std::memory_order_relaxed) != 0) return;
  LogEvent(LogLevel::kWarning, "huge_pages_fallback",
           {{"purpose", std::string(purpose)},
            {"pages", PageKindName(got)},
            {"reason", std::string(why.message())},
            {"note", "counted in stats page_fallbacks; logged once"}});
}

Segment::Segment(std::shared_ptr<MemoryAccount> account, MemfdSegment memfd)
    : account_(std::move(account)),
      memfd_(std::move(memfd)),
      id_(next_segment_id.fetch_add(1)) {
  account_->segments_.fetch_add(1, std::memory_order_relaxed);
  account_->AddPages(memfd_.pages(), memfd_.size());
}

absl::Status Segment::Truncate(uint64_t new_size) {
  const uint64_t old_size = memfd_.size();
  WD_RETURN_IF_ERROR(memfd_.Truncate(new_size));
  account_->Return(old_size - memfd_.size());
  account_->SubPages(memfd_.pages(), old_size - memfd_.size());
  return absl::OkStatus();
}

absl::StatusOr<int> Segment::ShareableFd() const {
  if (!memfd_.sealed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", id_, " is not sealed: its bytes may still change"));
  }
  return memfd_.fd();
}

void Segment::AddReleaseHook(absl::AnyInvocable<void() &&> hook) const {
  absl::MutexLock lock(&hooks_mu_);
  release_hooks_.push_back(std::move(hook));
}

Segment::~Segment() {
  std::vector<absl::AnyInvocable<void() &&>> hooks;
  {
    absl::MutexLock lock(&hooks_mu_);
    hooks.swap(release_hooks_);
  }
  for (auto it = hooks.rbegin(); it != hooks.rend(); ++it) std::move (*it)();
  account_->Return(memfd_.size());
  account_->SubPages(memfd_.pages(), memfd_.size());
  account_->segments_.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace weightd
