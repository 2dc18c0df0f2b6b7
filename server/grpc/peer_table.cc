#include "server/grpc/peer_table.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

// One channel and stub per peer, and the token presented.
class PeerTable::Channels {
 public:
  std::vector<std::unique_ptr<v1::Models::Stub>> stubs;
  std::string token;
};

namespace {

absl::Status CheckHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port) || port == 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peers: expected HOST:PORT, got \"", address, "\""));
  }
  return absl::OkStatus();
}

// The token of a token file: its first non-blank, non-comment line's last
// word (a "NAME TOKEN" line of a daemon's --auth-token-file works too).
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  WD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, 1 << 20));
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> w =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    return std::string(w.back());
  }
  return absl::InvalidArgumentError(absl::StrCat("--peer-token-file ", path, ": no token"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerTable>> PeerTable::Start(PeerOptions options) {
  auto channels = std::make_unique<Channels>();
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
    WD_ASSIGN_OR_RETURN(channels->token, ReadToken(options.token_file));
  }
  for (const std::string& address : options.addresses) {
    WD_RETURN_IF_ERROR(CheckHostPort(address));
    grpc::ChannelArguments args;
    // A peer that went away is tried again at the next poll, not after
    // gRPC's reconnect backoff (up to 2 min).
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    channels->stubs.push_back(
        v1::Models::NewStub(grpc::CreateCustomChannel(address, creds, args)));
  }
  auto table =
      std::unique_ptr<PeerTable>(new PeerTable(std::move(options), std::move(channels)));
  table->thread_ = std::thread([t = table.get()] { t->Run(); });
  return table;
}

PeerTable::PeerTable(PeerOptions options, std::unique_ptr<Channels> channels)
    : options_(std::move(options)), channels_(std::move(channels)) {
  for (const std::string& address : options_.addresses) {
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

void PeerTable::Run() {
  while (true) {
    for (size_t i = 0; i < channels_->stubs.size(); ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.call_timeout));
      if (!channels_->token.empty()) {
        ctx.AddMetadata("authorization", "Bearer " + channels_->token);
      }
      v1::ListModelsResponse resp;
      grpc::Status s = channels_->stubs[i]->List(&ctx, v1::ListModelsRequest(), &resp);
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&mu_);
      PeerState& p = peers_[i];
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
        p.error = absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())),
                               ": ", s.error_message());
      }
      if (first || was != p.reachable) {
        LogEvent(p.reachable ? LogLevel::kInfo : LogLevel::kWarning,
                 p.reachable ? "peer_reachable" : "peer_unreachable",
                 {{"peer", p.address}, {"error", p.error},
                  {"models", absl::StrCat(p.models.size())}});
      }
      if (stop_) return;
    }
    absl::MutexLock lock(&mu_);
    auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopped), options_.poll_interval)) return;
  }
}

}  // namespace weightd
