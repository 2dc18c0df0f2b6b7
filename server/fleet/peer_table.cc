#include "server/fleet/peer_table.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/digest.h"
#include "common/grpc/status_convert.h"
#include "server/base/log.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

// Every address NAME of NAME:PORT resolves to, as IP:PORT ([IP]:PORT for
// IPv6), sorted; UNAVAILABLE when it does not resolve.
absl::StatusOr<std::vector<std::string>> Resolve(const std::string& name_port) {
  const size_t colon = name_port.rfind(':');
  const std::string name = name_port.substr(0, colon), port = name_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(name.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("--peer-dns: resolving ", name, ": ", ::gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char host[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, host,
                  sizeof(host));
      out.insert(absl::StrCat(host, ":", port));
    } else if (a->ai_family == AF_INET6) {
      ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, host,
                  sizeof(host));
      out.insert(absl::StrCat("[", host, "]:", port));
    }
  }
  ::freeaddrinfo(res);
  return std::vector<std::string>(out.begin(), out.end());
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

PeerState NotPolledYet(const std::string& address) {
  PeerState p;
  p.address = address;
  p.error = "not polled yet";
  return p;
}

}  // namespace

std::unique_ptr<PeerTable> PeerTable::Start(PeerOptions options, PeerChannels* channels,
                                            std::string instance_id) {
  auto table = std::unique_ptr<PeerTable>(
      new PeerTable(std::move(options), channels, std::move(instance_id)));
  table->thread_ = std::thread([t = table.get()] { t->Run(); });
  return table;
}

PeerTable::PeerTable(PeerOptions options, PeerChannels* channels, std::string instance_id)
    : options_(std::move(options)), channels_(channels), instance_id_(std::move(instance_id)) {
  for (const std::string& address : options_.addresses) {
    if (peers_.size() == options_.max_peers) break;  // Targets() logs it
    peers_.push_back(NotPolledYet(address));
  }
}

PeerTable::~PeerTable() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::vector<PeerState> PeerTable::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return peers_;
}

std::string PeerTable::dns_error() const {
  absl::MutexLock lock(&mu_);
  return dns_error_;
}

bool PeerTable::IsSelf(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  return self_.count(address) > 0;
}

void PeerTable::MarkSelf(const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (!self_.insert(address).second) return;
  peers_.erase(std::remove_if(peers_.begin(), peers_.end(),
                              [&](const PeerState& p) { return p.address == address; }),
               peers_.end());
  LogEvent(LogLevel::kInfo, "peer_is_self",
           {{"peer", address}, {"action", "left out of the peers: it is this daemon"}});
}

std::vector<std::string> PeerTable::Preferred(std::vector<std::string> addresses,
                                              size_t room) const {
  std::vector<std::pair<Digest, std::string>> scored;
  for (std::string& a : addresses) {
    const std::string seed = absl::StrCat(instance_id_, "|", a);
    scored.emplace_back(DigestBytes(seed.data(), seed.size()), std::move(a));
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < room; ++i) out.push_back(std::move(scored[i].second));
  return out;
}

std::vector<std::string> PeerTable::StaticTargets() const {
  std::vector<std::string> statics;
  for (const std::string& a : options_.addresses) {
    if (!IsSelf(a) && !Contains(statics, a)) statics.push_back(a);
  }
  return statics;
}

