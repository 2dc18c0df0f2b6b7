// Frees large segments off the request path.
//
// Giving a gigabyte of shared memory back to the kernel takes ~0.1 s here.
// When a Release (or a closing data connection, or an expiring lease)
// drops the last hold on a checkpoint that was unloaded while leased, that
// cost would land on the gRPC callback thread that runs the Release, and
// every call queued behind it on that thread would wait. Instead the holder
// is handed to this disposer's thread, which drops it at once. Small drops are cheaper than the hand-off and happen on
// the caller's thread.
//
// The memory stays charged to the budget until the thread frees it; a
// reservation that finds the budget short calls Drain() (through the
// account's reclaimer), which frees everything queued before it returns.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MEMORY_DISPOSER_H_
#define WEIGHTD_SERVER_MEMORY_DISPOSER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace weightd {

class Disposer {
 public:
  // Drops that would free fewer than `min_bytes` are not handed off.
  explicit Disposer(uint64_t min_bytes = uint64_t{16} << 20);
  ~Disposer();  // frees what is still queued
  Disposer(const Disposer&) = delete;
  Disposer& operator=(const Disposer&) = delete;

  // Takes `holder` (anything holding segments), whose drop would free
  // `bytes`. Under min_bytes() it is dropped here and now; otherwise the
  // disposer's thread drops it.
  void Dispose(std::shared_ptr<const void> holder, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees everything queued, and waits for the drop in progress, before it
  // returns; returns the bytes those drops freed.
  uint64_t Drain() ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t min_bytes() const { return min_bytes_; }
  uint64_t pending_bytes() const ABSL_LOCKS_EXCLUDED(mu_);  // queued or being freed
  uint64_t disposed() const ABSL_LOCKS_EXCLUDED(mu_);       // holders handed off so far

 private:
  using Item = std::pair<std::shared_ptr<const void>, uint64_t>;
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t min_bytes_;
  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t busy_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // the drop in progress
  uint64_t disposed_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_DISPOSER_H_
