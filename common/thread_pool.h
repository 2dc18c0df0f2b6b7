// Threads: a fixed pool running queued closures in FIFO order, and two ways
// to start threads that survive the system refusing one (a pids cgroup,
// systemd TasksMax, RLIMIT_NPROC): std::thread throws std::system_error then,
// which must never reach the top of a thread and abort the daemon.
#ifndef WEIGHTD_COMMON_THREAD_POOL_H_
#define WEIGHTD_COMMON_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

// Starts `fn` on a new detached thread. RESOURCE_EXHAUSTED (and `fn`
// destroyed, not run) when the system refuses a thread.
absl::Status StartDetachedThread(absl::AnyInvocable<void() &&> fn);

// Runs `worker` on `threads` threads at most, the caller's included, and
// returns when every one has returned. Threads the system refuses are done
// without: the caller always runs `worker` too, so `worker` must take work
// from a shared queue until there is none.
void RunOnThreads(int threads, const std::function<void()>& worker);

// Thread-safe. The destructor runs what is queued, then joins. The
// constructor throws std::system_error when the system refuses a thread
// (after joining those it started).
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Work();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_THREAD_POOL_H_
