#include "server/base/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace weightd {

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

namespace {

// What ParallelFor's caller and helpers share. Helpers hold it by
// shared_ptr: one that starts after the call returned touches only this.
struct ParallelForState {
  explicit ParallelForState(size_t n, const std::function<absl::Status(size_t)>* fn)
      : n(n), fn(fn) {}
  const size_t n;
  const std::function<absl::Status(size_t)>* const fn;  // valid while finished < n
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  size_t finished ABSL_GUARDED_BY(mu) = 0;
  absl::Status first ABSL_GUARDED_BY(mu);

  // Once every index has finished: the first error.
  absl::Status Wait() {
    absl::MutexLock lock(&mu);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return finished == n; };
    mu.Await(absl::Condition(&done));
    return first;
  }

  // Takes indices until none is left.
  void Work() {
    while (true) {
      const size_t i = next.fetch_add(1);
      if (i >= n) return;
      absl::Status s = failed.load(std::memory_order_relaxed) ? absl::OkStatus() : (*fn)(i);
      absl::MutexLock lock(&mu);
      if (!s.ok() && first.ok()) {
        first = std::move(s);
        failed = true;
      }
      ++finished;
    }
  }
};

}  // namespace

absl::Status ParallelFor(ThreadPool* pool, size_t n, int parallelism,
                         const std::function<absl::Status(size_t)>& fn) {
  if (n == 0) return absl::OkStatus();
  auto state = std::make_shared<ParallelForState>(n, &fn);
  const int helpers = std::max(0, std::min<int>(parallelism, static_cast<int>(n)) - 1);
  if (pool == nullptr) {
    RunOnThreads(helpers + 1, [&state] { state->Work(); });
  } else {
    for (int h = 0; h < std::min(helpers, pool->size()); ++h) {
      pool->Schedule([state] { state->Work(); });
    }
    state->Work();
  }
  return state->Wait();
}

absl::Status ParallelCopy(const std::vector<CopyRun>& runs, int parallelism) {
  std::vector<CopyRun> pieces;
  for (const CopyRun& r : runs) {
    for (uint64_t done = 0; done < r.length; done += kParallelCopyPiece) {
      pieces.push_back(CopyRun{r.to + done, r.from + done,
                               std::min(kParallelCopyPiece, r.length - done)});
    }
  }
  return ParallelFor(nullptr, pieces.size(), std::max(1, parallelism), [&](size_t i) {
    std::memcpy(pieces[i].to, pieces[i].from, pieces[i].length);
    return absl::OkStatus();
  });
}

ThreadPool::ThreadPool(int threads, bool best_effort) {
  // A constructor that throws runs no destructor: the threads started so
  // far are stopped here.
  auto stop_started = [this] {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
  };
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  } catch (const std::system_error&) {
    if (best_effort) return;  // the system refused a thread: fewer workers, same work
    stop_started();
    throw;
  } catch (...) {
    stop_started();
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

TaskThreads::~TaskThreads() { JoinAll(); }

absl::Status TaskThreads::Start(absl::AnyInvocable<void() &&> fn) {
  std::list<std::unique_ptr<Task>> finished;
  absl::Status started = absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = tasks_.begin(); it != tasks_.end();) {
      auto cur = it++;
      if ((*cur)->done.load(std::memory_order_acquire)) {
        finished.splice(finished.end(), tasks_, cur);
      }
    }
    auto task = std::make_unique<Task>();
    Task* t = task.get();
    try {
      t->thread = std::thread([t, fn = std::move(fn)]() mutable {
        std::move(fn)();
        t->done.store(true, std::memory_order_release);
      });
      tasks_.push_back(std::move(task));
    } catch (const std::system_error& e) {
      started = absl::ResourceExhaustedError(  // fn was destroyed with the lambda
          absl::StrCat("cannot start a thread (", e.what(),
                       "): the daemon is at its thread limit (pids cgroup, TasksMax, "
                       "RLIMIT_NPROC)"));
    }
  }
  // Joined without the lock: each has returned from its closure already.
  for (auto& t : finished) t->thread.join();
  return started;
}

void TaskThreads::JoinAll() {
  std::list<std::unique_ptr<Task>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(tasks_);
  }
  for (auto& t : all) t->thread.join();
}

size_t TaskThreads::size() const {
  absl::MutexLock lock(&mu_);
  return tasks_.size();
}

}  // namespace weightd
