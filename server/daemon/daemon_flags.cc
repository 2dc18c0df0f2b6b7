#include "server/daemon/daemon_flags.h"

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fd.h"
#include "common/file_opener.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/grpc/call_auth.h"
#include "server/memory/huge_pages.h"

namespace weightd {
namespace {

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

// The TCP listener's security; mistakes here must stop the daemon, not
// leave it open.
absl::Status CheckTcpSecurity(const DaemonFlags& flags) {
  const GrpcServerOptions& g = flags.grpc;
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
  if (!flags.service.access.admin_token_names.empty() && g.auth_token_file.empty()) {
    return absl::InvalidArgumentError("--admin-token-names needs --auth-token-file");
  }
  const ReaderList& members = flags.service.access.fleet_members;
  if (members.HasToken() && g.auth_token_file.empty()) {
    return absl::InvalidArgumentError("--fleet-members token:NAME needs --auth-token-file");
  }
  if (members.HasCertCn() && g.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError("--fleet-members cn:NAME needs --tls-client-ca");
  }
  if (!g.auth_token_file.empty() && !tls && !IsLoopbackListenAddress(g.tcp_listen) &&
      !flags.allow_insecure_token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file without TLS on the non-loopback address ", g.tcp_listen,
        " would send bearer tokens in clear text; add --tls-cert/--tls-key, listen on a "
        "loopback address, or pass --allow-insecure-token"));
  }
  return absl::OkStatus();
}

}  // namespace

DaemonFlags::DaemonFlags() {
  service.huge_pages = HugePageMode::kAuto;  // the daemon's default (the struct's is off)
  // SO_PEERCRED reports effective ids; the daemon's own is always allowed.
  service.access.daemon_uid = ::geteuid();
}

void AddListenerFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"socket", "PATH", "gRPC on this Unix socket (required)", K::kValue,
         StringInto(&f->grpc.unix_socket)})
      .Add({"data-socket", "PATH", "fd passing for shm clients (default <socket>.data)", K::kValue,
            StringInto(&f->data.path)})
      .Add({"listen", "HOST:PORT", "gRPC over TCP too, for remote clients", K::kValue,
            StringInto(&f->grpc.tcp_listen)})
      .Add({"metrics-listen", "HOST:PORT", "Prometheus /metrics", K::kValue,
            StringInto(&f->metrics_listen)});
}

void AddModelFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"model-root", "DIR", "load paths must resolve inside one (required)", K::kList,
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
            }});
}

void AddSourceFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"model-source", "PREFIX",
         "URLs that may be loaded (s3://bucket/prefix/, https://host/path/; http:// only when a "
         "prefix says so); a load of a URL outside every one is refused before any request",
         K::kList, AppendInto(&f->model_sources)})
      .Add({"s3-endpoint", "URL",
            "the S3 API's http(s)://host[:port] (default https://s3.REGION.amazonaws.com)",
            K::kValue, StringInto(&f->source.s3_endpoint)})
      .Add({"s3-region", "REGION",
            "the region S3 requests are signed for (default AWS_REGION, AWS_DEFAULT_REGION, "
            "else us-east-1)",
            K::kValue, StringInto(&f->source.s3_region)})
      .Add({"s3-path-style", "on|off",
            "ENDPOINT/BUCKET/KEY instead of BUCKET.ENDPOINT/KEY (default on with --s3-endpoint)",
            K::kValue, OneOf("s3-path-style", "on or off", [f](const std::string& v) {
              if (v != "on" && v != "off") return false;
              f->source.s3_path_style = v == "on";
              return true;
            })})
      .Add({"source-streams", "N", "ranged GETs a URL load runs at once (1..256, default 8)",
            K::kValue, NumberInto("source-streams", &f->service.source_streams, 1, 256)})
      .Add({"source-chunk-bytes", "N",
            "bytes per ranged GET of a URL load (1 MiB..1 GiB, default 16 MiB)", K::kValue,
            Uint64Into("source-chunk-bytes", &f->service.source_chunk_bytes, 1ull << 20,
                       1ull << 30)})
      .Add({"source-retries", "N",
            "retries of a failed request (5xx, reset, short body, stall), resuming where it "
            "stopped, with backoff from 100 ms to 5 s, full jitter (0..100, default 5)",
            K::kValue, NumberInto("source-retries", &f->source.retries, 0, 100)})
      .Add({"source-timeout-seconds", "S",
            "a request moving less than 1 KiB/s for S seconds is abandoned (1..3600, default "
            "30)",
            K::kValue,
            [f](const std::string& v) -> absl::Status {
              uint64_t n = 0;
              WD_RETURN_IF_ERROR(Uint64Into("source-timeout-seconds", &n, 1, 3600)(v));
              f->source.stall_timeout = absl::Seconds(static_cast<int64_t>(n));
              return absl::OkStatus();
            }})
      .Add({"source-ca-file", "FILE", "extra CA certificates for https sources", K::kValue,
            StringInto(&f->source.ca_file)})
      .Add({"https-bearer-token-file", "FILE",
            "Authorization: Bearer for https sources (read again for every request)",
            K::kValue, StringInto(&f->source.bearer_token_file)});
}

void AddStateFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"state-dir", "DIR",
         "journal what is served there; restore it at start-up (docs/restarts.md)",
         K::kValue, StringInto(&f->state_dir)})
      .Add({"serve-during-restore", "", "answer calls while the state is restored", K::kSwitch,
            [f](const std::string& v) {
              f->serve_during_restore = v == "true";
              return absl::OkStatus();
            }})
      .Add({"take-over", "",
            "take over the daemon running on these sockets (its memory, sockets and state; "
            "docs/restarts.md); none running: start as usual",
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
            })});
}

void AddPeerFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  AccessPolicyOptions* access = &f->service.access;
  t.Add({"peers", "HOST:PORT,...",
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
      .Add({"peer-transport", "auto|ucx|grpc",
            "how a load reads ranges from peers, and whether this daemon offers UCX to them: "
            "grpc (ReadCheckpoint streams, default), auto (UCX where the holder offers it), "
            "ucx (UCX only); UCX trusts its fabric: README, Fleets",
            K::kValue,
            [f](const std::string& v) -> absl::Status {
              WD_ASSIGN_OR_RETURN(f->peers.transport, ParsePeerTransport(v));
              return absl::OkStatus();
            }})
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
            }});
}

void AddServingFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"warm-reserve-bytes", "N", "pre-faulted output segments kept ready (0 = off)",
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
            K::kValue, NumberInto("max-watch-streams", &f->grpc.max_watch_streams, 1, 65536)});
}

void AddServiceFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"threads", "N", "materialization workers (1..256): one fetch computes on up to N threads, its own included; concurrent fetches share the N-1 helpers", K::kValue,
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
                       kHugePageBytes)});
}

void AddLogFlags(FlagTable& t) {
  using K = FlagSpec::Kind;
  t.Add({"log-format", "text|json", "log lines", K::kValue,
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
            })});
}

void AddAccessFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  AccessPolicyOptions* access = &f->service.access;
  t.Add({"socket-mode", "OCTAL", "mode of both socket files (default 0660)", K::kValue,
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
            }});
}

void AddTlsFlags(FlagTable& t, DaemonFlags* f) {
  using K = FlagSpec::Kind;
  t.Add({"tls-cert", "FILE", "TLS for --listen (with --tls-key)", K::kValue,
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
}
// Every daemon flag, once: name, value, help, where it goes (docs/DESIGN.md §4.1).
// The usage text, WEIGHTD_<FLAG> variables and config-file keys come from
// this table (server/base/flag_table.h).
FlagTable DaemonFlagTable(DaemonFlags* f) {
  FlagTable t("weightd", "WEIGHTD");
  AddListenerFlags(t, f);
  AddModelFlags(t, f);
  AddSourceFlags(t, f);
  AddStateFlags(t, f);
  AddPeerFlags(t, f);
  AddServingFlags(t, f);
  AddServiceFlags(t, f);
  AddLogFlags(t);
  AddAccessFlags(t, f);
  AddTlsFlags(t, f);
  return t;
}

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
  WD_RETURN_IF_ERROR(CheckTcpSecurity(*flags));
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

}  // namespace weightd
