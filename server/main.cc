// weightd: the per-node weight-serving daemon. Flags (DESIGN §3) are declared
// here and only here, in one table (DaemonFlagTable), and parsed into the
// Options structs of the parts they configure.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/fd.h"
#include "common/file_opener.h"
#include "common/flag_table.h"
#include "common/unix_socket.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/fleet/fleet.h"
#include "server/grpc/call_auth.h"
#include "server/gpu/cuda_push_writer.h"
#include "server/gpu/gpu_devices.h"
#include "server/memory/huge_pages.h"
#include "server/grpc/grpc_server.h"
#include "server/metrics/prometheus_exporter.h"
#include "server/service/weight_service.h"
#include "server/state/handover.h"
#include "server/state/restore.h"
#include "server/state/state_dir.h"
#include "server/state/state_journal.h"
#include "server/transport/shm_server.h"

namespace weightd {
namespace {

// Profiles are small JSON documents; anything larger is a mistake.
constexpr uint64_t kMaxProfileBytes = 64ull << 20;
// Added to restored models' next generation numbers when the journal had a
// damaged record (which may have held a higher number than any intact one).
constexpr uint64_t kDamagedJournalMargin = 1u << 20;

struct Preload {
  std::string name, path, profile;
};

struct DaemonFlags {
  WeightServiceOptions service;
  GrpcServerOptions grpc;
  ShmDataServer::Options data;
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
};

// Lease ids the predecessor's calls in flight at the switch may still
// grant past the number it reported.
constexpr uint64_t kLeaseIdMargin = 1u << 16;

using Apply = std::function<absl::Status(const std::string&)>;

// Comma-separated numeric ids; a repeated flag adds to the list.
Apply IdsInto(std::string flag, std::vector<uint32_t>* out) {
  return [flag = "--" + std::move(flag), out](const std::string& text) -> absl::Status {
    WD_ASSIGN_OR_RETURN(std::vector<uint32_t> parsed, ParseIdList(flag, text));
    out->insert(out->end(), parsed.begin(), parsed.end());
    return absl::OkStatus();
  };
}

// A number of seconds in [min, max] into a Duration.
Apply SecondsInto(std::string flag, absl::Duration* out, uint64_t max) {
  return [flag, out, max](const std::string& v) -> absl::Status {
    uint64_t n = 0;
    WD_RETURN_IF_ERROR(Uint64Into(flag, &n, 0, max)(v));
    *out = absl::Seconds(static_cast<int64_t>(n));
    return absl::OkStatus();
  };
}

// One of `choices` (the text shown in the error), mapped by `fn`.
Apply OneOf(std::string flag, std::string choices, std::function<bool(const std::string&)> fn) {
  return [flag, choices, fn](const std::string& v) -> absl::Status {
    if (fn(v)) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": expected ", choices, ", got \"", v, "\""));
  };
}

