#include "server/grpc/peer_table.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/digest.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

// One stub per peer address, made when first used and kept for the
// `capacity` most recently used addresses (an evicted one's connection
// closes once no call uses it: each channel has its own subchannels); the
// credentials and token presented; one receive budget over all of them.
// Thread-safe: the polling threads and loads share it.
class PeerTable::Channels {
 public:
  Channels(size_t capacity, uint64_t receive_budget)
      : capacity_(std::max<size_t>(1, capacity)), quota_("weightd-peers") {
    quota_.Resize(static_cast<size_t>(receive_budget));
    max_message_ = static_cast<int>(std::min<uint64_t>(receive_budget, INT32_MAX));
  }

  std::shared_ptr<grpc::ChannelCredentials> creds;
  std::string token;

  std::shared_ptr<v1::Models::Stub> StubFor(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto it = stubs_.find(address);
    if (it != stubs_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      return it->second.first;
    }
    grpc::ChannelArguments args;
    // A peer that went away is tried again at the next poll, not after
    // gRPC's reconnect backoff (up to 2 min).
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    // Its own subchannels: an evicted channel's connection closes with it.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // What a peer sends is buffered within the budget (gRPC checks a
    // message's size only once it has it all: the quota is what bounds
    // the memory); no message may be larger than all of it.
    args.SetResourceQuota(quota_);
    args.SetMaxReceiveMessageSize(max_message_);
    auto stub = std::shared_ptr<v1::Models::Stub>(
        v1::Models::NewStub(grpc::CreateCustomChannel(address, creds, args)));
    lru_.push_front(address);
    stubs_[address] = {stub, lru_.begin()};
    while (stubs_.size() > capacity_) {
      stubs_.erase(lru_.back());
      lru_.pop_back();
    }
    return stub;
  }
  // Forgets the stubs of addresses not in `keep` (loads using one keep it).
  void KeepOnly(const std::vector<std::string>& keep) {
    absl::MutexLock lock(&mu_);
    for (auto it = stubs_.begin(); it != stubs_.end();) {
      auto cur = it++;
      if (std::find(keep.begin(), keep.end(), cur->first) == keep.end()) {
        lru_.erase(cur->second.second);
        stubs_.erase(cur);
      }
    }
  }
  void Authorize(grpc::ClientContext& ctx) const {
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  }

 private:
  const size_t capacity_;
  grpc::ResourceQuota quota_;
  int max_message_ = 0;
  absl::Mutex mu_;
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::map<std::string,
           std::pair<std::shared_ptr<v1::Models::Stub>, std::list<std::string>::iterator>>
      stubs_ ABSL_GUARDED_BY(mu_);
};

namespace {

absl::Status CheckHostPort(const std::string& address, absl::string_view flag) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port) || port == 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": expected HOST:PORT, got \"", address, "\""));
  }
  return absl::OkStatus();
}

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

// Whether the answer's initial metadata names `instance_id` (the caller).
bool AnsweredBy(const grpc::ClientContext& ctx, const std::string& instance_id) {
  const auto& md = ctx.GetServerInitialMetadata();
  auto it = md.find(kInstanceMetadata);
  return it != md.end() && absl::string_view(it->second.data(), it->second.size()) == instance_id;
}

std::string RandomInstanceId() {
  std::random_device rd;
  std::string raw(16, '\0');
  for (char& c : raw) c = static_cast<char>(rd());
  return absl::BytesToHexString(raw);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerTable>> PeerTable::Start(PeerOptions options) {
  options.max_peers = std::max<size_t>(1, options.max_peers);
  options.call_threads = std::max(1, options.call_threads);
  auto channels = std::make_unique<Channels>(options.max_peers, options.receive_budget_bytes);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    WD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileToString(options.tls_ca_file, 1 << 20));
    if (!options.tls_cert_file.empty()) {
      WD_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileToString(options.tls_cert_file, 1 << 20));
      WD_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileToString(options.tls_key_file, 1 << 20));
    }
    creds = grpc::SslCredentials(ssl);
  }
  if (!options.token_file.empty()) {
    WD_ASSIGN_OR_RETURN(channels->token, ReadTokenFile(options.token_file, "--peer-token-file"));
  }
  channels->creds = std::move(creds);
  for (const std::string& address : options.addresses) {
    WD_RETURN_IF_ERROR(CheckHostPort(address, "--peers"));
  }
  if (!options.dns.empty()) WD_RETURN_IF_ERROR(CheckHostPort(options.dns, "--peer-dns"));
  auto table = std::unique_ptr<PeerTable>(
      new PeerTable(std::move(options), std::move(channels), RandomInstanceId()));
  table->thread_ = std::thread([t = table.get()] { t->Run(); });
  return table;
}

