// A fixed-bucket latency histogram, lock-free to record into, for the
// Prometheus exporter (which turns a Snapshot into a histogram family).
#ifndef WEIGHTD_SERVER_SERVICE_LATENCY_HISTOGRAM_H_
#define WEIGHTD_SERVER_SERVICE_LATENCY_HISTOGRAM_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

namespace weightd {

class LatencyHistogram {
 public:
  // Upper bounds in seconds; an implicit +Inf bucket follows.
  static constexpr std::array<double, 14> kBounds = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

  void Record(double seconds) {
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    // Sum in nanoseconds keeps the accumulation integral and lock-free.
    sum_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  }

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (= count)
    uint64_t count = 0;
    double sum_seconds = 0;
  };
  Snapshot Take() const {
    Snapshot s;
    uint64_t running = 0;
    for (const auto& c : counts_) {
      running += c.load(std::memory_order_relaxed);
      s.cumulative.push_back(running);
    }
    s.count = running;
    s.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> counts_{};
  std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_LATENCY_HISTOGRAM_H_