// Every daemon flag, once: name, value, help, where it goes (DESIGN §3).
// The usage text, WEIGHTD_<FLAG> variables and config-file keys come from
// this table (common/flag_table.h).
FlagTable DaemonFlagTable(DaemonFlags* f) {
  using K = FlagSpec::Kind;
  AccessPolicyOptions* access = &f->service.access;
  FlagTable t("weightd", "WEIGHTD");
  t.Add({"socket", "PATH", "gRPC on this Unix socket (required)", K::kValue,
         StringInto(&f->grpc.unix_socket)})
      .Add({"data-socket", "PATH", "fd passing for shm clients (default <socket>.data)", K::kValue,
            StringInto(&f->data.path)})
      .Add({"listen", "HOST:PORT", "gRPC over TCP too, for remote clients", K::kValue,
            StringInto(&f->grpc.tcp_listen)})
      .Add({"metrics-listen", "HOST:PORT", "Prometheus /metrics", K::kValue,
            StringInto(&f->metrics_listen)})
      .Add({"model-root", "DIR", "load paths must resolve inside one (required)", K::kList,
            AppendInto(&f->service.model_roots)})
      .Add({"host-memory-bytes", "N", "memory budget (0 = none)", K::kValue,
            Uint64Into("host-memory-bytes", &f->service.host_memory_bytes)})
      .Add({"preload", "NAME=PATH[@PROFILE]", "load at start-up", K::kList,
            [f](const std::string& spec) -> absl::Status {
              size_t eq = spec.find('=');
              if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
                return absl::InvalidArgumentError(
                    absl::StrCat("--preload: expected NAME=PATH[@PROFILE], got \"", spec, "\""));
              }
              Preload p{spec.substr(0, eq), spec.substr(eq + 1), ""};
              if (size_t at = p.path.rfind('@'); at != std::string::npos) {
                p.profile = p.path.substr(at + 1);
                p.path = p.path.substr(0, at);
              }
              f->preloads.push_back(std::move(p));
              return absl::OkStatus();
            }})
      .Add({"state-dir", "DIR",
            "journal what is served there; restore it at start-up (README: Restarts)",
            K::kValue, StringInto(&f->state_dir)})
      .Add({"serve-during-restore", "", "answer calls while the state is restored", K::kSwitch,
            [f](const std::string& v) {
              f->serve_during_restore = v == "true";
              return absl::OkStatus();
            }})
      .Add({"take-over", "",
            "take over the daemon running on these sockets (its memory, sockets and state; "
            "README: Restarts); none running: start as usual",
            K::kSwitch,
            [f](const std::string& v) {
              f->take_over = v == "true";
              return absl::OkStatus();
            }})
      .Add({"handover-socket", "PATH",
            "where this daemon hands over to a successor, and where --take-over finds the "
            "running one (default <state-dir>/handover.sock; none without --state-dir)",
            K::kValue, StringInto(&f->handover_socket)})
      .Add({"take-over-verify", "full|sample|none",
            "check handed-over checkpoint bytes against the predecessor's digests: every "
            "tensor, one in 16, or none (default full)",
            K::kValue,
            OneOf("take-over-verify", "full, sample or none", [f](const std::string& v) {
              static const std::map<std::string, AdoptVerify> kModes = {
                  {"full", AdoptVerify::kFull}, {"sample", AdoptVerify::kSample},
                  {"none", AdoptVerify::kNone}};
              auto it = kModes.find(v);
              if (it == kModes.end()) return false;
              f->take_over_verify = it->second;
              return true;
            })})
      .Add({"peers", "HOST:PORT,...",
            "the fleet's other daemons (their --listen): polled for what they hold, shown by "
            "weightctl peers",
            K::kList, [f](const std::string& v) {
              for (absl::string_view a : absl::StrSplit(v, ',', absl::SkipWhitespace())) {
                f->peers.addresses.emplace_back(absl::StripAsciiWhitespace(a));
              }
              return absl::OkStatus();
            }})
      .Add({"peer-dns", "NAME:PORT",
            "peers are every address NAME resolves to (a headless Service), resolved again at "
            "every poll; --advertise (this daemon) is left out",
            K::kValue, StringInto(&f->peers.dns)})
      .Add({"advertise", "HOST:PORT",
            "this daemon's address as its peers reach it (reported; left out of --peer-dns)",
            K::kValue, StringInto(&f->peers.advertise)})
      .Add({"peer-poll-seconds", "N", "how often peers are polled (1..3600, default 10)",
            K::kValue,
            [f](const std::string& v) -> absl::Status {
              uint64_t n = 0;
              WD_RETURN_IF_ERROR(Uint64Into("peer-poll-seconds", &n, 1, 3600)(v));
              f->peers.poll_interval = absl::Seconds(static_cast<int64_t>(n));
              return absl::OkStatus();
            }})
      .Add({"peer-token-file", "FILE",
            "the bearer token presented to peers (first line; a NAME TOKEN line works)",
            K::kValue, StringInto(&f->peers.token_file)})
      .Add({"peer-tls-ca", "FILE",
            "TLS to peers, verified against this CA; --tls-cert/--tls-key are presented as "
            "this daemon's client certificate",
            K::kValue, StringInto(&f->peers.tls_ca_file)})
      .Add({"read-chunk-bytes", "N",
            "bytes per read of a checkpoint, from storage or a peer (1 MiB..256 MiB, default "
            "16 MiB)",
            K::kValue, Uint64Into("read-chunk-bytes", &f->service.read_chunk_bytes, 1ull << 20,
                                  256ull << 20)})
      .Add({"peer-streams", "N",
            "ranges a load transfers from peers at once (1..64, default 4)", K::kValue,
            NumberInto("peer-streams", &f->service.peer_streams, 1, 64)})
      .Add({"peer-max", "N",
            "the most peers considered and connections kept (1..4096, default 64); past it, "
            "--peers first, then a per-daemon choice of --peer-dns's (logged)",
            K::kValue, NumberInto("peer-max", &f->peers.max_peers, 1, 4096)})
      .Add({"peer-verify", "samples|all|N%",
            "how much of what peers send a load compares with storage, at places the peers are "
            "never told: 8 pieces per file (default), that share of the bytes, or every byte",
            K::kValue,
            [f](const std::string& v) -> absl::Status {
              WD_ASSIGN_OR_RETURN(f->service.peer_verify, ParsePeerVerify(v));
              return absl::OkStatus();
            }})
      .Add({"fleet-members", "LIST",
            "the daemons that may load from this one (FindCheckpoint, ReadCheckpoint): "
            "token:NAME (--auth-token-file) and cn:NAME (--tls-client-ca) entries; none = "
            "nobody",
            K::kValue, [access](const std::string& v) -> absl::Status {
              WD_ASSIGN_OR_RETURN(access->fleet_members, ReaderList::Parse({v}));
              if (!access->fleet_members.OnlyTcpIdentities()) {
                return absl::InvalidArgumentError(
                    "--fleet-members: only token:NAME and cn:NAME (peers call over --listen)");
              }
              return absl::OkStatus();
            }})
      .Add({"warm-reserve-bytes", "N", "pre-faulted output segments kept ready (0 = off)",
            K::kValue, Uint64Into("warm-reserve-bytes", &f->service.warm_reserve_bytes)})
      .Add({"reserve-chunk-bytes", "N", "size of a warm-reserve chunk (>= 4096)", K::kValue,
            Uint64Into("reserve-chunk-bytes", &f->service.reserve_chunk_bytes, 4096)})
      .Add({"lease-ttl-seconds", "N", "reclaim leases idle this long (default 60)", K::kValue,
            SecondsInto("lease-ttl-seconds", &f->service.lease_idle_ttl, UINT32_MAX)})
      .Add({"shutdown-grace-seconds", "N", "in-flight calls may finish this long (0..3600)",
            K::kValue, SecondsInto("shutdown-grace-seconds", &f->shutdown_grace, 3600)})
      .Add({"max-data-connections", "N",
            "data-socket connections in all (0 = half the open-file limit, at most 65536)",
            K::kValue, NumberInto("max-data-connections", &f->data.max_connections, 0, SIZE_MAX)})
      .Add({"max-data-connections-per-uid", "N",
            "data-socket connections per peer uid (0 = half the total)", K::kValue,
            NumberInto("max-data-connections-per-uid", &f->data.max_connections_per_uid, 0,
                       SIZE_MAX)})
      .Add({"max-pushes-per-uid", "N",
            "pushes into clients' memory queued or running per peer uid (0 = no limit, "
            "default 8)",
            K::kValue, NumberInto("max-pushes-per-uid", &f->data.max_pushes_per_uid, 0, SIZE_MAX)})
      .Add({"device-memory-bytes", "N",
            "buffers the daemon fills and exports (fetch mode \"export\"), held or kept, per "
            "GPU and for host memory: least recently used unheld ones are evicted past it "
            "(0 = a quarter of each GPU's memory; for host memory half of "
            "--host-memory-bytes, a quarter of the machine's when that is 0)",
            K::kValue, Uint64Into("device-memory-bytes", &f->data.export_budget)})
      .Add({"max-export-bytes-per-uid", "N",
            "bytes of exported buffers one peer uid's open exports hold per device (0 = half "
            "of --device-memory-bytes as resolved)",
            K::kValue,
            Uint64Into("max-export-bytes-per-uid", &f->data.max_export_bytes_per_uid)})
      .Add({"max-watch-streams", "N", "concurrent Watch streams (1..65536, default 256)",
            K::kValue, NumberInto("max-watch-streams", &f->grpc.max_watch_streams, 1, 65536)})
      .Add({"threads", "N", "materialization workers (1..256): one fetch computes on up to N threads, its own included; concurrent fetches share the N-1 helpers", K::kValue,
            NumberInto("threads", &f->service.worker_threads, 1, 256)})
      .Add({"pin-host-memory", "auto|on|off",
            "register checkpoint and published memory with CUDA for pinned-speed GPU copies "
            "(auto: when there are GPUs; read-only registration where every GPU supports it, "
            "else the daemon's writable mapping; failures are logged, never fatal)",
            K::kValue,
            OneOf("pin-host-memory", "auto, on or off", [f](const std::string& v) {
              using Pin = WeightServiceOptions::Pin;
              static const std::map<std::string, Pin> kModes = {
                  {"auto", Pin::kAuto}, {"on", Pin::kOn}, {"off", Pin::kOff}};
              auto it = kModes.find(v);
              if (it == kModes.end()) return false;
              f->service.pin_host_memory = it->second;
              return true;
            })})
      .Add({"publish-staging-ahead", "on|off",
            "after a model's publish, allocate and fault in the staging of its next one (the "
            "same size) in the background, while the memory budget has room; taken back first "
            "when memory is short (default on)",
            K::kValue,
            OneOf("publish-staging-ahead", "on or off", [f](const std::string& v) {
              if (v != "on" && v != "off") return false;
              f->service.publish_staging_ahead = v == "on";
              return true;
            })})
      .Add({"max-publish-sessions", "N",
            "publish sessions open at once, in all (each holds a memfd, a mapping and its "
            "staging memory until it ends; 0 = no limit, default 64)",
            K::kValue,
            NumberInto("max-publish-sessions", &f->service.max_publish_sessions, 0, SIZE_MAX)})
      .Add({"max-publish-sessions-per-caller", "N",
            "publish sessions one caller (a uid; a token or client certificate on TCP) may hold "
            "open (0 = no limit, default 8)",
            K::kValue,
            NumberInto("max-publish-sessions-per-caller",
                       &f->service.max_publish_sessions_per_caller, 0, SIZE_MAX)})
      .Add({"publish-idle-seconds", "N",
            "end an open publish session after this long without a write, a stage or a waiting "
            "commit, freeing its memory (0 = only its deadline ends it; default 300)",
            K::kValue,
            SecondsInto("publish-idle-seconds", &f->service.publish_idle_timeout, 86400)})
      .Add({"huge-pages", "auto|off|require",
            "2 MiB pages for segments of 2 MiB or more: auto - hugetlb while the pool has room, "
            "else shmem THP where the host honours it, else 4 KiB; require - hugetlb or the load "
            "fails RESOURCE_EXHAUSTED (default auto)",
            K::kValue,
            OneOf("huge-pages", "auto, off or require", [f](const std::string& v) {
              std::optional<HugePageMode> mode = ParseHugePageMode(v);
              if (!mode.has_value()) return false;
              f->service.huge_pages = *mode;
              return true;
            })})
      .Add({"checkpoint-segment-bytes", "N",
            "pack a checkpoint's files into segments of up to N bytes (>= 2 MiB, default 1 "
            "GiB; a larger file gets its own)",
            K::kValue,
            Uint64Into("checkpoint-segment-bytes", &f->service.checkpoint_segment_bytes,
                       kHugePageBytes)})
      .Add({"log-format", "text|json", "log lines", K::kValue,
            OneOf("log-format", "text or json", [](const std::string& v) {
              if (v != "json" && v != "text") return false;
              SetLogFormat(v == "json" ? LogFormat::kJson : LogFormat::kText);
              return true;
            })})
      .Add({"log-level", "LEVEL", "debug|info|warning|error", K::kValue,
            OneOf("log-level", "debug|info|warning|error", [](const std::string& v) {
              static const std::map<std::string, LogLevel> kLevels = {
                  {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
                  {"warning", LogLevel::kWarning}, {"error", LogLevel::kError}};
              auto it = kLevels.find(v);
              if (it == kLevels.end()) return false;
              SetMinLogLevel(it->second);
              return true;
            })})
      .Add({"socket-mode", "OCTAL", "mode of both socket files (default 0660)", K::kValue,
            [f](const std::string& v) -> absl::Status {
              char* end = nullptr;
              long m = std::strtol(v.c_str(), &end, 8);
              if (v.empty() || *end != '\0' || m < 0 || m > 0777) {
                return absl::InvalidArgumentError(
                    absl::StrCat("--socket-mode: bad octal mode \"", v, "\""));
              }
              f->socket_mode = static_cast<mode_t>(m);
              return absl::OkStatus();
            }})
      .Add({"allow-uid", "LIST", "Unix peers allowed on both sockets", K::kValue,
            IdsInto("allow-uid", &access->allow_uids)})
      .Add({"allow-gid", "LIST", "Unix groups allowed on both sockets", K::kValue,
            IdsInto("allow-gid", &access->allow_gids)})
      .Add({"admin-uid", "LIST", "who may load, unload and apply", K::kValue,
            IdsInto("admin-uid", &access->admin_uids)})
      .Add({"admin-gid", "LIST", "groups who may load, unload and apply", K::kValue,
            IdsInto("admin-gid", &access->admin_gids)})
      .Add({"admin-token-names", "LIST", "token names who may load, unload and apply",
            K::kValue, [access](const std::string& v) {
              for (absl::string_view name : absl::StrSplit(v, ',', absl::SkipWhitespace())) {
                access->admin_token_names.emplace_back(absl::StripAsciiWhitespace(name));
              }
              return absl::OkStatus();
            }})
      .Add({"tls-cert", "FILE", "TLS for --listen (with --tls-key)", K::kValue,
            StringInto(&f->grpc.tls_cert_file)})
      .Add({"tls-key", "FILE", "TLS for --listen (with --tls-cert)", K::kValue,
            StringInto(&f->grpc.tls_key_file)})
      .Add({"tls-client-ca", "FILE", "require client certificates signed by this CA", K::kValue,
            StringInto(&f->grpc.tls_client_ca_file)})
      .Add({"auth-token-file", "FILE", "require a bearer token on --listen", K::kValue,
            StringInto(&f->grpc.auth_token_file)})
      .Add({"allow-insecure-token", "", "allow tokens in clear text on a non-loopback --listen",
            K::kSwitch, [f](const std::string& v) {
              f->allow_insecure_token = v == "true";
              return absl::OkStatus();
            }});
  return t;
}

