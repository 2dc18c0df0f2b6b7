// A sealed memfd segment: the host memory kind of Buffer (buffer.h), the
// unit of host memory the daemon holds and shares.
//
// Segments are created writable, filled by exactly one thread, then sealed
// and published as std::shared_ptr<const Segment>; from then on they are
// immutable and shared by checkpoints, cache entries and leases, and freed
// when the last holder lets go. Every live segment's bytes are counted in a
// MemoryAccount, which enforces the daemon's --host-memory-bytes budget.
#ifndef WEIGHTD_SERVER_MEMORY_SEGMENT_H_
#define WEIGHTD_SERVER_MEMORY_SEGMENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "common/fd.h"
#include "server/memory/buffer.h"
#include "server/memory/huge_pages.h"

namespace weightd {

// Bytes held by live segments, against an optional limit. Thread-safe.
class MemoryAccount {
 public:
  // limit 0 = unlimited. `huge_pages` and `shmem_thp` (whether the host's
  // shmem THP setting honours MADV_HUGEPAGE) choose the pages of the
  // segments charged here (huge_pages.h).
  // `keep_writable_mappings`: segments charged here keep the daemon's
  // mapping writable when sealed (Segment::Seal), for the host pinner
  // (server/gpu/host_pinner.h) to register where CUDA cannot register
  // read-only memory; the seals shut out every other writer all the same.
  explicit MemoryAccount(uint64_t limit, HugePageMode huge_pages = HugePageMode::kOff,
                         bool shmem_thp = false, bool keep_writable_mappings = false)
      : limit_(limit),
        huge_pages_(huge_pages),
        shmem_thp_(shmem_thp),
        keep_writable_mappings_(keep_writable_mappings) {}

  // Reserves `bytes` or fails with RESOURCE_EXHAUSTED naming `what`. When
  // the budget is short, the reclaimers are asked to free memory first, in
  // order of rank, until what they freed covers the shortfall; then the
  // reservation is retried.
  absl::Status Reserve(uint64_t bytes, absl::string_view what) ABSL_LOCKS_EXCLUDED(mu_);
  // As Reserve, without asking the reclaimer: for the reclaimable memory
  // itself.
  absl::Status ReserveNoReclaim(uint64_t bytes, absl::string_view what);
  void Return(uint64_t bytes);

