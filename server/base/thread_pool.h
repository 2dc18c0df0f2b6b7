// Threads: a fixed pool running queued closures in FIFO order, threads for
// long calls that their owner joins, and ways to run work on threads that
// survive the system refusing one (a pids cgroup, systemd TasksMax,
// RLIMIT_NPROC): std::thread throws std::system_error then, which must never
// reach the top of a thread and abort the daemon.
#ifndef WEIGHTD_SERVER_BASE_THREAD_POOL_H_
#define WEIGHTD_SERVER_BASE_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <functional>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

// Runs `worker` on `threads` threads at most, the caller's included, and
// returns when every one has returned. Threads the system refuses are done
// without: the caller always runs `worker` too, so `worker` must take work
// from a shared queue until there is none.
void RunOnThreads(int threads, const std::function<void()>& worker);

class ThreadPool;

// Runs fn(i) for every i in [0, n) on at most `parallelism` threads: the
// caller's, and helpers from `pool` (nullptr: threads started for this call,
// as RunOnThreads). Returns the first error; indices not yet started are
// skipped once one failed. The caller works too, so the call completes
// when the pool's workers are busy or absent, and it returns only when
// every index it handed out has finished: nothing runs on after it against
// the caller's frame. A helper that starts late finds nothing left and
// returns at once.
absl::Status ParallelFor(ThreadPool* pool, size_t n, int parallelism,
                         const std::function<absl::Status(size_t)>& fn);

// One copy of ParallelCopy: `length` bytes from `from` to `to`.
struct CopyRun {
  uint8_t* to = nullptr;
  const uint8_t* from = nullptr;
  uint64_t length = 0;
};
// Copies every run (they must not overlap) in pieces of at most
// kParallelCopyPiece bytes on at most `parallelism` threads (ParallelFor's,
// pool nullptr), so that one large run spreads too. Where the destination's
// pages are not yet faulted in, the copy faults them in on those threads.
inline constexpr uint64_t kParallelCopyPiece = 16ull << 20;
absl::Status ParallelCopy(const std::vector<CopyRun>& runs, int parallelism);

// Thread-safe. The destructor runs what is queued, then joins. The
// constructor throws std::system_error when the system refuses a thread
// (after joining those it started); with `best_effort` it keeps the threads
// it got instead, possibly none (see size()).
class ThreadPool {
 public:
  explicit ThreadPool(int threads, bool best_effort = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

  // Threads running.
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Work();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Threads for long calls (a load, a watch stream): each Start() runs its
// closure on a thread of its own, started at once (never queued behind
// another call's), and the owner gets them all back: no thread outlives
// JoinAll() or the destructor, so nothing runs on against a destroyed
// owner. Threads that have finished are joined by the next Start().
// Thread-safe.
class TaskThreads {
 public:
  TaskThreads() = default;
  ~TaskThreads();  // JoinAll()
  TaskThreads(const TaskThreads&) = delete;
  TaskThreads& operator=(const TaskThreads&) = delete;

  // RESOURCE_EXHAUSTED (and `fn` destroyed, not run) when the system
  // refuses a thread.
  absl::Status Start(absl::AnyInvocable<void() &&> fn) ABSL_LOCKS_EXCLUDED(mu_);

  // Returns once every closure started so far has returned. Not from one
  // of these threads.
  void JoinAll() ABSL_LOCKS_EXCLUDED(mu_);

  // Closures started and not yet joined.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Task {
    std::thread thread;
    std::atomic<bool> done{false};  // its closure has returned
  };
  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<Task>> tasks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_BASE_THREAD_POOL_H_