// What no single flag can check: required flags and combinations.
absl::Status CheckFlags(const FlagTable& table, DaemonFlags* flags) {
  if (flags->grpc.unix_socket.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--socket is required\n", table.Usage()));
  }
  if (flags->service.model_roots.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--model-root is required\n", table.Usage()));
  }
  if (flags->data.path.empty()) flags->data.path = flags->grpc.unix_socket + ".data";
  // The hand-over socket lives in the state directory, not beside the
  // client sockets: whoever may connect there (e.g. a root worker pod on
  // the shared socket directory) must not be able to take the daemon over.
  if (flags->handover_socket.empty() && !flags->state_dir.empty()) {
    flags->handover_socket = flags->state_dir + "/handover.sock";
    flags->handover_in_state_dir = true;
  }
  if (flags->take_over && flags->state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--take-over needs --state-dir: the successor restores the running daemon's state from "
        "its journal there");
  }
  // The TCP listener's security; mistakes here must stop the daemon, not
  // leave it open.
  const GrpcServerOptions& g = flags->grpc;
  const bool tls = !g.tls_cert_file.empty() || !g.tls_key_file.empty();
  if (tls && (g.tls_cert_file.empty() || g.tls_key_file.empty())) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!g.tls_client_ca_file.empty() && !tls) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  if ((tls || !g.auth_token_file.empty()) && g.tcp_listen.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert/--tls-key/--auth-token-file secure the TCP listener and need --listen "
        "HOST:PORT (the Unix sockets use peer credentials: --allow-uid/--allow-gid)");
  }
  if (!flags->service.access.admin_token_names.empty() && g.auth_token_file.empty()) {
    return absl::InvalidArgumentError("--admin-token-names needs --auth-token-file");
  }
  const ReaderList& members = flags->service.access.fleet_members;
  if (members.HasToken() && g.auth_token_file.empty()) {
    return absl::InvalidArgumentError("--fleet-members token:NAME needs --auth-token-file");
  }
  if (members.HasCertCn() && g.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError("--fleet-members cn:NAME needs --tls-client-ca");
  }
  if (!g.auth_token_file.empty() && !tls && !IsLoopbackListenAddress(g.tcp_listen) &&
      !flags->allow_insecure_token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file without TLS on the non-loopback address ", g.tcp_listen,
        " would send bearer tokens in clear text; add --tls-cert/--tls-key, listen on a "
        "loopback address, or pass --allow-insecure-token"));
  }
  flags->grpc.unix_socket_mode = flags->socket_mode;
  flags->data.mode = flags->socket_mode;
  flags->service.data_socket_path = flags->data.path;
  // Beside the gRPC socket (same directory as written): clients may find it
  // by name next to the socket they connected to (FetchResponse).
  flags->service.data_socket_name =
      Dirname(flags->data.path) == Dirname(flags->grpc.unix_socket) ? Basename(flags->data.path)
                                                                    : "";
  return absl::OkStatus();
}

