#include "server/metrics/prometheus_exporter.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <exception>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

prometheus::MetricFamily Scalar(const std::string& name, const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

prometheus::ClientMetric HistogramMetric(const LatencyHistogram::Snapshot& s,
                                         const std::string& transport) {
  prometheus::ClientMetric m;
  m.label.push_back({"transport", transport});
  m.histogram.sample_count = s.count;
  m.histogram.sample_sum = s.sum_seconds;
  for (size_t i = 0; i < LatencyHistogram::kBounds.size(); ++i) {
    m.histogram.bucket.push_back({s.cumulative[i], LatencyHistogram::kBounds[i]});
  }
  m.histogram.bucket.push_back({s.count, std::numeric_limits<double>::infinity()});
  return m;
}

class StatsCollectable : public prometheus::Collectable {
 public:
  explicit StatsCollectable(const WeightService* service) : service_(service) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    ServiceStats s = service_->Stats();
    std::vector<prometheus::MetricFamily> out = {
        Scalar("weightd_models", "Models loaded.", MetricType::Gauge, s.models),
        Scalar("weightd_adapters", "Adapters loaded.", MetricType::Gauge, s.adapters),
        Scalar("weightd_segments", "Sealed memory segments held.", MetricType::Gauge, s.segments),
        Scalar("weightd_resident_bytes",
               "Bytes the daemon holds in segments (checkpoints, shards, live leases): what "
               "--host-memory-bytes bounds. Segments clients still map after their leases "
               "ended are not counted.",
               MetricType::Gauge, s.bytes_resident),
        Scalar("weightd_checkpoint_logical_bytes",
               "Checkpoint bytes summed over the models that serve them.",
               MetricType::Gauge, s.checkpoint_bytes_logical),
        Scalar("weightd_checkpoint_resident_bytes",
               "Checkpoint bytes held: models loaded from the same files share one copy.",
               MetricType::Gauge, s.checkpoint_bytes_resident),
        Scalar("weightd_published_logical_bytes",
               "Published bytes of the models' current generations, summed over the models.",
               MetricType::Gauge, s.published_bytes_logical),
        Scalar("weightd_published_resident_bytes",
               "Segments holding published bytes beside the checkpoints' (bytes shared between "
               "models count once).",
               MetricType::Gauge, s.published_bytes_resident),
        Scalar("weightd_reserve_ready_bytes", "Pre-faulted output bytes ready (--warm-reserve-bytes).",
               MetricType::Gauge, s.reserve.ready_bytes),
        Scalar("weightd_reserve_misses_total", "Output segments made fresh: the reserve was empty.",
               MetricType::Counter, s.reserve.missed),
        Scalar("weightd_memory_limit_bytes", "The --host-memory-bytes budget (0 = none).",
               MetricType::Gauge, s.memory_limit),
        Scalar("weightd_materialization_cache_entries", "Cached materializations.",
               MetricType::Gauge, s.materializer.entries),
        Scalar("weightd_materialization_cache_bytes", "Bytes of packed (non-view) materializations.",
               MetricType::Gauge, s.materializer.packed_bytes),
        Scalar("weightd_materialization_cache_hits_total", "Materialization cache hits.",
               MetricType::Counter, s.materializer.hits),
        Scalar("weightd_materialization_cache_misses_total", "Materialization cache misses.",
               MetricType::Counter, s.materializer.misses),
        Scalar("weightd_leases_open", "Open leases.", MetricType::Gauge, s.leases_open),
        Scalar("weightd_fetches_total", "Successful fetches.", MetricType::Counter, s.fetches),
        Scalar("weightd_fetch_errors_total", "Failed fetches.", MetricType::Counter, s.fetch_errors),
        Scalar("weightd_served_bytes_total", "Bytes of shards handed to clients.",
               MetricType::Counter, s.bytes_served),
        Scalar("weightd_read_bytes_total", "Bytes asked for by grpc-transport Read calls.",
               MetricType::Counter, s.bytes_read),
        Scalar("weightd_pushes_total", "Pushes into clients' own memory answered OK.",
               MetricType::Counter, s.pushes),
        Scalar("weightd_push_bytes_total", "Tensor bytes written by pushes into clients' memory.",
               MetricType::Counter, s.push_bytes),
        Scalar("weightd_publishes_total", "Publishes of new base weights committed.",
               MetricType::Counter, s.publishes),
        Scalar("weightd_publish_bytes_total", "Bytes received by committed publishes.",
               MetricType::Counter, s.publish_bytes),
        Scalar("weightd_publish_seconds_total",
               "Seconds from a publish's begin to its generation being visible, summed.",
               MetricType::Counter, s.publish_seconds),
        Scalar("weightd_publish_sessions", "Publish sessions open (their staging memory held).",
               MetricType::Gauge, s.publish_sessions),
        Scalar("weightd_publish_staging_prepared_total",
               "Publish sessions begun on staging prepared after their model's previous publish.",
               MetricType::Counter, s.publish_staging_prepared),
        Scalar("weightd_publish_staging_allocated_total",
               "Publish sessions that allocated their staging when they began.",
               MetricType::Counter, s.publish_staging_allocated),
        Scalar("weightd_publish_staging_ahead_bytes",
               "Staging prepared for models' next publishes, waiting (--publish-staging-ahead).",
               MetricType::Gauge, s.publish_staging_ahead_bytes),
        Scalar("weightd_pinned_bytes", "Host memory registered with CUDA (--pin-host-memory).",
               MetricType::Gauge, s.pinned_bytes),
        Scalar("weightd_gpus", "GPUs the daemon found at start-up.", MetricType::Gauge,
               service_->gpus().devices.size()),
        Scalar("weightd_adapter_applies_total", "Adapter stacks applied (generations made).",
               MetricType::Counter, s.applies),
        Scalar("weightd_loads_total", "Checkpoints loaded.", MetricType::Counter, s.loads),
        Scalar("weightd_load_bytes_total", "Checkpoint bytes loaded.", MetricType::Counter,
               s.load_bytes),
        Scalar("weightd_load_seconds_total", "Seconds spent loading (bytes / seconds = throughput).",
               MetricType::Counter, s.load_seconds),
    };
    prometheus::MetricFamily latency;
    latency.name = "weightd_fetch_duration_seconds";
    latency.help = "Fetch call latency in the daemon, by transport.";
    latency.type = MetricType::Histogram;
    latency.metric.push_back(HistogramMetric(s.fetch_latency_shm, "shm"));
    latency.metric.push_back(HistogramMetric(s.fetch_latency_grpc, "grpc"));
    out.push_back(std::move(latency));
    prometheus::MetricFamily pages;
    pages.name = "weightd_segment_bytes";
    pages.help =
        "Live segments' bytes by the pages behind them (--huge-pages): 4k, thp (shmem advised "
        "MADV_HUGEPAGE), 2m_hugetlb.";
    pages.type = MetricType::Gauge;
    for (int k = 0; k < kPageKinds; ++k) {
      prometheus::ClientMetric m;
      m.label.push_back({"pages", PageKindName(PageKind(k))});
      m.gauge.value = static_cast<double>(s.page_bytes[k]);
      pages.metric.push_back(std::move(m));
    }
    out.push_back(std::move(pages));
    prometheus::MetricFamily sources;
    sources.name = "weightd_load_source_bytes_total";
    sources.help = "Checkpoint bytes loads took from storage and kept from peers.";
    sources.type = MetricType::Counter;
    for (const auto& [label, value] : {std::pair<const char*, uint64_t>{"storage", s.load_bytes_storage},
                                       {"peers", s.load_bytes_peers}}) {
      prometheus::ClientMetric m;
      m.label.push_back({"source", label});
      m.counter.value = static_cast<double>(value);
      sources.metric.push_back(std::move(m));
    }
    out.push_back(std::move(sources));
    prometheus::MetricFamily received, failures;
    received.name = "weightd_peer_received_bytes_total";
    received.help = "Checkpoint bytes loads received and kept from each peer.";
    received.type = MetricType::Counter;
    failures.name = "weightd_peer_failures_total";
    failures.help =
        "Peers dropped from a load: ranges failed (error, stall) or bytes wrong, by peer.";
    failures.type = MetricType::Counter;
    for (const auto& [peer, c] : s.peer_transfers) {
      prometheus::ClientMetric r, f;
      r.label.push_back({"peer", peer});
      r.counter.value = static_cast<double>(c.bytes);
      f.label.push_back({"peer", peer});
      f.counter.value = static_cast<double>(c.failures);
      received.metric.push_back(std::move(r));
      failures.metric.push_back(std::move(f));
    }
    out.push_back(std::move(received));
    out.push_back(std::move(failures));
    out.push_back(Scalar("weightd_peer_discarded_bytes_total",
                         "Checkpoint bytes peers sent that loads threw away (wrong, fetched "
                         "again elsewhere, or the load failed).",
                         MetricType::Counter, s.load_bytes_peers_discarded));
    out.push_back(Scalar("weightd_peer_sent_bytes_total",
                         "Checkpoint bytes this daemon sent to peers loading from it.",
                         MetricType::Counter, s.bytes_sent_to_peers));
    out.push_back(Scalar("weightd_huge_page_fallbacks_total",
                         "Segments --huge-pages=auto wanted huge that got smaller pages.",
                         MetricType::Counter, s.page_fallbacks));
    out.push_back(Scalar("weightd_hugetlb_free_pages",
                         "Free 2 MiB pages in the host's hugetlb pool (less reserved).",
                         MetricType::Gauge, s.host_pages.hugetlb_free));
    return out;
  }

 private:
  const WeightService* service_;
};

}  // namespace

class MetricsServer::Impl {
 public:
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<StatsCollectable> collectable;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    const WeightService* service) {
  auto impl = std::make_unique<Impl>();
  // prometheus-cpp (civetweb) reports a bind failure by throwing; this is
  // the one place an exception is caught, at the library boundary.
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen ", address, ": ", e.what()));
  }
  impl->collectable = std::make_shared<StatsCollectable>(service);
  impl->exposer->RegisterCollectable(impl->collectable);
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;

}  // namespace weightd