std::vector<std::string> PeerTable::Targets() {
  const std::vector<std::string> statics = StaticTargets();
  size_t total = statics.size();
  std::vector<std::string> targets = statics;
  if (targets.size() > options_.max_peers) targets.resize(options_.max_peers);
  absl::StatusOr<std::vector<std::string>> resolved = std::vector<std::string>();
  if (!options_.dns.empty()) resolved = Resolve(options_.dns);
  absl::MutexLock lock(&mu_);
  if (!resolved.ok()) {
    KeepPeersFoundBefore(resolved.status(), &targets);
    return targets;
  }
  if (!options_.dns.empty()) dns_error_.clear();
  std::vector<std::string> found;
  for (const std::string& a : *resolved) {
    if (a == options_.advertise || self_.count(a) > 0) continue;  // this daemon
    if (!Contains(statics, a)) found.push_back(a);
  }
  total += found.size();
  const size_t room = options_.max_peers - targets.size();
  for (std::string& a : Preferred(std::move(found), room)) targets.push_back(std::move(a));
  if (total > options_.max_peers && total != truncated_from_) {
    LogEvent(LogLevel::kWarning, "peer_list_truncated",
             {{"peers", absl::StrCat(total)}, {"kept", absl::StrCat(targets.size())},
              {"limit", "--peer-max"}});
  }
  truncated_from_ = total > options_.max_peers ? total : 0;
  Follow(targets);
  return targets;
}

void PeerTable::KeepPeersFoundBefore(const absl::Status& why, std::vector<std::string>* targets) {
  if (dns_error_.empty()) {
    LogEvent(LogLevel::kWarning, "peer_dns_failed",
             {{"peer_dns", options_.dns}, {"error", why.ToString()}});
  }
  dns_error_ = why.ToString();
  for (const PeerState& p : peers_) {
    if (!Contains(*targets, p.address)) targets->push_back(p.address);
  }
}

void PeerTable::Follow(const std::vector<std::string>& targets) {
  std::vector<PeerState> next;
  for (const std::string& a : targets) {
    auto it = std::find_if(peers_.begin(), peers_.end(),
                           [&](const PeerState& p) { return p.address == a; });
    if (it != peers_.end()) {
      next.push_back(std::move(*it));
      continue;
    }
    next.push_back(NotPolledYet(a));
    if (!options_.dns.empty()) {
      LogEvent(LogLevel::kInfo, "peer_found", {{"peer", a}, {"peer_dns", options_.dns}});
    }
  }
  for (const PeerState& p : peers_) {
    if (!Contains(targets, p.address) && !p.address.empty() && !options_.dns.empty()) {
      LogEvent(LogLevel::kInfo, "peer_gone", {{"peer", p.address}, {"peer_dns", options_.dns}});
    }
  }
  peers_ = std::move(next);
}

void PeerTable::Poll(const std::string& address) {
  std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(address);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(options_.call_timeout));
  v1::ListModelsResponse resp;
  const absl::Status s = FromGrpc(stub->List(&ctx, v1::ListModelsRequest(), &resp));
  if (AnsweredBy(ctx, instance_id_)) {
    MarkSelf(address);
    return;
  }
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto it = std::find_if(peers_.begin(), peers_.end(),
                         [&](const PeerState& p) { return p.address == address; });
  if (it == peers_.end()) return;
  PeerState& p = *it;
  const bool was = p.reachable;
  const bool first = p.polled == absl::InfinitePast();
  p.polled = now;
  p.reachable = s.ok();
  if (s.ok()) {
    p.error.clear();
    p.last_seen = now;
    p.models.clear();
    for (const v1::ModelInfo& m : resp.models()) {
      p.models.push_back({m.name(), m.generation(), m.weights_id()});
    }
  } else {
    p.error = absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
  }
  if (first || was != p.reachable) {
    LogEvent(p.reachable ? LogLevel::kInfo : LogLevel::kWarning,
             p.reachable ? "peer_reachable" : "peer_unreachable",
             {{"peer", p.address}, {"error", p.error}, {"models", absl::StrCat(p.models.size())}});
  }
}

void PeerTable::Run() {
  while (true) {
    const std::vector<std::string> targets = Targets();
    channels_->KeepOnly(targets);
    // call_threads polls at once; a stop ends the round early.
    (void)ParallelFor(nullptr, targets.size(), options_.call_threads, [&](size_t i) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return absl::CancelledError("stopping");
      }
      Poll(targets[i]);
      return absl::OkStatus();
    });
    absl::MutexLock lock(&mu_);
    auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (stop_ || mu_.AwaitWithTimeout(absl::Condition(&stopped), options_.poll_interval)) return;
  }
}

}  // namespace weightd