PeerTable::PeerTable(PeerOptions options, std::unique_ptr<Channels> channels,
                     std::string instance_id)
    : options_(std::move(options)),
      channels_(std::move(channels)),
      instance_id_(std::move(instance_id)) {
  for (const std::string& address : options_.addresses) {
    if (peers_.size() == options_.max_peers) break;  // Targets() logs it
    PeerState p;
    p.address = address;
    p.error = "not polled yet";
    peers_.push_back(std::move(p));
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

std::vector<std::string> PeerTable::Targets() {
  std::vector<std::string> statics;
  for (const std::string& a : options_.addresses) {
    if (!IsSelf(a) && std::find(statics.begin(), statics.end(), a) == statics.end()) {
      statics.push_back(a);
    }
  }
  size_t total = statics.size();
  std::vector<std::string> targets = statics;
  if (targets.size() > options_.max_peers) targets.resize(options_.max_peers);
  absl::StatusOr<std::vector<std::string>> resolved = std::vector<std::string>();
  if (!options_.dns.empty()) resolved = Resolve(options_.dns);
  absl::MutexLock lock(&mu_);
  if (!resolved.ok()) {
    // The peers found before are kept (and polled) until DNS answers again.
    if (dns_error_.empty()) {
      LogEvent(LogLevel::kWarning, "peer_dns_failed",
               {{"peer_dns", options_.dns}, {"error", resolved.status().ToString()}});
    }
    dns_error_ = resolved.status().ToString();
    for (const PeerState& p : peers_) {
      if (std::find(targets.begin(), targets.end(), p.address) == targets.end()) {
        targets.push_back(p.address);
      }
    }
    return targets;
  }
  if (!options_.dns.empty()) dns_error_.clear();
  std::vector<std::string> found;
  for (const std::string& a : *resolved) {
    if (a == options_.advertise || self_.count(a) > 0) continue;  // this daemon
    if (std::find(statics.begin(), statics.end(), a) == statics.end()) found.push_back(a);
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
  // The table follows: new addresses added, the ones DNS no longer gives
  // (and no flag names) dropped.
  std::vector<PeerState> next;
  for (const std::string& a : targets) {
    auto it = std::find_if(peers_.begin(), peers_.end(),
                           [&](const PeerState& p) { return p.address == a; });
    if (it != peers_.end()) {
      next.push_back(std::move(*it));
    } else {
      PeerState p;
      p.address = a;
      p.error = "not polled yet";
      next.push_back(std::move(p));
      if (!options_.dns.empty()) {
        LogEvent(LogLevel::kInfo, "peer_found", {{"peer", a}, {"peer_dns", options_.dns}});
      }
    }
  }
  for (const PeerState& p : peers_) {
    if (std::find(targets.begin(), targets.end(), p.address) == targets.end() &&
        !p.address.empty() && !options_.dns.empty()) {
      LogEvent(LogLevel::kInfo, "peer_gone", {{"peer", p.address}, {"peer_dns", options_.dns}});
    }
  }
  peers_ = std::move(next);
  return targets;
}

void PeerTable::Poll(const std::string& address) {
  std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(address);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(options_.call_timeout));
  channels_->Authorize(ctx);
  v1::ListModelsResponse resp;
  grpc::Status s = stub->List(&ctx, v1::ListModelsRequest(), &resp);
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
  if (s.ok()) {
    p.reachable = true;
    p.error.clear();
    p.last_seen = now;
    p.models.clear();
    for (const v1::ModelInfo& m : resp.models()) {
      p.models.push_back({m.name(), m.generation(), m.weights_id()});
    }
  } else {
    p.reachable = false;
    p.error = absl::StrCat(
        absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
        s.error_message());
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

namespace {

std::string GrpcError(const grpc::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())),
                      ": ", s.error_message());
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace

std::vector<PeerHolding> PeerTable::FindHolders(const PeerQuery& query) {
  // Every peer: one whose last poll failed may be back (it is given a
  // short deadline, so that a peer down costs a load little).
  std::vector<std::string> ask;
  std::vector<absl::Duration> deadline;
  for (const PeerState& p : Snapshot()) {
    ask.push_back(p.address);
    deadline.push_back(p.reachable || p.polled == absl::InfinitePast()
                           ? options_.call_timeout
                           : std::min(options_.call_timeout, absl::Milliseconds(500)));
  }
  const std::string key_hex = query.key.Hex().substr(0, 12);
  // As many at once as the receive budget holds true answers twice over.
  const uint64_t bound = query.AnswerBound();
  const uint64_t fit = options_.receive_budget_bytes / (2 * bound);
  if (fit == 0) {
    LogEvent(LogLevel::kWarning, "peer_find_skipped",
             {{"key", key_hex},
              {"why", absl::StrCat("an answer for its ", bound, " bytes of digests would not fit "
                                   "the peer receive budget of ",
                                   options_.receive_budget_bytes, " bytes")},
              {"action", "not asked; read from storage"}});
    return {};
  }
  const int parallel = static_cast<int>(std::min<uint64_t>(fit, options_.call_threads));
  v1::FindCheckpointRequest req;
  req.set_key(std::string(query.key.View()));
  for (const CheckpointRange& r : query.samples) {
    v1::CheckpointRange* out = req.add_samples();
    out->set_file(r.file);
    out->set_offset(r.offset);
    out->set_length(r.length);
  }
  for (const Digest& d : query.sample_digests) req.add_sample_digests(std::string(d.View()));
  std::vector<std::optional<PeerHolding>> answers(ask.size());
  auto refuse = [&](const std::string& peer, const std::string& why) {
    LogEvent(LogLevel::kWarning, "peer_find_failed",
             {{"peer", peer}, {"key", key_hex}, {"error", why},
              {"action", "not asked for bytes"}});
  };
  auto ask_one = [&](size_t i) -> absl::Status {
    std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(ask[i]);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline[i]));
    channels_->Authorize(ctx);
    v1::FindCheckpointResponse resp;
    grpc::Status s = stub->FindCheckpoint(&ctx, req, &resp);
    if (AnsweredBy(ctx, instance_id_)) {
      MarkSelf(ask[i]);
      return absl::OkStatus();
    }
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) return absl::OkStatus();  // not a holder
    if (!s.ok()) {
      refuse(ask[i], absl::StrCat(GrpcError(s), " (a true answer takes at most ", bound,
                                  " bytes)"));
      return absl::OkStatus();
    }
    // Exactly the question's shape (this daemon's own headers say how many
    // tensors each file has), before anything is made of it.
    const size_t files = query.tensors_per_file.size();
    if (static_cast<size_t>(resp.tensor_digests_size()) != files) {
      refuse(ask[i], absl::StrCat("its answer has digests for ", resp.tensor_digests_size(),
                                  " files; the checkpoint has ", files));
      return absl::OkStatus();
    }
    for (size_t f = 0; f < files; ++f) {
      if (resp.tensor_digests(static_cast<int>(f)).size() != 16 * query.tensors_per_file[f]) {
        refuse(ask[i], absl::StrCat("its answer has ", resp.tensor_digests(static_cast<int>(f)).size(),
                                    " bytes of digests for file ", f, ", which has ",
                                    query.tensors_per_file[f], " tensors (16 bytes each)"));
        return absl::OkStatus();
      }
    }
    if (static_cast<size_t>(resp.sample_digests_size()) != query.samples.size() ||
        resp.copy().size() != 16 ||
        std::any_of(resp.sample_digests().begin(), resp.sample_digests().end(),
                    [](const std::string& d) { return d.size() != 16; })) {
      refuse(ask[i], absl::StrCat("its answer has ", resp.sample_digests_size(),
                                  " sample digests for ", query.samples.size(),
                                  " samples, or digests not of 16 bytes"));
      return absl::OkStatus();
    }
    PeerHolding h;
    h.peer = ask[i];
    h.copy = *DigestFromBytes(resp.copy());
    for (const std::string& file : resp.tensor_digests()) {
      std::vector<Digest> digests;
      digests.reserve(file.size() / 16);
      for (size_t at = 0; at < file.size(); at += 16) {
        digests.push_back(*DigestFromBytes(absl::string_view(file).substr(at, 16)));
      }
      h.tensor_digests.push_back(std::move(digests));
    }
    for (const std::string& d : resp.sample_digests()) {
      h.sample_digests.push_back(*DigestFromBytes(d));
    }
    answers[i] = std::move(h);
    return absl::OkStatus();
  };
  (void)ParallelFor(nullptr, ask.size(), parallel, ask_one);
  std::vector<PeerHolding> out;
  for (auto& a : answers) {
    if (a.has_value()) out.push_back(std::move(*a));
  }
  return out;
}

