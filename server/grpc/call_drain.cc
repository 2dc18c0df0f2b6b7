#include "server/grpc/call_drain.h"

namespace weightd {

CallDrain::Hold& CallDrain::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Reset();
    drain_ = other.drain_;
    change_ = other.change_;
    other.drain_ = nullptr;
  }
  return *this;
}

void CallDrain::Hold::Reset() {
  if (drain_ != nullptr) drain_->Exit(change_);
  drain_ = nullptr;
}

absl::Status CallDrain::DrainingError() {
  return absl::UnavailableError("weightd is shutting down; retry against the restarted daemon");
}

absl::StatusOr<CallDrain::Hold> CallDrain::Enter(bool change) {
  absl::MutexLock lock(&mu_);
  if (draining_) return DrainingError();
  if (!closed_.ok()) return closed_;
  if (change && !changes_closed_.ok()) return changes_closed_;
  ++in_flight_;
  if (change) ++changes_in_flight_;
  return Hold(this, change);
}

absl::Status CallDrain::CheckOpen() const {
  absl::MutexLock lock(&mu_);
  return draining_ ? DrainingError() : closed_;
}

void CallDrain::SetClosed(absl::Status closed) {
  absl::MutexLock lock(&mu_);
  closed_ = std::move(closed);
}

void CallDrain::SetChangesClosed(absl::Status closed) {
  absl::MutexLock lock(&mu_);
  changes_closed_ = std::move(closed);
}

void CallDrain::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool CallDrain::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void CallDrain::Exit(bool change) {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  if (change) --changes_in_flight_;
}

int64_t CallDrain::WaitChangesIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return changes_in_flight_ == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  return changes_in_flight_;
}

int64_t CallDrain::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  return in_flight_;
}

int64_t CallDrain::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

}  // namespace weightd
