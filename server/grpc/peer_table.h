// The other daemons of a fleet that this one knows (--peers HOST:PORT,...):
// each polled every --peer-poll-seconds over its TCP listener (weightd.v1
// Models.List) for what it holds, so `weightctl peers` shows the fleet from
// any node: which peers answer, and every model's generation and weights_id
// (issue [cluster]; replication between peers builds on it).
//
// Daemon-to-daemon calls use the listener's security: a bearer token from
// --peer-token-file, and with --peer-tls-ca TLS verified against that CA,
// presenting --tls-cert/--tls-key as this daemon's client certificate.
#ifndef WEIGHTD_SERVER_GRPC_PEER_TABLE_H_
#define WEIGHTD_SERVER_GRPC_PEER_TABLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/store/peer_source.h"

namespace weightd {

struct PeerOptions {
  std::vector<std::string> addresses;  // HOST:PORT each
  // NAME:PORT: every address NAME resolves to (a Kubernetes headless
  // Service: every DaemonSet pod), resolved again at every poll; the
  // advertised address is left out (this daemon itself).
  std::string dns;
  std::string advertise;               // this daemon's HOST:PORT, as reported
  absl::Duration poll_interval = absl::Seconds(10);
  absl::Duration call_timeout = absl::Seconds(3);
  std::string token_file;  // bearer token presented to peers (first line)
  std::string tls_ca_file;  // TLS to peers, verified against this CA
  std::string tls_cert_file;  // client certificate (with tls_ca_file)
  std::string tls_key_file;
};

struct PeerModelState {
  std::string name;
  uint64_t generation = 0;
  std::string weights_id;
};

struct PeerState {
  std::string address;
  bool reachable = false;
  std::string error;
  absl::Time last_seen = absl::InfinitePast();  // InfinitePast: never
  absl::Time polled = absl::InfinitePast();     // InfinitePast: not yet
  std::vector<PeerModelState> models;
};

// Also the peers loads get checkpoint bytes from (CheckpointPeers): the
// peers asked are those whose last poll answered (or not polled yet).
class PeerTable : public CheckpointPeers {
 public:
  // INVALID_ARGUMENT for an address that is not HOST:PORT, or credentials
  // that cannot be read. Polls at once, then every poll_interval.
  static absl::StatusOr<std::unique_ptr<PeerTable>> Start(PeerOptions options);
  ~PeerTable() override;  // stops polling
  PeerTable(const PeerTable&) = delete;
  PeerTable& operator=(const PeerTable&) = delete;

  std::vector<PeerState> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  const PeerOptions& options() const { return options_; }
  // Why the last resolution of options().dns failed; empty when it worked.
  std::string dns_error() const ABSL_LOCKS_EXCLUDED(mu_);

  // CheckpointPeers. A range's deadline: twice the call timeout plus 32
  // MiB/s of its length.
  std::vector<PeerHolding> FindHolders(const Digest& key,
                                       const std::vector<CheckpointRange>& samples,
                                       const std::vector<Digest>& sample_digests) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                         const CheckpointRange& range, uint8_t* dest) override;

  class Channels;

 private:
  PeerTable(PeerOptions options, std::unique_ptr<Channels> channels);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // The addresses to poll now: the static ones, then what DNS gives.
  std::vector<std::string> Targets() ABSL_LOCKS_EXCLUDED(mu_);
  void Poll(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

  const PeerOptions options_;
  std::unique_ptr<Channels> channels_;
  mutable absl::Mutex mu_;
  std::vector<PeerState> peers_ ABSL_GUARDED_BY(mu_);
  std::string dns_error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_PEER_TABLE_H_