  // fn(bytes_needed) frees what it can and returns the bytes freed; it
  // must not call Reserve(). Reclaimers run in ascending `rank` (ties in
  // the order added): the cheapest memory to give back first. Each owner
  // adds its own and removes it before it goes away; RemoveReclaimer waits
  // for calls of it in flight. Returns the id RemoveReclaimer takes.
  uint64_t AddReclaimer(int rank, std::function<uint64_t(uint64_t)> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the reclaimers of rank <= `max_rank` in rank order for `bytes`
  // (each asked for what is still missing) until they freed that much:
  // Reserve asks them all for what the budget is short of; a hugetlb pool
  // short of pages asks the cheap ones, the warm reserve and prepared
  // publish staging, for theirs. Returns the bytes they freed.
  uint64_t ReclaimUpTo(int max_rank, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveReclaimer(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Ranks of the daemon's reclaimers.
  static constexpr int kRankDisposer = 0;     // frees already waiting to happen
  static constexpr int kRankWarmReserve = 10;  // pre-faulted chunks nobody uses
  static constexpr int kRankCache = 20;        // cached results nobody holds (rebuilt on demand)

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }
  uint64_t segments() const { return segments_.load(std::memory_order_relaxed); }
  HugePageMode huge_pages() const { return huge_pages_; }
  bool shmem_thp() const { return shmem_thp_; }
  bool keep_writable_mappings() const { return keep_writable_mappings_; }
  // Bytes of live segments by the pages behind them.
  uint64_t page_bytes(PageKind kind) const {
    return page_bytes_[static_cast<int>(kind)].load(std::memory_order_relaxed);
  }
  // Segments --huge-pages=auto wanted huge that got a smaller kind (the
  // hugetlb pool was short, or hugetlb failed).
  uint64_t page_fallbacks() const { return page_fallbacks_.load(std::memory_order_relaxed); }

 private:
  friend class Segment;
  struct Reclaimer {
    uint64_t id;
    int rank;
    std::function<uint64_t(uint64_t)> fn;
  };
  void AddPages(PageKind kind, uint64_t bytes) {
    page_bytes_[static_cast<int>(kind)].fetch_add(bytes, std::memory_order_relaxed);
  }
  void SubPages(PageKind kind, uint64_t bytes) {
    page_bytes_[static_cast<int>(kind)].fetch_sub(bytes, std::memory_order_relaxed);
  }

  const uint64_t limit_;
  const HugePageMode huge_pages_;
  const bool shmem_thp_;
  const bool keep_writable_mappings_;
  std::atomic<uint64_t> page_bytes_[kPageKinds] = {};
  std::atomic<uint64_t> page_fallbacks_{0};
  absl::Mutex mu_;
  // Replaced, never modified: a Reserve calls a snapshot without the lock.
  std::shared_ptr<const std::vector<Reclaimer>> reclaimers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_reclaimer_id_ ABSL_GUARDED_BY(mu_) = 1;
  int calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> segments_{0};
};

// Bytes of a MemoryAccount held for as long as the charge lives: memory the
// daemon holds outside segments (tensor metadata, adapter factors) counts
// against the same budget. Move-only by unique_ptr.
class MemoryCharge {
 public:
  // Reserves `bytes` (asking the reclaimer when short) or fails with
  // RESOURCE_EXHAUSTED naming `what`.
  static absl::StatusOr<std::unique_ptr<MemoryCharge>> Reserve(
      std::shared_ptr<MemoryAccount> account, uint64_t bytes, absl::string_view what);
  ~MemoryCharge() { account_->Return(bytes_); }
  MemoryCharge(const MemoryCharge&) = delete;
  MemoryCharge& operator=(const MemoryCharge&) = delete;

  uint64_t bytes() const { return bytes_; }

 private:
  MemoryCharge(std::shared_ptr<MemoryAccount> account, uint64_t bytes)
      : account_(std::move(account)), bytes_(bytes) {}
  std::shared_ptr<MemoryAccount> account_;
  uint64_t bytes_;
};

class Segment final : public Buffer {
 public:
  // Creates a writable segment of `size` bytes charged to `account` (which
  // must outlive the segment). `purpose` names it in /proc
  // ("weightd:<purpose>") and in the budget's messages.
  // `reclaim` = false charges the account without asking its reclaimer.
  // The account's --huge-pages mode picks the pages (huge_pages.h); a huge
  // segment's size() is `size` rounded up to 2 MiB, and that is charged.
  static absl::StatusOr<std::unique_ptr<Segment>> Create(
      std::shared_ptr<MemoryAccount> account, absl::string_view purpose,
      uint64_t size, bool prefault, bool reclaim = true);

  // A sealed memfd made by another process (MemfdSegment::Adopt), charged
  // to `account` like a created one (its reclaimers run when short).
  static absl::StatusOr<std::unique_ptr<Segment>> Adopt(std::shared_ptr<MemoryAccount> account,
                                                        absl::string_view purpose, UniqueFd fd,
                                                        PageKind pages);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Seals the memfd (no writes, grow or shrink by anyone) and makes its
  // mapping read-only -- or keeps it writable where the account says so
  // (MemoryAccount::keep_writable_mappings; registrable_mapping());
  // `populate`: see MemfdSegment::Seal.
  absl::Status Seal(bool populate = true) {
    return memfd_.Seal(populate, account_->keep_writable_mappings());
  }
  // See MemfdSegment::SealExclusive: for a segment whose fd was handed out
  // writable. FAILED_PRECONDITION while another process maps it writable.
  absl::Status SealExclusive(bool populate = true) { return memfd_.SealExclusive(populate); }
  // See MemfdSegment::kept_mapping.
  bool kept_mapping() const { return memfd_.kept_mapping(); }

  // Shrinks an unsealed segment, returning the tail's bytes to the account
  // (huge segments keep whole 2 MiB pages).
  absl::Status Truncate(uint64_t new_size);

  // Runs `hook` when the segment is destroyed, before its mapping goes
  // (e.g. unregistering it from CUDA); hooks run last-added first.
  void AddReleaseHook(absl::AnyInvocable<void() &&> hook) const ABSL_LOCKS_EXCLUDED(hooks_mu_);

  // Pinning (server/gpu/host_pinner.h). The first caller gets true: the
  // segment is its to register, once, however many checkpoints, published
  // generations or dedupe holders share it.
  bool ClaimPinning() const { return !pin_claimed_.exchange(true); }
  // The daemon's mapping where the seal kept it writable
  // (MemoryAccount::keep_writable_mappings, Linux 5.10+), for a CUDA
  // registration that needs a writable mapping; nullptr where it is
  // read-only (adopted at a hand-over, sealed exclusively after a publisher
  // wrote it in place, older kernels, or not kept). Never written through:
  // the memfd is sealed.
  void* registrable_mapping() const { return memfd_.writable_mapping(); }

  // Buffer: host memory; the shareable fd is the sealed memfd.
  uint64_t id() const override { return id_; }
  uint64_t size() const override { return memfd_.size(); }
  MemoryLocation location() const override { return MemoryLocation{}; }
  PageKind pages() const { return memfd_.pages(); }
  const uint8_t* host_data() const override { return memfd_.data(); }
  absl::StatusOr<int> ShareableFd() const override;

  int fd() const { return memfd_.fd(); }
  bool sealed() const { return memfd_.sealed(); }
  const uint8_t* data() const { return memfd_.data(); }
  // REQUIRES: !sealed().
  uint8_t* mutable_data() { return memfd_.mutable_data(); }

 private:
  Segment(std::shared_ptr<MemoryAccount> account, MemfdSegment memfd);
  static void NoteHugePageFallback(MemoryAccount& account, absl::string_view purpose,
                                   const absl::Status& why, PageKind got);

  std::shared_ptr<MemoryAccount> account_;
  MemfdSegment memfd_;
  uint64_t id_;
  mutable std::atomic<bool> pin_claimed_{false};
  mutable absl::Mutex hooks_mu_;
  mutable std::vector<absl::AnyInvocable<void() &&>> release_hooks_ ABSL_GUARDED_BY(hooks_mu_);
};

using SegmentPtr = std::shared_ptr<const Segment>;

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_SEGMENT_H_
