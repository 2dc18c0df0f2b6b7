// Cancellation of one long call (a load): set once by whoever ends it (an
// unload of the name, the client going away), read by the work between
// its steps and by the requests it has in flight (a source's transfer
// callback), which then end with status().
//
// Thread-safe: Cancel and the reads may race from any threads.
#ifndef WEIGHTD_COMMON_CANCEL_H_
#define WEIGHTD_COMMON_CANCEL_H_

#include <atomic>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

class Cancellation {
 public:
  Cancellation() = default;
  Cancellation(const Cancellation&) = delete;
  Cancellation& operator=(const Cancellation&) = delete;

  // The first call wins: its `why` ("unloaded", "the client went away") is
  // what status() says; later calls change nothing. Returns whether this
  // call was the first.
  bool Cancel(std::string why) {
    absl::MutexLock lock(&mu_);
    if (cancelled_.load(std::memory_order_relaxed)) return false;
    why_ = std::move(why);
    cancelled_.store(true, std::memory_order_release);
    return true;
  }
  // Cheap; for the hot paths (a transfer callback, between chunks).
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // OK until cancelled; then CANCELLED "cancelled: WHY".
  absl::Status status() const {
    if (!cancelled()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    return absl::CancelledError(absl::StrCat("cancelled: ", why_));
  }

 private:
  // Own synchronization: set under mu_, read without it.
  std::atomic<bool> cancelled_{false};
  mutable absl::Mutex mu_;
  std::string why_ ABSL_GUARDED_BY(mu_);
};

// status() of `c`, or OK for none.
inline absl::Status CancelledStatus(const Cancellation* c) {
  return c == nullptr ? absl::OkStatus() : c->status();
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_CANCEL_H_
