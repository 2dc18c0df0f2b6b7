// The other daemons of a fleet that this one knows (--peers HOST:PORT,...):
// each polled every --peer-poll-seconds over its TCP listener (weightd.v1
// Models.List) for what it holds, so `weightctl peers` shows the fleet from
// any node: which peers answer, and every model's generation and weights_id
// (issue [cluster]; replication between peers builds on it).
//
// Daemon-to-daemon calls use the listener's security: a bearer token from
// --peer-token-file, and with --peer-tls-ca TLS verified against that CA,
// presenting --tls-cert/--tls-key as this daemon's client certificate. The
// holders only answer identities their --fleet-members lists.
//
// What a fleet costs a daemon is bounded whatever DNS or a peer says: at
// most max_peers peers are considered (the rest logged, not polled), calls
// to them run call_threads at once, at most max_peers connections are kept
// (least recently used closed), and every peer connection's buffers share
// one receive budget (a gRPC resource quota: past it, calls are cancelled
// RESOURCE_EXHAUSTED), so a peer's answer cannot take the loader's memory.
//
// A daemon recognizes itself among its peers (--peer-dns naming it without
// --advertise, --peers listing its own address): answers carry a random
// per-process instance id (initial metadata kInstanceMetadata), and an
// address that answers with this daemon's own id is left out for good.
#ifndef WEIGHTD_SERVER_GRPC_PEER_TABLE_H_
#define WEIGHTD_SERVER_GRPC_PEER_TABLE_H_

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/store/peer_source.h"

namespace weightd {

// The initial-metadata key of a daemon's instance id in its answers.
inline constexpr char kInstanceMetadata[] = "weightd-instance";

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
  // --peer-max: the most peers considered (polled, asked for bytes) and
  // connections kept. Past it the --peers addresses come first, then DNS's
  // in an order of this daemon's own (rendezvous on its instance id: the
  // daemons of a large fleet spread over different subsets); the rest are
  // left out, logged once per change (peer_list_truncated).
  size_t max_peers = 64;
  int call_threads = 8;  // peers polled or asked at once
  // What every peer connection together may buffer (answers, ranges in
  // flight); a larger answer is cancelled RESOURCE_EXHAUSTED.
  uint64_t receive_budget_bytes = 64ull << 20;
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
// peers asked are those in the table (this daemon left out).
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
  // This process's random id (32 hex digits), sent with this daemon's
  // answers (kInstanceMetadata).
  const std::string& instance_id() const { return instance_id_; }

  // CheckpointPeers. A range's deadline: twice the call timeout plus 32
  // MiB/s of its length. An answer is refused unless it has exactly the
  // query's shape; with too little receive budget for call_threads true
  // answers at once, fewer peers are asked at once (none, logged, when
  // even one would not fit).
  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                         const CheckpointRange& range, uint8_t* dest) override;

  class Channels;

 private:
  PeerTable(PeerOptions options, std::unique_ptr<Channels> channels, std::string instance_id);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // The addresses to poll now: the static ones, then what DNS gives, this
  // daemon's own left out, at most max_peers.
  std::vector<std::string> Targets() ABSL_LOCKS_EXCLUDED(mu_);
  void Poll(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  // `address` answered with this daemon's instance id: it leaves the table
  // and is never polled or asked again.
  void MarkSelf(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  bool IsSelf(const std::string& address) const ABSL_LOCKS_EXCLUDED(mu_);
  // Orders `addresses` by this daemon's rendezvous scores and keeps
  // `room` of them.
  std::vector<std::string> Preferred(std::vector<std::string> addresses, size_t room) const;

  const PeerOptions options_;
  std::unique_ptr<Channels> channels_;
  const std::string instance_id_;
  mutable absl::Mutex mu_;
  std::vector<PeerState> peers_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> self_ ABSL_GUARDED_BY(mu_);  // addresses that are this daemon
  std::string dns_error_ ABSL_GUARDED_BY(mu_);
  size_t truncated_from_ ABSL_GUARDED_BY(mu_) = 0;  // the last peer_list_truncated's count
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_PEER_TABLE_H_
