#include "server/fleet/fleet.h"

#include <algorithm>
#include <string>
#include <utility>

#include <grpcpp/security/credentials.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/digest.h"
#include "common/fd.h"
#include "common/grpc/credentials.h"
#include "common/status_macros.h"

namespace weightd {
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

// TLS to peers only with --peer-tls-ca; then this daemon's certificate too.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(
    const PeerOptions& options) {
  if (options.tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  return MakeTlsCredentials(
      {options.tls_ca_file, options.tls_cert_file, options.tls_key_file});
}

}  // namespace

absl::StatusOr<std::unique_ptr<Fleet>> Fleet::Start(PeerOptions options, UcxPlane* ucx) {
  options.max_peers = std::max<size_t>(1, options.max_peers);
  options.call_threads = std::max(1, options.call_threads);
  WD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds, PeerCredentials(options));
  std::string token;
  if (!options.token_file.empty()) {
    WD_ASSIGN_OR_RETURN(token, ReadTokenFile(options.token_file, "--peer-token-file"));
  }
  for (const std::string& address : options.addresses) {
    WD_RETURN_IF_ERROR(CheckHostPort(address, "--peers"));
  }
  if (!options.dns.empty()) WD_RETURN_IF_ERROR(CheckHostPort(options.dns, "--peer-dns"));
  auto fleet = std::unique_ptr<Fleet>(new Fleet());
  fleet->channels_ = std::make_unique<PeerChannels>(options.max_peers,
                                                    options.receive_budget_bytes,
                                                    std::move(creds), std::move(token));
  const PeerTransport transport = options.transport;
  fleet->table_ = PeerTable::Start(std::move(options), fleet->channels_.get(), RandomDigest().Hex());
  fleet->checkpoints_ = std::make_unique<PeerCheckpointClient>(
      fleet->table_.get(), fleet->channels_.get(), ucx, transport);
  return fleet;
}

}  // namespace weightd
