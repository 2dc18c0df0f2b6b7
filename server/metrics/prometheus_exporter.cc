#include "server/metrics/prometheus_exporter.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/fd.h"
#include "server/base/log.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

using Families = std::vector<prometheus::MetricFamily>;
using prometheus::MetricType;

prometheus::MetricFamily Family(const std::string& name, const std::string& help, MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

// One series of a counter or gauge family `f`, labelled `label`=`label_value`
// (no label when `label` is empty).
void AddSeries(prometheus::MetricFamily& f, const std::string& label,
               const std::string& label_value, double value) {
  prometheus::ClientMetric m;
  if (!label.empty()) m.label.push_back({label, label_value});
  if (f.type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
}

prometheus::MetricFamily Scalar(const std::string& name, const std::string& help, MetricType type,
                                double value) {
  prometheus::MetricFamily f = Family(name, help, type);
  AddSeries(f, "", "", value);
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

// What is served: models, adapters and the stacks applied.
void CollectCatalog(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_models", "Models loaded.", MetricType::Gauge, s.models));
  out.push_back(Scalar("weightd_adapters", "Adapters loaded.", MetricType::Gauge, s.adapters));
  out.push_back(Scalar("weightd_adapter_applies_total",
                       "Adapter stacks applied (generations made).", MetricType::Counter,
                       s.applies));
}

// The memory the daemon holds, and its budget.
void CollectMemory(const ServiceStats& s, Families& out) {
  out.push_back(
      Scalar("weightd_segments", "Sealed memory segments held.", MetricType::Gauge, s.segments));
  out.push_back(
      Scalar("weightd_resident_bytes",
             "Bytes the daemon holds in segments (checkpoints, shards, live leases, host "
             "exports): what --host-memory-bytes bounds. Segments clients still map after "
             "their leases ended are not counted.",
             MetricType::Gauge, s.bytes_resident));
  out.push_back(Scalar("weightd_checkpoint_logical_bytes",
                       "Checkpoint bytes summed over the models that serve them.",
                       MetricType::Gauge, s.checkpoint_bytes_logical));
  out.push_back(Scalar("weightd_checkpoint_resident_bytes",
                       "Checkpoint bytes held: models loaded from the same files share one copy.",
                       MetricType::Gauge, s.checkpoint_bytes_resident));
  out.push_back(Scalar("weightd_published_logical_bytes",
                       "Published bytes of the models' current generations, summed over the "
                       "models.",
                       MetricType::Gauge, s.published_bytes_logical));
  out.push_back(Scalar("weightd_published_resident_bytes",
                       "Segments holding published bytes beside the checkpoints' (bytes shared "
                       "between models count once).",
                       MetricType::Gauge, s.published_bytes_resident));
  out.push_back(Scalar("weightd_reserve_ready_bytes",
                       "Pre-faulted output bytes ready (--warm-reserve-bytes).", MetricType::Gauge,
                       s.reserve.ready_bytes));
  out.push_back(Scalar("weightd_reserve_misses_total",
                       "Output segments made fresh: the reserve was empty.", MetricType::Counter,
                       s.reserve.missed));
  out.push_back(Scalar("weightd_memory_limit_bytes", "The --host-memory-bytes budget (0 = none).",
                       MetricType::Gauge, s.memory_limit));
  out.push_back(Scalar("weightd_pinned_bytes",
                       "Host memory registered with CUDA (--pin-host-memory).", MetricType::Gauge,
                       s.pinned_bytes));
}

// The pages behind the segments (--huge-pages).
void CollectPages(const ServiceStats& s, Families& out) {
  prometheus::MetricFamily pages =
      Family("weightd_segment_bytes",
             "Live segments' bytes by the pages behind them (--huge-pages): 4k, thp (shmem advised "
             "MADV_HUGEPAGE), 2m_hugetlb.",
             MetricType::Gauge);
  for (int k = 0; k < kPageKinds; ++k) {
    AddSeries(pages, "pages", PageKindName(PageKind(k)), static_cast<double>(s.page_bytes[k]));
  }
  out.push_back(std::move(pages));
  out.push_back(Scalar("weightd_huge_page_fallbacks_total",
                       "Segments --huge-pages=auto wanted huge that got smaller pages.",
                       MetricType::Counter, s.page_fallbacks));
  out.push_back(Scalar("weightd_hugetlb_free_pages",
                       "Free 2 MiB pages in the host's hugetlb pool (less reserved).",
                       MetricType::Gauge, s.host_pages.hugetlb_free));
}

// The materialization cache (slices, casts and merges made once).
void CollectMaterializer(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_materialization_cache_entries", "Cached materializations.",
                       MetricType::Gauge, s.materializer.entries));
  out.push_back(Scalar("weightd_materialization_cache_bytes",
                       "Bytes of packed (non-view) materializations.", MetricType::Gauge,
                       s.materializer.packed_bytes));
  out.push_back(Scalar("weightd_materialization_cache_hits_total", "Materialization cache hits.",
                       MetricType::Counter, s.materializer.hits));
  out.push_back(Scalar("weightd_materialization_cache_misses_total",
                       "Materialization cache misses.", MetricType::Counter,
                       s.materializer.misses));
}

// Fetches, their leases and latency, and the grpc transport's reads.
void CollectFetches(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_leases_open", "Open leases.", MetricType::Gauge, s.leases_open));
  out.push_back(
      Scalar("weightd_fetches_total", "Successful fetches.", MetricType::Counter, s.fetches));
  out.push_back(
      Scalar("weightd_fetch_errors_total", "Failed fetches.", MetricType::Counter, s.fetch_errors));
  out.push_back(Scalar("weightd_served_bytes_total", "Bytes of shards handed to clients.",
                       MetricType::Counter, s.bytes_served));
  out.push_back(Scalar("weightd_read_bytes_total", "Bytes asked for by grpc-transport Read calls.",
                       MetricType::Counter, s.bytes_read));
  prometheus::MetricFamily latency =
      Family("weightd_fetch_duration_seconds", "Fetch call latency in the daemon, by transport.",
             MetricType::Histogram);
  latency.metric.push_back(HistogramMetric(s.fetch_latency_shm, "shm"));
  latency.metric.push_back(HistogramMetric(s.fetch_latency_grpc, "grpc"));
  out.push_back(std::move(latency));
}

// Pushes into clients' own memory.
void CollectPushes(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_pushes_total", "Pushes into clients' own memory answered OK.",
                       MetricType::Counter, s.pushes));
  out.push_back(Scalar("weightd_push_bytes_total",
                       "Tensor bytes written by pushes into clients' memory.", MetricType::Counter,
                       s.push_bytes));
}

