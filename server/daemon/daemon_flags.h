// The daemon's flags (docs/DESIGN.md §4.1): declared here and only here, in one
// FlagTable (server/base/flag_table.h: the usage text, WEIGHTD_<FLAG> variables
// and config-file keys come from it), and parsed into the Options structs
// of the parts they configure (DaemonFlags).
//
// The table is built by one Add*Flags function per section of `weightd
// --help`, in the order the usage text lists them: the sections follow the
// help text (which users read and scripts diff), not the Options structs,
// since several sections feed more than one struct (--peer-streams tunes
// the service's loads, --fleet-members its access policy). Each function is
// a flat list of rows.
//
// Not thread-safe: build, Parse and CheckFlags on the main thread before
// anything starts.
#ifndef WEIGHTD_SERVER_DAEMON_DAEMON_FLAGS_H_
#define WEIGHTD_SERVER_DAEMON_DAEMON_FLAGS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/base/flag_table.h"
#include "server/grpc/grpc_server.h"
#include "server/fleet/peer_table.h"
#include "server/source/source_client.h"
#include "server/engine/weight_service.h"
#include "server/store/checkpoint.h"
#include "server/transport/data_server.h"

namespace weightd {

// --preload NAME=PATH[@PROFILE]: loaded at start-up (startup.h).
struct Preload {
  std::string name, path, profile;
};

// Everything the flags say, as the parts take it. Daemon::Start fills in
// what no flag gives (GPUs, borrowed parts, hooks) before it builds each
// part.
struct DaemonFlags {
  // The daemon's defaults where they differ from the structs': huge pages
  // auto, and the daemon's own effective uid always allowed (SO_PEERCRED
  // reports effective ids).
  DaemonFlags();

  WeightServiceOptions service;
  GrpcServerOptions grpc;
  DataServer::Options data;
  std::string metrics_listen;
  std::vector<Preload> preloads;
  absl::Duration shutdown_grace = absl::Seconds(10);
  mode_t socket_mode = 0660;
  bool allow_insecure_token = false;
  std::string state_dir;
  bool serve_during_restore = false;
  bool take_over = false;
  std::string handover_socket;  // default <state-dir>/handover.sock
  bool handover_in_state_dir = false;  // the default: named relative to the state dir
  AdoptVerify take_over_verify = AdoptVerify::kFull;
  PeerOptions peers;
  // --model-source prefixes and the client of remote sources (--s3-*,
  // --source-*, --https-bearer-token-file).
  std::vector<std::string> model_sources;
  SourceClientOptions source;
};

// The sections of the table, in the usage text's order. Each writes into
// `f` (the table keeps the pointer: `f` must outlive its Parse).
// --socket, --data-socket, --listen, --metrics-listen.
void AddListenerFlags(FlagTable& t, DaemonFlags* f);
// --model-root, --host-memory-bytes, --preload.
void AddModelFlags(FlagTable& t, DaemonFlags* f);
// --model-source, --s3-*, --source-*, --https-bearer-token-file.
void AddSourceFlags(FlagTable& t, DaemonFlags* f);
// --state-dir, --serve-during-restore and the hand-over's flags.
void AddStateFlags(FlagTable& t, DaemonFlags* f);
// The fleet: --peers ... --fleet-members.
void AddPeerFlags(FlagTable& t, DaemonFlags* f);
// Warm reserve, leases, shutdown grace, data-socket and Watch limits.
void AddServingFlags(FlagTable& t, DaemonFlags* f);
// The service's workers and memory: --threads ... --checkpoint-segment-bytes.
void AddServiceFlags(FlagTable& t, DaemonFlags* f);
// --log-format, --log-level (applied to the process's log at once).
void AddLogFlags(FlagTable& t);
// --socket-mode and who may call (uids, gids, token names).
void AddAccessFlags(FlagTable& t, DaemonFlags* f);
// The TCP listener's TLS and tokens.
void AddTlsFlags(FlagTable& t, DaemonFlags* f);

// Every daemon flag, once, each section in order: the table behind
// `weightd --help`.
FlagTable DaemonFlagTable(DaemonFlags* f);

// What no single flag can check: required flags and combinations
// (INVALID_ARGUMENT; the two required flags' messages end with the usage
// text). On success fills in what follows from the flags (the data socket's
// path and mode, the hand-over socket's default, the socket name clients
// find beside the gRPC socket).
absl::Status CheckFlags(const FlagTable& table, DaemonFlags* flags);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_DAEMON_FLAGS_H_