absl::Status PeerTable::ReadRange(const std::string& peer, const Digest& key,
                                  const Digest& copy, const CheckpointRange& range,
                                  uint8_t* dest) {
  std::shared_ptr<v1::Models::Stub> stub = channels_->StubFor(peer);
  grpc::ClientContext ctx;
  const absl::Duration deadline =
      2 * options_.call_timeout + absl::Seconds(static_cast<double>(range.length) / (32 << 20));
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  channels_->Authorize(ctx);
  v1::ReadCheckpointRequest req;
  req.set_key(std::string(key.View()));
  req.set_copy(std::string(copy.View()));
  req.mutable_range()->set_file(range.file);
  req.mutable_range()->set_offset(range.offset);
  req.mutable_range()->set_length(range.length);
  auto reader = stub->ReadCheckpoint(&ctx, req);
  v1::ReadChunk chunk;
  uint64_t pos = 0;
  absl::Status bad;
  while (reader->Read(&chunk)) {
    if (!bad.ok()) continue;
    if (chunk.offset() != pos || chunk.data().size() > range.length - pos) {
      bad = absl::DataLossError(absl::StrCat("peer ", peer, " sent bytes ", chunk.offset(), "+",
                                             chunk.data().size(), " of a range of ", range.length,
                                             " where ", pos, " was next"));
      ctx.TryCancel();
      continue;
    }
    std::memcpy(dest + pos, chunk.data().data(), chunk.data().size());
    pos += chunk.data().size();
  }
  grpc::Status s = reader->Finish();
  if (!bad.ok()) return bad;
  if (!s.ok()) return FromGrpc(s, absl::StrCat("reading from peer ", peer));
  if (pos != range.length) {
    return absl::DataLossError(absl::StrCat("peer ", peer, " sent ", pos, " of ", range.length,
                                            " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace weightd
