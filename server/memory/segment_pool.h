// A warm reserve of pre-faulted, still-writable segments.
//
// A fresh segment costs a page fault (and the kernel's page clearing) per
// page on first write — on these machines ~0.3–1 GB/s, slower than any
// kernel that fills it. Work that must be fast after a request — merging an
// adapter into a new generation, materializing a cast — takes its output
// segments from this reserve instead; a background thread (at the lowest
// CPU priority) refills it up to its target in the idle time after loads
// and applies.
//
// The same thread also frees retired segments handed to Dispose(): giving
// a gigabyte of shared memory back to the kernel takes a good part of a
// second here, which an `apply` should not wait for. The thread works only
// when no materialization is running (BeginWork/EndWork) and has been quiet
// for a moment, so it never competes with a fetch for the cores.
//
// The reserve is charged to the daemon's MemoryAccount like any segment,
// but it is the first thing given back: the pool registers itself as the
// account's reclaimer, so a load or fetch that would exceed the budget
// drops reserve chunks before it evicts a cache entry or fails, and the
// filler never takes the budget's last chunk.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MEMORY_SEGMENT_POOL_H_
#define WEIGHTD_SERVER_MEMORY_SEGMENT_POOL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/memory/segment.h"

namespace weightd {

struct SegmentPoolStats {
  uint64_t target_bytes = 0;
  uint64_t ready_bytes = 0;   // pre-faulted bytes waiting in the reserve
  uint64_t chunk_bytes = 0;
  uint64_t taken = 0;         // chunks handed out
  uint64_t missed = 0;        // Take() calls that found the reserve empty
  uint64_t filled = 0;        // chunks made by the filler
  uint64_t reclaimed = 0;     // chunks dropped for the budget
  uint64_t disposing = 0;     // retired segments waiting to be freed
};

class SegmentPool {
 public:
  struct Options {
    std::shared_ptr<MemoryAccount> account;
    uint64_t target_bytes = 0;               // rounded down to whole chunks
    uint64_t chunk_bytes = uint64_t{256} << 20;
    // No refill for this long after the reserve gave memory back to the
    // budget, so that whoever needed it gets it.
    absl::Duration reclaim_holdoff = absl::Seconds(2);
    // Background work waits this long after the last EndWork().
    absl::Duration quiet = absl::Milliseconds(100);
  };

  // Registers the pool as `account`'s reclaimer and starts the background
  // thread.
  explicit SegmentPool(Options options);
  ~SegmentPool();
  SegmentPool(const SegmentPool&) = delete;
  SegmentPool& operator=(const SegmentPool&) = delete;

  // A writable, pre-faulted segment of chunk_bytes() (its memfd is named
  // "weightd:reserve"), or nullptr when the reserve is empty. The caller
  // may Truncate() it to the size it needs.
  std::unique_ptr<Segment> Take() ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the segments waiting for disposal, then drops reserve chunks
  // until at least `bytes` are freed (or none is left). Returns the bytes
  // freed.
  uint64_t Reclaim(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // Lets the background thread drop this reference (freeing the segment if
  // it is the last one) when the daemon is idle.
  void Dispose(SegmentPtr segment) ABSL_LOCKS_EXCLUDED(mu_);

  // Brackets foreground work (a materialization): background refills and
  // disposals pause meanwhile.
  void BeginWork() ABSL_LOCKS_EXCLUDED(mu_);
  void EndWork() ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until the reserve holds its target or `timeout` passes; true
  // when full. For tests, benchmarks and `weightctl stats --wait-reserve`.
  bool WaitFull(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t chunk_bytes() const { return options_.chunk_bytes; }
  SegmentPoolStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void FillLoop() ABSL_LOCKS_EXCLUDED(mu_);
  bool NeedsFill() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Segment>> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<SegmentPtr> graveyard_ ABSL_GUARDED_BY(mu_);
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time quiet_from_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  SegmentPoolStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Time holdoff_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool budget_short_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t reclaimer_id_ = 0;  // in options_.account's chain
  std::thread filler_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_SEGMENT_POOL_H_
