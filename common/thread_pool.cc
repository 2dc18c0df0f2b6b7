#include "common/thread_pool.h"

#include <system_error>

#include "absl/strings/str_cat.h"

namespace weightd {

absl::Status StartDetachedThread(absl::AnyInvocable<void() &&> fn) {
  try {
    std::thread([fn = std::move(fn)]() mutable { std::move(fn)(); }).detach();
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start a thread (", e.what(),
                     "): the daemon is at its thread limit (pids cgroup, TasksMax, "
                     "RLIMIT_NPROC)"));
  }
  return absl::OkStatus();
}

void RunOnThreads(int threads, const std::function<void()>& worker) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // at the thread limit: fewer helpers, same work
    }
  }
  worker();
  for (auto& t : pool) t.join();
}

ThreadPool::ThreadPool(int threads) {
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  } catch (...) {
    // The system refused a thread: stop the ones started (a destructor
    // never runs for a constructor that throws), then let the caller know.
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (auto& t : threads_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::Schedule(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(fn));
}

void ThreadPool::Work() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace weightd
