#include "server/base/accept_pause.h"

#include <unistd.h>

#include <cstdint>

namespace weightd {

void AcceptPause::Wake() const {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void AcceptPause::Pause() {
  absl::MutexLock lock(&mu_);
  if (paused_) return;
  paused_ = true;
  parked_ = false;
  Wake();
  auto parked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return parked_ || exited_; };
  mu_.Await(absl::Condition(&parked));
}

void AcceptPause::Resume() {
  absl::MutexLock lock(&mu_);
  if (!paused_) return;
  paused_ = false;
  Wake();
}

bool AcceptPause::AcceptAllowed() {
  absl::MutexLock lock(&mu_);
  parked_ = paused_;
  return !paused_;
}

void AcceptPause::Exited() {
  absl::MutexLock lock(&mu_);
  exited_ = true;
}

}  // namespace weightd