// The teardown after SIGTERM is bounded: gRPC at the process's thread limit
// (pids cgroup, TasksMax, RLIMIT_NPROC) can leave calls it never completes,
// and the daemon must still exit. Past the grace and kTeardownSeconds more,
// SIGALRM ends the process (sockets are unlinked first thing in shutdown).
constexpr unsigned kTeardownSeconds = 2;
const char* g_data_socket_path = nullptr;  // unlinked if the teardown is stuck

void OnTeardownStuck(int) {
  if (g_data_socket_path != nullptr) ::unlink(g_data_socket_path);
  static const char kLine[] =
      "warning shutdown_stuck: teardown outlived --shutdown-grace-seconds + 2 s; exiting\n";
  (void)!::write(STDERR_FILENO, kLine, sizeof(kLine) - 1);
  ::_exit(0);
}

// Threads started before main() blocks SIGTERM/SIGINT (OpenBLAS starts its
// workers when it is loaded) do not block them: a signal the kernel hands
// to one of those, while the main thread is not in sigwait (a restore, the
// preloads), would end the process at once. There it is handed on to the
// main thread, where it stays pending for sigwait or the restore's check.
pthread_t g_main_thread;

void ForwardToMainThread(int sig) { ::pthread_kill(g_main_thread, sig); }

// What a daemon serves, as a hand-over compares it: every model's name,
// generation and served content (weights_id), by name.
std::vector<HandoverModel> ServedModels(const WeightService& service) {
  std::vector<HandoverModel> out;
  for (const ModelSummary& m : service.ListModels()) {
    out.push_back({m.name, m.generation, m.content.Hex()});
  }
  std::sort(out.begin(), out.end(),
            [](const HandoverModel& a, const HandoverModel& b) { return a.name < b.name; });
  return out;
}

