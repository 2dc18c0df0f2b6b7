#include "server/memory/host_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {

HostMemoryManager::HostMemoryManager(Options options)
    : options_(std::move(options)),
      account_(std::make_shared<MemoryAccount>(options_.limit_bytes, options_.huge_pages,
                                               ShmemThpHonoured(ReadHostPages().shmem_thp),
                                               options_.keep_writable_mappings)),
      disposer_(options_.dispose_min_bytes) {
  // A reservation short of budget first waits for the drops the disposer
  // still holds (rank 0), then takes the warm reserve back (the pool's own
  // reclaimer, rank 10). What counts is what the account got back, not the
  // disposer's estimate (a buffer it was handed may have been picked up
  // again meanwhile).
  disposer_reclaimer_ = account_->AddReclaimer(MemoryAccount::kRankDisposer, [this](uint64_t) {
    const uint64_t before = account_->used();
    disposer_.Drain();
    const uint64_t after = account_->used();
    return before > after ? before - after : 0;
  });
  if (options_.warm_reserve_bytes != 0) {
    pool_ = std::make_unique<SegmentPool>(SegmentPool::Options{
        account_, options_.warm_reserve_bytes, options_.reserve_chunk_bytes});
  }
}

HostMemoryManager::~HostMemoryManager() {
  pool_.reset();  // removes its reclaimer, frees its chunks and graveyard
  account_->RemoveReclaimer(disposer_reclaimer_);
}

absl::StatusOr<std::unique_ptr<Segment>> HostMemoryManager::Allocate(
    uint64_t size, const AllocateOptions& options) {
  if (options.warm && pool_ != nullptr && size <= pool_->chunk_bytes()) {
    if (std::unique_ptr<Segment> seg = pool_->Take()) {
      WD_RETURN_IF_ERROR(seg->Truncate(size));
      return seg;
    }
  }
  return Segment::Create(account_, options.purpose, size, options.prefault || options.warm,
                         options.reclaim);
}

absl::StatusOr<std::unique_ptr<Segment>> HostMemoryManager::Adopt(UniqueFd fd, PageKind pages,
                                                                  absl::string_view purpose) {
  return Segment::Adopt(account_, purpose, std::move(fd), pages);
}

absl::StatusOr<std::unique_ptr<MemoryCharge>> HostMemoryManager::Charge(uint64_t bytes,
                                                                        absl::string_view what) {
  return MemoryCharge::Reserve(account_, bytes, what);
}

void HostMemoryManager::Retire(SegmentPtr segment, bool now) {
  if (now) {
    segment.reset();
  } else if (pool_ != nullptr) {
    pool_->Dispose(std::move(segment));
  } else {
    const uint64_t bytes = segment->size();
    disposer_.Dispose(std::move(segment), bytes);
  }
}

HostMemoryManager::WorkScope::WorkScope(HostMemoryManager* memory) : pool_(memory->pool_.get()) {
  if (pool_ != nullptr) pool_->BeginWork();
}

HostMemoryManager::WorkScope::~WorkScope() {
  if (pool_ != nullptr) pool_->EndWork();
}

uint64_t HostMemoryManager::AddReclaimer(int rank, std::function<uint64_t(uint64_t)> fn) {
  return account_->AddReclaimer(rank, std::move(fn));
}

void HostMemoryManager::RemoveReclaimer(uint64_t id) { account_->RemoveReclaimer(id); }

uint64_t HostMemoryManager::reserve_chunk_bytes() const {
  return pool_ != nullptr ? pool_->chunk_bytes() : 0;
}

bool HostMemoryManager::WaitReserveFull(absl::Duration timeout) {
  return pool_ == nullptr || pool_->WaitFull(timeout);
}

HostMemoryStats HostMemoryManager::stats() const {
  HostMemoryStats s;
  s.limit_bytes = account_->limit();
  s.used_bytes = account_->used();
  s.segments = account_->segments();
  if (pool_ != nullptr) s.reserve = pool_->stats();
  s.huge_pages = account_->huge_pages();
  for (int k = 0; k < kPageKinds; ++k) s.page_bytes[k] = account_->page_bytes(PageKind(k));
  s.page_fallbacks = account_->page_fallbacks();
  s.host = ReadHostPages();
  return s;
}

}  // namespace weightd
