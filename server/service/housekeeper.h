// Housekeeper: runs the service's periodic jobs (lease expiry, generation
// pruning, publish expiry, staging reclaim, the materializer's sweep) on
// one thread of its own, each in the order registered, once per period.
//
// Thread-safe: Start once, Stop from any thread (idempotent; the
// destructor calls it). The jobs run on its thread with no lock of its own
// held; what they lock is theirs.
//
// Owns: the thread and the job list.
#ifndef WEIGHTD_SERVER_SERVICE_HOUSEKEEPER_H_
#define WEIGHTD_SERVER_SERVICE_HOUSEKEEPER_H_

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace weightd {

class Housekeeper {
 public:
  struct Job {
    std::string name;  // for readers of the code and of stack traces
    std::function<void()> run;
  };
  explicit Housekeeper(absl::Duration period = absl::Seconds(1));
  ~Housekeeper();
  Housekeeper(const Housekeeper&) = delete;
  Housekeeper& operator=(const Housekeeper&) = delete;

  // Starts the thread: every `period` (the first after one period), each
  // of `jobs` in order. REQUIRES: called once.
  void Start(std::vector<Job> jobs);
  // Stops the thread; a round in progress finishes first.
  void Stop();

 private:
  void Loop();

  // Constant after construction.
  const absl::Duration period_;

  // Own synchronization.
  std::vector<Job> jobs_;  // set before the thread starts, read only by it
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_HOUSEKEEPER_H_