// Publishes of new base weights and their staging.
void CollectPublishes(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_publishes_total", "Publishes of new base weights committed.",
                       MetricType::Counter, s.publishes));
  out.push_back(Scalar("weightd_publish_bytes_total", "Bytes received by committed publishes.",
                       MetricType::Counter, s.publish_bytes));
  out.push_back(Scalar("weightd_publish_seconds_total",
                       "Seconds from a publish's begin to its generation being visible, summed.",
                       MetricType::Counter, s.publish_seconds));
  out.push_back(Scalar("weightd_publish_sessions",
                       "Publish sessions open (their staging memory held).", MetricType::Gauge,
                       s.publish_sessions));
  out.push_back(
      Scalar("weightd_publish_staging_prepared_total",
             "Publish sessions begun on staging prepared after their model's previous publish.",
             MetricType::Counter, s.publish_staging_prepared));
  out.push_back(Scalar("weightd_publish_staging_allocated_total",
                       "Publish sessions that allocated their staging when they began.",
                       MetricType::Counter, s.publish_staging_allocated));
  out.push_back(Scalar("weightd_publish_staging_ahead_bytes",
                       "Staging prepared for models' next publishes, waiting "
                       "(--publish-staging-ahead).",
                       MetricType::Gauge, s.publish_staging_ahead_bytes));
}

