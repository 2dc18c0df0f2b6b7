// Prometheus metrics for the daemon (weightd_ prefix, base units), served on
// --metrics-listen by prometheus-cpp. Values are read from
// WeightService::Stats() at scrape time; nothing is recorded twice.
#ifndef WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_
#define WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/service/weight_service.h"

namespace weightd {

class MetricsServer {
 public:
  // Starts an HTTP listener on `address` (HOST:PORT) serving /metrics.
  // `service` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              const WeightService* service);
  ~MetricsServer();

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_
