// The gRPC face of the daemon: weightd.v1 Models/Shards/Adapters on the
// callback API, the standard grpc.health.v1 service and server reflection,
// over a Unix socket and optionally TCP. Thin: every call is authenticated
// (call_auth.h), translated and handed to WeightService; blocking work runs
// on a small worker pool, never on gRPC's own threads. grpc.health.v1 and
// reflection answer anyone who reaches a listener (kubelet probes carry no
// token); everything else is checked.
#ifndef WEIGHTD_SERVER_GRPC_GRPC_SERVER_H_
#define WEIGHTD_SERVER_GRPC_GRPC_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine/weight_service.h"

namespace weightd {

class PeerTable;
class UcxPlane;
class PeerCheckpointClient;

struct GrpcServerOptions {
  std::string unix_socket;  // required
  mode_t unix_socket_mode = 0660;
  std::string tcp_listen;   // optional HOST:PORT
  int worker_threads = 4;
  // Watch streams open at once (each holds a thread while it waits); the
  // excess is refused RESOURCE_EXHAUSTED.
  int max_watch_streams = 256;
  // TCP listener security (docs/access-control.md). With a cert and key
  // the listener speaks TLS; with a client CA it also requires and verifies
  // client certificates. With a token file every call but Health needs
  // "authorization: Bearer <token>".
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  std::string auth_token_file;
  // Not OK: start as Restoring(closed_at_start) would leave it (no window
  // in which a call gets through before the restore).
  absl::Status closed_at_start;
  // Not OK: calls that change what is served (loads, unloads, applies) are
  // refused with it until Restored() (--serve-during-restore serves the
  // rest meanwhile).
  absl::Status changes_closed_at_start;
  // A socket already listening at unix_socket (a predecessor's, at a
  // hand-over): accepted on instead of binding; the server owns it. -1: bind.
  int adopt_unix_listen_fd = -1;
  // The fleet's other daemons (--peers), for Models.Peers; borrowed, may be
  // null.
  const PeerTable* peers = nullptr;
  // The UCX data plane FindCheckpoint grants reads of (ucx_offer.h);
  // borrowed, may be null.
  UcxPlane* ucx = nullptr;
  // The loads' reads from peers by transport (Stats.peer_transports);
  // borrowed, may be null.
  const PeerCheckpointClient* peer_client = nullptr;
};

class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(GrpcServerOptions options,
                                                           WeightService* service);
  ~GrpcServer();

  // Health NOT_SERVING, stop accepting, let in-flight calls finish until
  // `deadline`, then cancel the rest. Unlinks the socket. Idempotent.
  void Shutdown(absl::Duration grace);
  // Blocks until Shutdown() completes.
  void Wait();
  // While restoring (--state-dir): health NOT_SERVING and every call but
  // Health answered `why` (UNAVAILABLE); Restored() opens the service.
  void Restoring(absl::Status why);
  void Restored();

  // Hand-over (server/state/handover.h). CloseChanges: loads, unloads,
  // applies and publishes are refused with `why` (OK reopens them);
  // WaitChangesIdle: until none is in flight or `deadline` (returns how
  // many are left).
  void CloseChanges(absl::Status why);
  int64_t WaitChangesIdle(absl::Time deadline);
  // No new Unix-socket connection is accepted from when PauseAccepting()
  // returns until ResumeAccepting(); the listening socket stays open.
  void PauseAccepting();
  void ResumeAccepting();
  // Shutdown() leaves the socket file in place (the successor serves it).
  void KeepSocketFile(bool keep = true);
  int unix_listen_fd() const;

  class Impl;

 private:
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_GRPC_SERVER_H_