// Checkpoint loads, where their bytes came from, and the remote sources
// (--model-source) they read.
void CollectLoads(const ServiceStats& s, Families& out) {
  out.push_back(Scalar("weightd_loads_total", "Checkpoints loaded.", MetricType::Counter, s.loads));
  out.push_back(Scalar("weightd_load_bytes_total", "Checkpoint bytes loaded.", MetricType::Counter,
                       s.load_bytes));
  out.push_back(Scalar("weightd_load_seconds_total",
                       "Seconds spent loading (bytes / seconds = throughput).", MetricType::Counter,
                       s.load_seconds));
  prometheus::MetricFamily sources =
      Family("weightd_load_source_bytes_total",
             "Checkpoint bytes loads took from storage and kept from peers.", MetricType::Counter);
  AddSeries(sources, "source", "storage", static_cast<double>(s.load_bytes_storage));
  AddSeries(sources, "source", "peers", static_cast<double>(s.load_bytes_peers));
  out.push_back(std::move(sources));
  out.push_back(Scalar("weightd_source_bytes_total",
                       "Bytes received from remote sources (--model-source).",
                       MetricType::Counter, s.source.bytes));
  out.push_back(Scalar("weightd_source_requests_total", "Requests sent to remote sources.",
                       MetricType::Counter, s.source.requests));
  out.push_back(Scalar("weightd_source_retries_total",
                       "Requests to remote sources retried after a failure.",
                       MetricType::Counter, s.source.retries));
  out.push_back(Scalar("weightd_source_failures_total",
                       "Remote source operations that failed after their retries.",
                       MetricType::Counter, s.source.failures));
}

// Checkpoint bytes exchanged with peers, by peer.
void CollectPeers(const ServiceStats& s, Families& out) {
  prometheus::MetricFamily received =
      Family("weightd_peer_received_bytes_total",
             "Checkpoint bytes loads received and kept from each peer.", MetricType::Counter);
  prometheus::MetricFamily failures =
      Family("weightd_peer_failures_total",
             "Peers dropped from a load: ranges failed (error, stall) or bytes wrong, by peer.",
             MetricType::Counter);
  for (const auto& [peer, c] : s.peer_transfers) {
    AddSeries(received, "peer", peer, static_cast<double>(c.bytes));
    AddSeries(failures, "peer", peer, static_cast<double>(c.failures));
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
}

// Checkpoint bytes read from each peer and the time the reads took, by
// transport (ucx, grpc): the fleet's checkpoint client counts them.
void CollectPeerTransports(const PeerCheckpointClient& peers, Families& out) {
  prometheus::MetricFamily bytes =
      Family("weightd_peer_bytes_total",
             "Checkpoint bytes read from each peer, by transport (ucx, grpc), kept or not.",
             MetricType::Counter);
  prometheus::MetricFamily seconds =
      Family("weightd_peer_read_seconds_total",
             "Seconds spent in reads from each peer, by transport (rate: bytes/seconds).",
             MetricType::Counter);
  for (const auto& [key, t] : peers.TransportStats()) {
    prometheus::ClientMetric b, sec;
    b.label = {{"peer", key.first}, {"transport", key.second}};
    b.counter.value = static_cast<double>(t.bytes);
    sec.label = b.label;
    sec.counter.value = t.seconds;
    bytes.metric.push_back(std::move(b));
    seconds.metric.push_back(std::move(sec));
  }
  out.push_back(std::move(bytes));
  out.push_back(std::move(seconds));
}

// The GPUs found at start-up.
void CollectGpus(const GpuInventory& gpus, Families& out) {
  out.push_back(Scalar("weightd_gpus", "GPUs the daemon found at start-up.", MetricType::Gauge,
                       gpus.devices.size()));
}

// The daemon's metrics, read from WeightService::Stats() when scraped: one
// collector per part of the daemon, each appending its families.
// Thread-safe (reads only; WeightService::Stats() is).
class StatsCollectable {
 public:
  StatsCollectable(const ServiceStatsSource* service, const PeerCheckpointClient* peers)
      : service_(service), peers_(peers) {}

  Families Collect() const {
    const ServiceStats s = service_->Stats();
    Families out;
    CollectCatalog(s, out);
    CollectMemory(s, out);
    CollectPages(s, out);
    CollectMaterializer(s, out);
    CollectFetches(s, out);
    CollectPushes(s, out);
    CollectPublishes(s, out);
    CollectLoads(s, out);
    CollectPeers(s, out);
    if (peers_ != nullptr) CollectPeerTransports(*peers_, out);
    CollectGpus(service_->gpus(), out);
    return out;
  }

 private:
  // Constant after construction (borrowed; outlives the server).
  const ServiceStatsSource* const service_;
  const PeerCheckpointClient* const peers_;  // null: no peers
};

}  // namespace

