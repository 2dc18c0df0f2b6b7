#include "server/service/housekeeper.h"

#include <utility>

namespace weightd {

Housekeeper::Housekeeper(absl::Duration period) : period_(period) {}

Housekeeper::~Housekeeper() { Stop(); }

void Housekeeper::Start(std::vector<Job> jobs) {
  jobs_ = std::move(jobs);
  thread_ = std::thread([this] { Loop(); });
}

void Housekeeper::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void Housekeeper::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    for (const Job& job : jobs_) job.run();
  }
}

}  // namespace weightd
