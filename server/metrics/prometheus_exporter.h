// Prometheus metrics for the daemon (weightd_ prefix, base units), served on
// --metrics-listen in prometheus-cpp's text format. Values are read from
// WeightService::Stats() at scrape time; nothing is recorded twice.
//
// The HTTP server is a small one of the daemon's own: GET or HEAD /metrics,
// one request per connection (Connection: close), all connections polled by
// one thread. A connection is closed when its request is not answered
// within Options::request_timeout of its accept; at Options::max_connections
// the oldest connection still waiting for its request is closed for a new
// one. So idle or slow clients cost an fd each, never a thread, and a scrape
// is answered however many of them are open.
#ifndef WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_
#define WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine/service_stats.h"
#include "server/fleet/peer_checkpoint_client.h"

namespace weightd {

class MetricsServer {
 public:
  struct Options {
    std::string address;  // HOST:PORT, [IPv6]:PORT, or :PORT (every address)
    size_t max_connections = 64;
    absl::Duration request_timeout = absl::Seconds(5);
    size_t max_request_bytes = 8192;  // past it: 431
    // The fleet's checkpoint client (null: no peers): bytes and time by
    // peer and transport (weightd_peer_bytes_total{peer,transport}).
    const PeerCheckpointClient* peers = nullptr;
  };

  // Starts an HTTP listener on `address` serving /metrics (UNAVAILABLE when
  // it cannot bind). `service` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, const ServiceStatsSource* service,
      const PeerCheckpointClient* peers = nullptr);
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(Options options,
                                                              const ServiceStatsSource* service);
  // Closes the listener and every connection.
  ~MetricsServer();

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_METRICS_PROMETHEUS_EXPORTER_H_