// The HTTP side: one thread polls the listening socket and every
// connection; a connection costs an fd, never a thread, so idle ones cannot
// keep a scrape waiting (civetweb, behind prometheus-cpp's Exposer, gave
// each connection a worker thread until its request came: a few hundred
// idle connections held them all).
class MetricsServer::Impl {
 public:
  Impl(MetricsServer::Options options, const ServiceStatsSource* service, UniqueFd listen,
       UniqueFd wake)
      : options_(std::move(options)),
        collectable_(service, options_.peers),
        listen_(std::move(listen)),
        wake_(std::move(wake)) {}
  ~Impl() {
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
    if (thread_.joinable()) thread_.join();
  }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

 private:
  struct Connection {
    UniqueFd fd;
    absl::Time accepted;
    absl::Time deadline;
    std::string in;
    std::string out;  // the response, once the request is complete
    size_t sent = 0;
    // Answered: what the client still sends is read and dropped until it
    // closes (closing with unread bytes would reset the connection, and the
    // client could lose the response).
    bool draining = false;
  };

  // The response to a complete request head.
  std::string Respond(absl::string_view head) {
    absl::string_view line = head.substr(0, head.find_first_of("\r\n"));
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    auto reply = [](absl::string_view status, absl::string_view type, absl::string_view body,
                    bool with_body, absl::string_view extra = "") {
      return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                          "\r\nContent-Length: ", body.size(), "\r\n", extra,
                          "Connection: close\r\n\r\n", with_body ? body : "");
    };
    constexpr absl::string_view kText = "text/plain; charset=utf-8";
    if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
      return reply("400 Bad Request", kText, "malformed request line\n", true);
    }
    const absl::string_view method = parts[0];
    const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
    const bool head_only = method == "HEAD";
    if (method != "GET" && !head_only) {
      return reply("405 Method Not Allowed", kText, "GET or HEAD /metrics\n", true,
                   "Allow: GET, HEAD\r\n");
    }
    if (path != "/metrics") return reply("404 Not Found", kText, "see /metrics\n", !head_only);
    const std::string body = prometheus::TextSerializer().Serialize(collectable_.Collect());
    return reply("200 OK", "text/plain; version=0.0.4; charset=utf-8", body, !head_only);
  }

  // Reads what the connection has; false: close it.
  bool Read(Connection& c) {
    char buf[4096];
    while (true) {
      ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK;
      if (n == 0) return false;  // closed (before its request was complete?)
      if (c.draining) continue;
      c.in.append(buf, static_cast<size_t>(n));
      size_t end = c.in.find("\r\n\r\n");
      if (end == std::string::npos) end = c.in.find("\n\n");
      if (end != std::string::npos) {
        c.out = Respond(absl::string_view(c.in).substr(0, end));
        c.in.clear();
        return true;
      }
      if (c.in.size() > options_.max_request_bytes) {
        c.out = absl::StrCat(
            "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n");
        c.in.clear();
        return true;
      }
    }
  }

  // Sends what the socket takes; false: broken, close it. All sent: the
  // connection drains.
  static bool Write(Connection& c) {
    while (c.sent < c.out.size()) {
      ssize_t n = ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK;
      c.sent += static_cast<size_t>(n);
    }
    c.draining = true;
    c.out.clear();
    return ::shutdown(c.fd.get(), SHUT_WR) == 0;
  }

  // Reading a request, or draining after the answer: may give way to a
  // new connection.
  static bool Idle(const Connection& c) { return c.out.empty(); }

  void Run() {
    std::map<uint64_t, Connection> conns;  // by accept order: the oldest first
    uint64_t next_id = 0;
    std::vector<pollfd> pfds;
    std::vector<uint64_t> ids;
    while (true) {
      const absl::Time now = absl::Now();
      for (auto it = conns.begin(); it != conns.end();) {
        it = now >= it->second.deadline ? conns.erase(it) : std::next(it);
      }
      absl::Time next = absl::InfiniteFuture();
      pfds.clear();
      ids.clear();
      pfds.push_back({wake_.get(), POLLIN, 0});
      // Out of fds, the listener sits out a moment instead of waking the
      // poll at once for a connection it cannot take.
      const bool accepting = now >= accept_resume_;
      pfds.push_back({listen_.get(), static_cast<short>(accepting ? POLLIN : 0), 0});
      if (!accepting) next = accept_resume_;
      for (auto& [id, c] : conns) {
        pfds.push_back({c.fd.get(), static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
        ids.push_back(id);
        next = std::min(next, c.deadline);
      }
      int timeout_ms = -1;
      if (next != absl::InfiniteFuture()) {
        timeout_ms = static_cast<int>(
            std::max<int64_t>(0, absl::ToInt64Milliseconds(next - now)) + 1);
      }
      int n = ::poll(pfds.data(), pfds.size(), timeout_ms);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        WD_LOG(ERROR) << "metrics poll: " << std::strerror(errno);
        return;
      }
      if (pfds[0].revents != 0) return;  // the destructor
      for (size_t i = 2; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        auto it = conns.find(ids[i - 2]);
        Connection& c = it->second;
        bool keep = c.out.empty() ? Read(c) : true;
        if (keep && !c.out.empty()) keep = Write(c);
        if (!keep) conns.erase(it);
      }
      if (pfds[1].revents & POLLIN) Accept(conns, next_id);
    }
  }

  void Accept(std::map<uint64_t, Connection>& conns, uint64_t& next_id) {
    while (true) {
      int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of fds or memory (accept4 says EMFILE with or without a
          // connection waiting): an idle connection that sent nothing for
          // a back-off gives its fd to the next one (a young one may have
          // a request unread); with none, try again later, not on the next
          // poll (a waiting connection keeps the socket readable).
          const absl::Time idle_since = absl::Now() - kAcceptBackoff;
          auto oldest = std::find_if(conns.begin(), conns.end(), [&](const auto& e) {
            return Idle(e.second) && e.second.accepted <= idle_since;
          });
          if (oldest != conns.end()) {
            conns.erase(oldest);
            continue;
          }
          if (!accept_starved_) {  // once per episode, not every back-off
            WD_LOG(WARNING) << "metrics accept: " << std::strerror(errno)
                            << "; accepting again every " << kAcceptBackoff;
          }
          accept_starved_ = true;
          accept_resume_ = absl::Now() + kAcceptBackoff;
        }
        return;  // EAGAIN
      }
      accept_starved_ = false;
      if (conns.size() >= options_.max_connections) {
        // Full: the oldest connection still waiting for its request (or
        // answered already) gives way, one being answered is left to
        // finish, so that a scraper always gets in however many idle
        // ones there are.
        auto oldest = std::find_if(conns.begin(), conns.end(),
                                   [](const auto& e) { return Idle(e.second); });
        if (oldest == conns.end()) {
          ::close(fd);
          continue;
        }
        conns.erase(oldest);
      }
      Connection c;
      c.fd.Reset(fd);
      c.accepted = absl::Now();
      c.deadline = c.accepted + options_.request_timeout;
      conns.emplace(next_id++, std::move(c));
    }
  }

  static constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(200);

  const MetricsServer::Options options_;
  StatsCollectable collectable_;
  // The server thread's own.
  absl::Time accept_resume_ = absl::InfinitePast();
  bool accept_starved_ = false;
  UniqueFd listen_;
  UniqueFd wake_;
  std::thread thread_;
};

namespace {

// A listening TCP socket on `address` (HOST:PORT, [IPv6]:PORT or :PORT).
absl::StatusOr<UniqueFd> ListenTcp(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen ", address, ": expected HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen ", address, ": ", ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(res, &::freeaddrinfo);
  int err = 0;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                         a->ai_protocol));
    if (!fd.valid()) {
      err = errno;
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd.get(), 128) == 0) {
      return fd;
    }
    err = errno;
  }
  return absl::UnavailableError(
      absl::StrCat("--metrics-listen ", address, ": ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, const ServiceStatsSource* service,
    const PeerCheckpointClient* peers) {
  return Start(Options{.address = address, .peers = peers}, service);
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(Options options,
                                                                    const ServiceStatsSource* service) {
  WD_ASSIGN_OR_RETURN(UniqueFd listen, ListenTcp(options.address));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(errno, "eventfd");
  auto impl = std::make_unique<Impl>(std::move(options), service, std::move(listen),
                                     std::move(wake));
  try {
    impl->Start();
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the metrics thread: ", e.what()));
  }
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;

}  // namespace weightd
