#include "server/memory/segment_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"

namespace weightd {

SegmentPool::SegmentPool(Options options) : options_(std::move(options)) {
  stats_.chunk_bytes = options_.chunk_bytes;
  stats_.target_bytes = options_.chunk_bytes == 0
                            ? 0
                            : options_.target_bytes / options_.chunk_bytes * options_.chunk_bytes;
  reclaimer_id_ = options_.account->AddReclaimer(MemoryAccount::kRankWarmReserve,
                                                 [this](uint64_t bytes) { return Reclaim(bytes); });
  filler_ = std::thread([this] { FillLoop(); });
}

SegmentPool::~SegmentPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (filler_.joinable()) filler_.join();
  options_.account->RemoveReclaimer(reclaimer_id_);
  absl::MutexLock lock(&mu_);
  graveyard_.clear();
}

bool SegmentPool::NeedsFill() const {
  return stats_.ready_bytes + options_.chunk_bytes <= stats_.target_bytes;
}

std::unique_ptr<Segment> SegmentPool::Take() {
  absl::MutexLock lock(&mu_);
  if (ready_.empty()) {
    ++stats_.missed;
    return nullptr;
  }
  std::unique_ptr<Segment> seg = std::move(ready_.front());
  ready_.pop_front();
  stats_.ready_bytes -= seg->size();
  ++stats_.taken;
  return seg;
}

void SegmentPool::Dispose(SegmentPtr segment) {
  absl::MutexLock lock(&mu_);
  graveyard_.push_back(std::move(segment));
  stats_.disposing = graveyard_.size();
}

void SegmentPool::BeginWork() {
  absl::MutexLock lock(&mu_);
  ++active_;
}

void SegmentPool::EndWork() {
  absl::MutexLock lock(&mu_);
  --active_;
  quiet_from_ = absl::Now() + options_.quiet;
}

uint64_t SegmentPool::Reclaim(uint64_t bytes) {
  std::vector<std::unique_ptr<Segment>> dropped;
  std::vector<SegmentPtr> buried;
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const SegmentPtr& seg : graveyard_) {
      if (seg.use_count() == 1) freed += seg->size();
    }
    buried.swap(graveyard_);
    stats_.disposing = 0;
    while (freed < std::max<uint64_t>(bytes, 1) && !ready_.empty()) {
      freed += ready_.back()->size();
      stats_.ready_bytes -= ready_.back()->size();
      dropped.push_back(std::move(ready_.back()));
      ready_.pop_back();
      ++stats_.reclaimed;
    }
    if (freed > 0) holdoff_until_ = absl::Now() + options_.reclaim_holdoff;
  }
  buried.clear();
  dropped.clear();  // returns the bytes to the account
  if (freed > 0) {
    LogEvent(LogLevel::kDebug, "reserve_reclaimed", {{"bytes", absl::StrCat(freed)}});
  }
  return freed;
}

bool SegmentPool::WaitFull(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto full = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !NeedsFill() || stop_; };
  return mu_.AwaitWithTimeout(absl::Condition(&full), timeout) && !NeedsFill();
}

SegmentPoolStats SegmentPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void SegmentPool::FillLoop() {
  // Background work: it must never slow a fetch down.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  const uint64_t chunk = options_.chunk_bytes;
  MemoryAccount& account = *options_.account;
  while (true) {
    std::vector<SegmentPtr> buried;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (active_ == 0 && (!graveyard_.empty() || NeedsFill()));
      };
      mu_.Await(absl::Condition(&wake));
      if (stop_) return;
      const absl::Time now = absl::Now();
      absl::Duration wait = quiet_from_ - now;
      if (graveyard_.empty()) {
        wait = std::max(wait, holdoff_until_ - now);
        if (budget_short_) wait = std::max(wait, absl::Seconds(1));
      }
      if (wait > absl::ZeroDuration()) {
        auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
        mu_.AwaitWithTimeout(absl::Condition(&stopped), wait);
        budget_short_ = false;
        continue;  // re-check everything
      }
      buried.swap(graveyard_);
      stats_.disposing = 0;
    }
    if (!buried.empty()) {
      buried.clear();  // frees what nobody else holds
      continue;
    }
    // Leave at least one chunk of the budget free for real work.
    const uint64_t limit = account.limit();
    if (limit != 0 && account.used() + 2 * chunk > limit) {
      absl::MutexLock lock(&mu_);
      budget_short_ = true;
      continue;
    }
    auto seg = Segment::Create(options_.account, "reserve", chunk, /*prefault=*/true,
                               /*reclaim=*/false);
    absl::MutexLock lock(&mu_);
    if (!seg.ok()) {
      budget_short_ = true;
      continue;
    }
    if (stop_) return;
    stats_.ready_bytes += (*seg)->size();
    ++stats_.filled;
    ready_.push_back(std::move(*seg));
  }
}

}  // namespace weightd
