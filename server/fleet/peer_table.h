// The other daemons of a fleet that this one knows (--peers HOST:PORT,...):
// each polled every --peer-poll-seconds over its TCP listener (weightd.v1
// Models.List) for what it holds, so `weightctl peers` shows the fleet from
// any node: which peers answer, and every model's generation and weights_id
// (issue [cluster]). Loads ask the peers in this table for checkpoint bytes
// (PeerCheckpointClient, peer_checkpoint_client.h); server/fleet/fleet.h
// builds both.
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
// one receive budget (PeerChannels).
//
// A daemon recognizes itself among its peers (--peer-dns naming it without
// --advertise, --peers listing its own address): answers carry a random
// per-process instance id (initial metadata kInstanceMetadata), and an
// address that answers with this daemon's own id is left out for good.
//
// Thread-safe. Owns its polling thread (joined by the destructor) and the
// table; borrows the channels. One mutex of its own.
#ifndef WEIGHTD_SERVER_FLEET_PEER_TABLE_H_
#define WEIGHTD_SERVER_FLEET_PEER_TABLE_H_

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/fleet/ucx_plane.h"
#include "absl/time/time.h"
#include "server/fleet/peer_channels.h"

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
  // --peer-transport: how ranges are read (ucx_plane.h).
  PeerTransport transport = PeerTransport::kGrpc;
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

class PeerTable {
 public:
  // Polls at once, then every poll_interval, through `channels` (which
  // must outlive the table). REQUIRES: options checked (Fleet::Start),
  // max_peers and call_threads >= 1.
  static std::unique_ptr<PeerTable> Start(PeerOptions options, PeerChannels* channels,
                                          std::string instance_id);
  ~PeerTable();  // stops polling
  PeerTable(const PeerTable&) = delete;
  PeerTable& operator=(const PeerTable&) = delete;

  std::vector<PeerState> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  const PeerOptions& options() const { return options_; }
  // Why the last resolution of options().dns failed; empty when it worked.
  std::string dns_error() const ABSL_LOCKS_EXCLUDED(mu_);
  // This process's random id (32 hex digits), sent with this daemon's
  // answers (kInstanceMetadata).
  const std::string& instance_id() const { return instance_id_; }
  // `address` answered with this daemon's instance id: it leaves the table
  // and is never polled or asked again.
  void MarkSelf(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  PeerTable(PeerOptions options, PeerChannels* channels, std::string instance_id);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // The addresses to poll now: the static ones, then what DNS gives, this
  // daemon's own left out, at most max_peers; the table follows them.
  std::vector<std::string> Targets() ABSL_LOCKS_EXCLUDED(mu_);
  // The --peers addresses, once each, this daemon's own left out.
  std::vector<std::string> StaticTargets() const ABSL_LOCKS_EXCLUDED(mu_);
  // DNS failed: the peers found before are kept (and polled) until it
  // answers again.
  void KeepPeersFoundBefore(const absl::Status& why, std::vector<std::string>* targets)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The table becomes `targets`: new addresses added, the ones DNS no
  // longer gives (and no flag names) dropped.
  void Follow(const std::vector<std::string>& targets) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Poll(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  bool IsSelf(const std::string& address) const ABSL_LOCKS_EXCLUDED(mu_);
  // Orders `addresses` by this daemon's rendezvous scores and keeps
  // `room` of them.
  std::vector<std::string> Preferred(std::vector<std::string> addresses, size_t room) const;

  // Constant after construction.
  const PeerOptions options_;
  PeerChannels* const channels_;
  const std::string instance_id_;

  // Protected by mu_.
  mutable absl::Mutex mu_;
  std::vector<PeerState> peers_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> self_ ABSL_GUARDED_BY(mu_);  // addresses that are this daemon
  std::string dns_error_ ABSL_GUARDED_BY(mu_);
  size_t truncated_from_ ABSL_GUARDED_BY(mu_) = 0;  // the last peer_list_truncated's count
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Set once by Start, joined by the destructor.
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_PEER_TABLE_H_
