#include "server/memory/disposer.h"

namespace weightd {

Disposer::Disposer(uint64_t min_bytes)
    : min_bytes_(min_bytes), thread_([this] { Loop(); }) {}

Disposer::~Disposer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  Drain();
}

void Disposer::Dispose(std::shared_ptr<const void> holder, uint64_t bytes) {
  if (holder == nullptr) return;
  if (bytes < min_bytes_) {
    holder.reset();  // cheap: here and now
    return;
  }
  absl::MutexLock lock(&mu_);
  queue_.emplace_back(std::move(holder), bytes);
  queued_bytes_ += bytes;
  ++disposed_;
}

uint64_t Disposer::Drain() {
  std::deque<Item> items;
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    items.swap(queue_);
    freed = queued_bytes_;
    queued_bytes_ = 0;
    // The thread's drop in progress counts too: wait for it.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return busy_bytes_ == 0; };
    freed += busy_bytes_;
    mu_.Await(absl::Condition(&idle));
  }
  items.clear();
  return freed;
}

uint64_t Disposer::pending_bytes() const {
  absl::MutexLock lock(&mu_);
  return queued_bytes_ + busy_bytes_;
}

uint64_t Disposer::disposed() const {
  absl::MutexLock lock(&mu_);
  return disposed_;
}

void Disposer::Loop() {
  // At normal priority: the work is what the releasing thread used to do
  // itself, and a reservation short of budget may be waiting for it (Drain);
  // at nice 19 on busy cores that wait could last seconds.
  while (true) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&wake));
      if (queue_.empty()) return;  // stopping; the destructor drains the rest
      item = std::move(queue_.front());
      queue_.pop_front();
      queued_bytes_ -= item.second;
      busy_bytes_ = item.second;
    }
    item.first.reset();  // the slow part: the pages go back to the kernel
    absl::MutexLock lock(&mu_);
    busy_bytes_ = 0;
  }
}

}  // namespace weightd
