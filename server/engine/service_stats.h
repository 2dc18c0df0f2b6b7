// ServiceStats: one snapshot of the daemon's counters, aggregated by
// WeightService::Stats() from its parts' own stats (LoadStats of
// ModelService, FetchStats of FetchService, the memory manager's, the
// materializer's, the publish service's); and ServiceStatsSource, what the
// metrics exporter and the gRPC Stats call read it through.
//
// Plain values; copied freely. A source is thread-safe.
#ifndef WEIGHTD_SERVER_ENGINE_SERVICE_STATS_H_
#define WEIGHTD_SERVER_ENGINE_SERVICE_STATS_H_

#include <cstdint>
#include <map>
#include <string>

#include "server/gpu/gpu_devices.h"
#include "server/materialize/materializer.h"
#include "server/memory/host_memory.h"
#include "server/service/fetch_service.h"
#include "server/service/latency_histogram.h"
#include "server/service/model_service.h"
#include "server/source/source_client.h"

namespace weightd {

struct ServiceStats {
  uint64_t models = 0;
  uint64_t segments = 0;
  uint64_t bytes_resident = 0;
  // Checkpoint bytes summed over models, and held: a checkpoint that
  // several models share (ResidentCheckpoints) counts once.
  uint64_t checkpoint_bytes_logical = 0;
  uint64_t checkpoint_bytes_resident = 0;
  // Published bytes of the current generations summed over models, and the
  // segments that hold them beside the checkpoints', each counted once.
  uint64_t published_bytes_logical = 0;
  uint64_t published_bytes_resident = 0;
  uint64_t memory_limit = 0;
  SegmentPoolStats reserve;  // zeros without a reserve
  MaterializerStats materializer;
  uint64_t leases_open = 0;
  uint64_t bytes_served = 0;
  uint64_t bytes_read = 0;  // asked for by grpc-transport Reads
  uint64_t fetches = 0;
  uint64_t applies = 0;
  uint64_t adapters = 0;
  uint64_t loads = 0;
  uint64_t load_bytes = 0;
  double load_seconds = 0;
  uint64_t fetch_errors = 0;
  uint64_t pinned_bytes = 0;  // host memory registered with CUDA now
  HugePageMode huge_pages = HugePageMode::kOff;
  uint64_t page_bytes[kPageKinds] = {};  // live segments' bytes by PageKind
  uint64_t page_fallbacks = 0;
  HostPages host_pages;
  uint64_t pushes = 0;      // pushes into clients' memory answered OK
  uint64_t push_bytes = 0;  // the tensor bytes they wrote
  uint64_t publishes = 0;         // publish sessions committed
  uint64_t publish_bytes = 0;     // the bytes they received
  double publish_seconds = 0;     // from begin to visible, summed
  uint64_t publish_sessions = 0;  // open now (their staging memory is held)
  // Sessions begun on staging prepared ahead / allocated at begin; bytes
  // prepared and waiting now (WeightServiceOptions::publish_staging_ahead).
  uint64_t publish_staging_prepared = 0;
  uint64_t publish_staging_allocated = 0;
  uint64_t publish_staging_ahead_bytes = 0;
  LatencyHistogram::Snapshot fetch_latency_shm;
  LatencyHistogram::Snapshot fetch_latency_grpc;
  // Checkpoint bytes loads took from storage and from peers; per peer the
  // bytes received and the ranges it failed; bytes sent to loading peers.
  uint64_t load_bytes_storage = 0;
  uint64_t load_bytes_peers = 0;  // kept by the loads
  // Sent by peers and thrown away (wrong, fetched again, the load failed).
  uint64_t load_bytes_peers_discarded = 0;
  using PeerCounters = LoadStats::PeerCounters;
  std::map<std::string, PeerCounters> peer_transfers;
  uint64_t bytes_sent_to_peers = 0;
  // Remote sources (--model-source): bytes received, requests, retries,
  // failed operations (server/source/source_client.h).
  SourceCounters source;
};

// Where ServiceStats come from (WeightService). Thread-safe.
class ServiceStatsSource {
 public:
  virtual ~ServiceStatsSource() = default;
  // The counters now.
  virtual ServiceStats Stats() const = 0;
  // The GPUs found at start-up, or why none.
  virtual const GpuInventory& gpus() const = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ENGINE_SERVICE_STATS_H_