// True when a process accepts connections on the Unix socket at `path`.
bool SomeoneListens(const std::string& path) {
  auto fd = ConnectUnix(path);
  return fd.ok();
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int Main(int argc, char** argv) {
#ifdef NDEBUG
  // Debian's Abseil is built with its deadlock detector on: a graph update
  // on every lock, a few percent of a Fetch. Lock order is checked at compile
  // time (clang -Wthread-safety) and by the Debug build.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  DaemonFlags flags;
  flags.service.huge_pages = HugePageMode::kAuto;  // the daemon's default (the struct's is off)
  // SO_PEERCRED reports effective ids; the daemon's own is always allowed.
  flags.service.access.daemon_uid = ::geteuid();
  FlagTable table = DaemonFlagTable(&flags);
  std::vector<std::string> cli(argv + 1, argv + argc);
  if (FlagTable::WantsHelp(cli)) {
    std::fputs(table.Usage().c_str(), stdout);
    return 0;
  }
  auto args = table.Parse(cli, [](const char* name) { return std::getenv(name); });
  if (!args.ok()) return Fail(args.status());
  if (absl::Status s = CheckFlags(table, &flags); !s.ok()) return Fail(s);
  // The effective configuration, whatever its sources.
  LogEvent(LogLevel::kInfo, "config", {{"args", absl::StrJoin(*args, " ")}});

  // Signals are taken synchronously by the main thread; every thread started
  // from here on inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  g_main_thread = ::pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardToMainThread;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGTERM, &forward, nullptr);
  sigaction(SIGINT, &forward, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Which GPUs there are, or why none: asked once (the CUDA runtime starts
  // the driver), logged, reported by stats.
  flags.service.gpus = DiscoverGpus();
  {
    std::vector<std::string> found;
    for (const GpuDevice& g : flags.service.gpus.devices) {
      found.push_back(absl::StrCat(g.ordinal, ":", g.uuid, ":", g.name));
    }
    LogEvent(LogLevel::kInfo, "gpus",
             {{"found", absl::StrJoin(found, ",")},
              {"unavailable", flags.service.gpus.unavailable}});
  }
  // What the host offers for --huge-pages (the pool as seen now; a pod's
  // hugetlb cgroup limit may allow less).
  {
    const HostPages host = ReadHostPages();
    LogEvent(LogLevel::kInfo, "host_pages",
             {{"huge_pages", HugePageModeName(flags.service.huge_pages)},
              {"hugetlb_2m_free", absl::StrCat(host.hugetlb_free)},
              {"hugetlb_2m_total", absl::StrCat(host.hugetlb_total)},
              {"shmem_thp", host.shmem_thp.empty() ? "unknown" : host.shmem_thp},
              {"shmem_thp_honoured", ShmemThpHonoured(host.shmem_thp) ? "yes" : "no"}});
    if (flags.service.huge_pages == HugePageMode::kRequire && host.hugetlb_free == 0) {
      LogEvent(LogLevel::kWarning, "huge_pages_short",
               {{"reason", "--huge-pages=require and the 2 MiB hugetlb pool has no free page: "
                           "every load of 2 MiB or more will fail until vm.nr_hugepages is "
                           "raised"}});
    }
  }
  // --state-dir: a directory of the daemon's own that no other user may
  // write, held open; every file in it is opened relative to it, never
  // through a link (state_dir.h). Checked before anything uses it.
  std::shared_ptr<const StateDir> state_dir;
  if (!flags.state_dir.empty()) {
    auto opened = StateDir::Open(flags.state_dir, ::geteuid());
    if (!opened.ok()) return Fail(Annotate(opened.status(), "--state-dir"));
    state_dir = std::move(*opened);
    if (absl::Status s = CheckStateDirEntries(*state_dir); !s.ok()) {
      return Fail(Annotate(s, "--state-dir"));
    }
  }
  const HandoverSocket handover_at{flags.handover_in_state_dir ? state_dir : nullptr,
                                   flags.handover_in_state_dir ? "handover.sock"
                                                               : flags.handover_socket};
  // --take-over: the running daemon's memory and sockets, if one runs.
  std::unique_ptr<HandoverClient> taking;
  std::unique_ptr<DonatedCheckpoints> donated;
  UniqueFd taken_handover_fd;
  std::string took_over_from_host;
  if (flags.take_over) {
    auto begun = HandoverClient::Begin(handover_at, absl::Seconds(150));
    if (absl::IsNotFound(begun.status())) {
      LogEvent(LogLevel::kInfo, "take_over_none",
               {{"handover_socket", flags.handover_socket},
                {"reason", std::string(begun.status().message())},
                {"action", "starting as usual"}});
    } else if (!begun.ok()) {
      return Fail(begun.status());
    } else {
      taking = std::move(*begun);
      HandoverReceived& got = taking->received();
      // The state comes from the predecessor's journal: the same directory.
      struct stat theirs, mine;
      if (::stat(got.state_dir.c_str(), &theirs) != 0 || ::fstat(state_dir->fd(), &mine) != 0 ||
          theirs.st_dev != mine.st_dev || theirs.st_ino != mine.st_ino) {
        return Fail(absl::FailedPreconditionError(absl::StrCat(
            "--take-over: the running daemon journals in --state-dir ", got.state_dir,
            ", this one in ", flags.state_dir, "; give both the same directory")));
      }
      LogEvent(LogLevel::kInfo, "take_over_begin",
               {{"predecessor_pid", absl::StrCat(got.pid)},
                {"checkpoints", absl::StrCat(got.checkpoints.size())},
                {"segment_bytes", absl::StrCat(got.segment_bytes)},
                {"verify", AdoptVerifyName(flags.take_over_verify)}});
      donated = std::make_unique<DonatedCheckpoints>(flags.take_over_verify);
      for (DonatedCheckpoint& c : got.checkpoints) donated->Add(std::move(c));
      flags.service.donated = donated.get();
      flags.grpc.adopt_unix_listen_fd = got.grpc_listen_fd.release();
      flags.data.adopt_listen_fd = got.data_listen_fd.release();
      taken_handover_fd = std::move(got.handover_listen_fd);
      if (got.host != HostName()) took_over_from_host = got.host;
      // The sockets handed over must be the ones this daemon was told to
      // serve (a different --socket would advertise paths nobody serves).
      for (const auto& [fd, want, what] :
           {std::tuple<int, std::string, const char*>{flags.grpc.adopt_unix_listen_fd,
                                                      flags.grpc.unix_socket, "--socket"},
            {flags.data.adopt_listen_fd, flags.data.path, "--data-socket"}}) {
        auto bound = BoundUnixPath(fd);
        struct stat a, b;
        if (!bound.ok() || ::stat(bound->c_str(), &a) != 0 || ::stat(want.c_str(), &b) != 0 ||
            a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
          return Fail(absl::FailedPreconditionError(absl::StrCat(
              "--take-over: the running daemon's ", what, " is ",
              bound.ok() ? *bound : bound.status().ToString(), ", this one's ", want)));
        }
      }
    }
  }
  // Two daemons must not share sockets or a state directory: one already
  // serving here is refused before anything of it is touched.
  if (taking == nullptr && SomeoneListens(flags.grpc.unix_socket)) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "a daemon already serves on ", flags.grpc.unix_socket,
        flags.take_over
            ? absl::StrCat(" and offers no hand-over at ", flags.handover_socket,
                           " (it is still restoring, runs with another or no --state-dir, or "
                           "predates hand-overs); retry later, or stop it first")
            : "; stop it first, or start this one with --take-over")));
  }
  // --state-dir: the journal of what was served, replayed into a restore
  // plan; from here on every change is journaled (into journal.new until
  // the restore is done).
  std::unique_ptr<StateJournal> journal;
  RestorePlan plan;
  if (!flags.state_dir.empty()) {
    auto opened = StateJournal::Open(state_dir);
    if (!opened.ok()) return Fail(Annotate(opened.status(), "--state-dir"));
    journal = std::move(*opened);
    for (const JournalProblem& p : journal->previous().problems) {
      LogEvent(LogLevel::kWarning, "state_journal_damaged",
               {{"dir", flags.state_dir}, {"offset", absl::StrCat(p.offset)}, {"what", p.what}});
    }
    plan = PlanRestore(journal->previous().records);
    flags.service.state_dir = state_dir;
    StateJournal* j = journal.get();
    flags.service.on_state_change = [j](const StateRecord& r) {
      if (absl::Status s = j->Append(r); !s.ok()) {
        LogEvent(LogLevel::kError, "state_journal_failed",
                 {{"entry", DescribeRecord(r)}, {"error", s.ToString()}});
      }
    };
  }
  const bool restoring = plan.entries() > 0;
  if (restoring && taking == nullptr) {
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "weightd is restoring its state from ", flags.state_dir,
        " (--state-dir); retry when health says SERVING"));
    // Loads, unloads and applies wait for the restore in any case (they
    // would race with it); with --serve-during-restore the rest is served.
    flags.grpc.changes_closed_at_start = why;
    if (!flags.serve_during_restore) flags.grpc.closed_at_start = why;
  }
  // Before the service, which borrows it (loads ask peers for bytes), and
  // destroyed after it.
  std::unique_ptr<Fleet> fleet;
  if (!flags.peers.addresses.empty() || !flags.peers.dns.empty()) {
    flags.peers.tls_cert_file = flags.grpc.tls_cert_file;
    flags.peers.tls_key_file = flags.grpc.tls_key_file;
    // Room for a true answer and every stream's ranges in flight.
    flags.peers.receive_budget_bytes =
        (32ull << 20) + static_cast<uint64_t>(flags.service.peer_streams) * (8ull << 20);
    auto started = Fleet::Start(flags.peers);
    if (!started.ok()) return Fail(started.status());
    fleet = std::move(*started);
    flags.grpc.peers = fleet->table();
    flags.service.peers = fleet->checkpoint_peers();
  }
  auto service = WeightService::Create(flags.service);
  if (!service.ok()) return Fail(service.status());
  // Preloads of names a restore brought back are skipped (the journal's
  // entry is newer than the command line's).
  RestoreReport restored;
  auto preload = [&]() -> absl::Status {
    for (const Preload& p : flags.preloads) {
      if ((*service)->GetModel(p.name).ok()) {
        LogEvent(LogLevel::kInfo, "preload_skipped",
                 {{"model", p.name}, {"reason", "restored from --state-dir"}});
        continue;
      }
      if (restored.skipped_names.contains(p.name)) {
        // The restore refused it (e.g. its files changed): not loaded
        // behind its back.
        LogEvent(LogLevel::kWarning, "preload_skipped",
                 {{"model", p.name},
                  {"reason", "the restore skipped its journal entry (restore_skipped)"}});
        continue;
      }
      std::string profile;
      if (!p.profile.empty()) {
        WD_ASSIGN_OR_RETURN(profile, ReadFileToString(p.profile, kMaxProfileBytes));
      }
      auto loaded = (*service)->LoadModel(p.name, p.path, profile, nullptr);
      if (!loaded.ok()) return loaded.status();
    }
    return absl::OkStatus();
  };
  // Saved published weights no restored model serves are garbage (before
  // any change is served: nothing new is being saved yet).
  auto keep_published = [&](const std::set<std::string>& names) {
    PublishedStore* store = (*service)->published_store();
    if (store == nullptr) return;
    store->KeepOnly(names);
  };
  auto term_pending = [&signals]() {
    sigset_t pending;
    if (sigpending(&pending) != 0) return false;
    for (int s : {SIGTERM, SIGINT}) {
      if (sigismember(&signals, s) && sigismember(&pending, s)) return true;
    }
    return false;
  };
  // A damaged journal may have lost a record of a higher generation
  // number: restored models number past a wide margin then.
  const uint64_t margin =
      journal == nullptr || journal->previous().problems.empty() ? 0 : kDamagedJournalMargin;
  if (taking != nullptr) {
    // Taking over: the state comes back before this daemon serves (the
    // predecessor serves meanwhile), its checkpoints adopted, not read.
    if (restoring) {
      const absl::Time start = absl::Now();
      restored = RestoreState(**service, plan, journal.get(), term_pending, margin);
      if (restored.interrupted) {
        LogEvent(LogLevel::kInfo, "stopped",
                 {{"reason", "signalled during the take-over; the running daemon serves on"}});
        return 0;
      }
      LogEvent(LogLevel::kInfo, "take_over_restored",
               {{"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))},
                {"adopted", absl::StrCat(donated->adopted())},
                {"read_instead", absl::StrCat(donated->refused())}});
    }
    if (absl::Status s = preload(); !s.ok()) return Fail(s);
    if (size_t unused = donated->DropUnused(); unused > 0) {
      LogEvent(LogLevel::kInfo, "take_over_unused",
               {{"checkpoints", absl::StrCat(unused)},
                {"reason", "no restored model serves their files"}});
    }
    // Only a successor serving exactly what the predecessor serves takes
    // over (the predecessor serves on otherwise).
    if (!restored.skipped_names.empty()) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "--take-over: the restore skipped ", absl::StrJoin(restored.skipped_names, ", "),
          " (restore_skipped in the log); the running daemon serves on")));
    }
    {
      const std::vector<HandoverModel> mine = ServedModels(**service);
      const std::vector<HandoverModel>& theirs = taking->received().models;  // by name
      if (mine != theirs) {
        auto show = [](const std::vector<HandoverModel>& v) {
          std::vector<std::string> out;
          for (const HandoverModel& m : v) {
            out.push_back(absl::StrCat(m.name, "@", m.generation, ":", m.content.substr(0, 12)));
          }
          return absl::StrJoin(out, " ");
        };
        return Fail(absl::FailedPreconditionError(absl::StrCat(
            "--take-over: restored [", show(mine), "] but the running daemon serves [",
            show(theirs), "]; it serves on")));
      }
    }
    if (term_pending()) {
      LogEvent(LogLevel::kInfo, "stopped",
               {{"reason", "signalled during the take-over; the running daemon serves on"}});
      return 0;
    }
    auto next_lease = taking->Ready(absl::Seconds(30));
    if (!next_lease.ok()) return Fail(next_lease.status());
    (*service)->leases()->InheritIdsBelow(*next_lease + kLeaseIdMargin);
  } else if (!restoring) {
    if (absl::Status s = preload(); !s.ok()) return Fail(s);
    if (journal != nullptr) {
      if (absl::Status s = journal->Commit(); !s.ok()) return Fail(s);
      keep_published({});
    }
  }
  WeightService* svc = service->get();
  flags.data.authorize = [svc](const PeerIdentity& peer) {
    return svc->access().AdmitPeer(Principal::UnixPeer(peer));
  };
  flags.data.authorize_attach = [svc](const PeerIdentity& peer, uint64_t lease_id) {
    return svc->CheckLeaseUse(lease_id, Principal::UnixPeer(peer));
  };
  flags.data.on_push = [svc](uint64_t bytes) { svc->RecordPush(bytes); };
  flags.data.stage = [svc](const PeerIdentity& peer, uint64_t session,
                           absl::string_view token) -> absl::StatusOr<UniqueFd> {
    // Writing a publish's bytes is publishing: admins only, as on gRPC
    // (and readers of the model: StagePublish checks).
    const Principal caller = Principal::UnixPeer(peer);
    WD_RETURN_IF_ERROR(svc->access().CheckAdmin(caller, "publish weights"));
    return svc->StagePublish(caller, session, absl::BytesToHexString(token));
  };
  flags.data.push_writers = {std::make_shared<CudaPushWriter>(&svc->gpus())};
  flags.data.host_memory = svc->host_memory();
  auto data = ShmDataServer::Start(flags.data, (*service)->leases());
  if (!data.ok()) return Fail(data.status());
  // Taking over: the socket files stay whatever happens until DONE (the
  // predecessor may be serving on them again).
  if (taking != nullptr) (*data)->KeepSocketFile(true);
  auto grpc = GrpcServer::Start(flags.grpc, service->get());
  if (!grpc.ok()) return Fail(grpc.status());
  if (taking != nullptr) (*grpc)->KeepSocketFile(true);
  std::unique_ptr<MetricsServer> metrics;
  if (!flags.metrics_listen.empty()) {
    auto started = MetricsServer::Start(flags.metrics_listen, service->get());
    if (!started.ok()) return Fail(started.status());
    metrics = std::move(*started);
  }
  if (taking != nullptr) {
    // Serving on the predecessor's sockets: it may go. Without its DONE it
    // may be serving again: exit, leaving the socket files.
    if (absl::Status s = taking->Started(absl::Seconds(30)); !s.ok()) {
      return Fail(absl::UnavailableError(absl::StrCat(
          "--take-over: the running daemon did not confirm the hand-over (", s.ToString(),
          "); it serves on")));
    }
    taking.reset();
    (*data)->KeepSocketFile(false);
    (*grpc)->KeepSocketFile(false);
    // The journal is this daemon's now (the predecessor wrote its last
    // record before the manifest). Saved published weights are left as
    // they are: the predecessor's restore removed what no model serves.
    if (absl::Status s = journal->Commit(); !s.ok()) {
      LogEvent(LogLevel::kError, "state_journal_failed",
               {{"entry", "commit after the take-over"}, {"error", s.ToString()}});
    }
    LogEvent(LogLevel::kInfo, "taken_over", {});
  } else if (restoring) {
    // Serving (health NOT_SERVING, calls refused UNAVAILABLE unless
    // --serve-during-restore) while the models come back. A SIGTERM ends it
    // between two entries, and the old journal stays as it was.
    restored = RestoreState(**service, plan, journal.get(), term_pending, margin);
    if (!restored.interrupted) {
      if (absl::Status s = preload(); !s.ok()) return Fail(s);
      if (absl::Status s = journal->Commit(); !s.ok()) return Fail(s);
      keep_published(restored.published_files);
      (*grpc)->Restored();
    }
  }
  // A successor takes over through the hand-over socket (handover.h).
  std::atomic<bool> handed_over{false};
  HandoverServer::Hooks hooks;
  GrpcServer* g = grpc->get();
  ShmDataServer* d = data->get();
  std::atomic<HandoverServer*> handover_raw{nullptr};
  hooks.begin = [&, g, d, svc](int64_t pid,
                                const std::string& host) -> absl::StatusOr<HandoverOffer> {
    if (handover_raw.load() == nullptr) return absl::UnavailableError("still starting");
    if (!took_over_from_host.empty() && host == took_over_from_host) {
      // A restarted container of the pod this daemon replaced.
      return absl::FailedPreconditionError(absl::StrCat(
          "this daemon took over from host ", host, "; it does not hand back to it"));
    }
    if (flags.state_dir.empty()) {
      return absl::FailedPreconditionError(
          "this daemon runs without --state-dir: a successor could not restore what it serves");
    }
    if (restoring && restored.interrupted) {
      return absl::FailedPreconditionError("this daemon did not finish restoring its state");
    }
    g->CloseChanges(absl::UnavailableError(absl::StrCat(
        "weightd is handing over to a new daemon (pid ", pid, "); retry in a moment")));
    if (int64_t left = g->WaitChangesIdle(absl::Now() + absl::Seconds(30)); left > 0) {
      return absl::UnavailableError(absl::StrCat(
          left, " loads, applies or publishes still ran after 30 s; try again later"));
    }
    if (PublishedStore* store = svc->published_store();
        store != nullptr && !store->WaitIdle(absl::Seconds(60))) {
      return absl::UnavailableError("published weights were still being saved after 60 s");
    }
    return MakeHandoverOffer(flags.state_dir, g->unix_listen_fd(), d->listen_fd(),
                             handover_raw.load()->listen_fd(), svc->resident_checkpoints(),
                             svc->checkpoint_segment_bytes(), ServedModels(*svc));
  };
  hooks.pause = [&, g, d, svc]() -> uint64_t {
    g->Restoring(absl::UnavailableError("weightd is handing over to a new daemon; retry"));
    g->PauseAccepting();
    d->Pause();
    metrics.reset();  // its port, for the successor
    return svc->leases()->next_id();
  };
  hooks.resume = [&, g, d, svc](const absl::Status& why) {
    g->ResumeAccepting();
    d->Resume();
    g->Restored();
    if (!flags.metrics_listen.empty() && metrics == nullptr) {
      auto again = MetricsServer::Start(flags.metrics_listen, svc);
      if (again.ok()) {
        metrics = std::move(*again);
      } else {
        LogEvent(LogLevel::kError, "metrics_restart_failed", {{"error", again.status().ToString()}});
      }
    }
  };
  hooks.handed_over = [&, g, d]() {
    handed_over.store(true);
    g->KeepSocketFile(true);
    d->KeepSocketFile(true);
    ::pthread_kill(g_main_thread, SIGTERM);
  };
  std::unique_ptr<HandoverServer> handover;
  if (!flags.handover_socket.empty()) {
    auto started = HandoverServer::Start(handover_at, std::move(hooks),
                                         HandoverServer::Timeouts(),
                                         taken_handover_fd.valid() ? taken_handover_fd.release()
                                                                   : -1);
    if (started.ok()) {
      handover = std::move(*started);
      handover_raw.store(handover.get());
    } else {
      // Serving matters more than upgrades without a reload.
      LogEvent(LogLevel::kError, "handover_unavailable",
               {{"handover_socket", flags.handover_socket},
                {"error", started.status().ToString()},
                {"effect", "no successor can take this daemon over"}});
    }
  }
  LogEvent(LogLevel::kInfo, "serving",
           {{"socket", flags.grpc.unix_socket},
            {"data_socket", flags.data.path},
            {"max_data_connections", absl::StrCat((*data)->max_connections())},
            {"max_data_connections_per_uid", absl::StrCat((*data)->max_connections_per_uid())},
            {"listen", flags.grpc.tcp_listen},
            {"metrics_listen", flags.metrics_listen},
            {"pid", absl::StrCat(getpid())}});

  int sig = 0;
  sigwait(&signals, &sig);
  signal(SIGALRM, OnTeardownStuck);
  alarm(static_cast<unsigned>(absl::ToInt64Seconds(flags.shutdown_grace)) + kTeardownSeconds);
  // A successor that took over (or may have: stopped after GO) owns the
  // sockets' paths from here on.
  if (handover != nullptr) handover->Stop();
  const bool successor = handover != nullptr && handover->successor_may_serve();
  if (successor) {
    (*grpc)->KeepSocketFile(true);
    (*data)->KeepSocketFile(true);
  }
  LogEvent(LogLevel::kInfo, "shutdown",
           {{"signal", strsignal(sig)},
            {"reason", handed_over.load() ? "handed over to a successor" : "signal"}});
  if (!successor) g_data_socket_path = flags.data.path.c_str();
  (*grpc)->Shutdown(flags.shutdown_grace);
  metrics.reset();
  (*data)->Stop();
  handover.reset();
  grpc->reset();
  fleet.reset();
  data->reset();
  service->reset();
  LogEvent(LogLevel::kInfo, "stopped", {});
  return 0;
}

}  // namespace
}  // namespace weightd

int main(int argc, char** argv) { return weightd::Main(argc, argv); }
