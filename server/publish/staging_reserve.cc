#include "server/publish/staging_reserve.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"

namespace weightd {

StagingReserve::StagingReserve(Options options) : options_(std::move(options)) {
  if (!options_.enabled) return;
  reclaimer_ = options_.memory->AddReclaimer(MemoryAccount::kRankWarmReserve,
                                             [this](uint64_t) { return Reclaim(); });
  stager_ = std::thread([this] { StagerLoop(); });
}

StagingReserve::~StagingReserve() { Stop(); }

void StagingReserve::Want(const std::string& model, uint64_t instance, uint64_t bytes) {
  if (!options_.enabled || bytes == 0) return;
  std::unique_ptr<Segment> drop;  // another size: freed outside the lock
  absl::MutexLock lock(&mu_);
  Entry& a = entries_[instance];
  if (a.bytes == bytes && (a.segment != nullptr || a.in_flight)) return;
  a.model = model;
  a.bytes = bytes;
  drop = std::move(a.segment);
  wanted_.Signal();
}

std::unique_ptr<Segment> StagingReserve::Take(uint64_t instance, uint64_t bytes) {
  std::unique_ptr<Segment> out;
  std::unique_ptr<Segment> drop;  // another size: freed outside the lock
  {
    absl::MutexLock lock(&mu_);
    // One the stager is faulting in now is waited for (a trainer that
    // publishes again at once), rather than allocated a second time.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    auto it = entries_.find(instance);
    while (it != entries_.end() && it->second.in_flight && it->second.bytes == bytes &&
           !ready_.WaitWithDeadline(&mu_, until)) {
      it = entries_.find(instance);
    }
    it = entries_.find(instance);
    if (it == entries_.end() || it->second.in_flight) return nullptr;
    if (it->second.segment != nullptr && it->second.bytes == bytes) {
      out = std::move(it->second.segment);
    } else {
      drop = std::move(it->second.segment);
    }
    // The stager makes the next one after this session commits.
    entries_.erase(it);
  }
  return out;
}

uint64_t StagingReserve::Bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const auto& [instance, a] : entries_) {
    bytes += a.segment != nullptr ? a.segment->size() : 0;
  }
  return bytes;
}

void StagingReserve::Drop(uint64_t instance) {
  std::unique_ptr<Segment> drop;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(instance);
  if (it == entries_.end()) return;
  drop = std::move(it->second.segment);
  entries_.erase(it);
  ready_.SignalAll();
}

uint64_t StagingReserve::Reclaim(absl::Duration idle) {
  std::vector<std::unique_ptr<Segment>> dropped;
  uint64_t freed = 0;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      Entry& a = it->second;
      if (a.in_flight || (a.segment != nullptr && now - a.ready_at < idle)) {
        ++it;
        continue;
      }
      if (a.segment != nullptr) {
        freed += a.segment->size();
        dropped.push_back(std::move(a.segment));
      }
      // Nothing is prepared again before the model's next publish.
      entries_.erase(it++);
    }
    ready_.SignalAll();
  }
  dropped.clear();  // returns the bytes to the budget
  if (freed > 0) {
    LogEvent(LogLevel::kDebug, "publish_staging_reclaimed", {{"bytes", absl::StrCat(freed)}});
  }
  return freed;
}

bool StagingReserve::NextWantedLocked(uint64_t* instance, uint64_t* bytes, std::string* model) {
  for (auto& [i, a] : entries_) {
    if (a.segment == nullptr && !a.in_flight && a.bytes > 0) {
      a.in_flight = true;
      *instance = i;
      *bytes = a.bytes;
      *model = a.model;
      return true;
    }
  }
  return false;
}

void StagingReserve::StagerLoop() {
  for (;;) {
    uint64_t instance = 0;
    uint64_t bytes = 0;
    std::string model;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && !NextWantedLocked(&instance, &bytes, &model)) wanted_.Wait(&mu_);
      if (stop_) return;
    }
    // Not for a model unloaded since its publish; only into room the
    // budget has (never evicting anything for it).
    absl::StatusOr<std::unique_ptr<Segment>> segment =
        absl::NotFoundError("the model was unloaded");
    if (options_.still_loaded(model, instance)) {
      HostMemoryManager::AllocateOptions alloc;
      alloc.purpose = "publish";
      alloc.prefault = true;
      alloc.reclaim = false;
      segment = options_.memory->Allocate(bytes, alloc);
    }
    if (!segment.ok()) {
      LogEvent(LogLevel::kDebug, "publish_staging_ahead_skipped",
               {{"bytes", absl::StrCat(bytes)}, {"error", segment.status().ToString()}});
    }
    FinishMaking(instance, bytes, std::move(segment));
  }
}

void StagingReserve::FinishMaking(uint64_t instance, uint64_t bytes,
                                  absl::StatusOr<std::unique_ptr<Segment>> segment) {
  std::unique_ptr<Segment> unused;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(instance);
  const bool still = it != entries_.end() && it->second.in_flight && it->second.bytes == bytes;
  if (still) it->second.in_flight = false;
  if (segment.ok() && still) {
    it->second.segment = std::move(*segment);
    it->second.ready_at = absl::Now();
  } else {
    if (segment.ok()) unused = std::move(*segment);  // taken, dropped or resized meanwhile
    if (still) entries_.erase(it);                   // not again before the next publish
  }
  ready_.SignalAll();
}

void StagingReserve::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wanted_.SignalAll();
  }
  if (stager_.joinable()) stager_.join();
  if (reclaimer_ != 0) options_.memory->RemoveReclaimer(reclaimer_);
  reclaimer_ = 0;
  Reclaim();
}

}  // namespace weightd
