// weightd: the per-node weight-serving daemon. Flags (DESIGN §3) are parsed
// here and only here, into the Options structs of the parts they configure.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/grpc_server.h"
#include "server/metrics/prometheus_exporter.h"
#include "server/service/weight_service.h"
#include "server/transport/shm_server.h"

namespace weightd {
namespace {

constexpr char kUsage[] =
    "usage: weightd --socket PATH [--data-socket PATH] [--listen HOST:PORT]\n"
    "               [--metrics-listen HOST:PORT] --model-root DIR ...\n"
    "               [--host-memory-bytes N] [--preload NAME=PATH[@PROFILE]] ...\n"
    "               [--warm-reserve-bytes N] [--reserve-chunk-bytes N]\n"
    "               [--lease-ttl-seconds N] [--shutdown-grace-seconds N]\n"
    "               [--threads N] [--log-format text|json]\n"
    "               [--log-level debug|info|warning|error]\n"
    "               [--socket-mode OCTAL] [--config FILE]\n"
    "               [--allow-uid LIST] [--allow-gid LIST] [--admin-uid LIST]\n"
    "               [--admin-gid LIST] [--admin-token-names LIST]\n"
    "               [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]\n"
    "               [--auth-token-file FILE] [--allow-insecure-token]\n"
    "               [--max-data-connections N] [--max-data-connections-per-uid N]\n"
    "               [--max-watch-streams N]\n"
    "Every flag may also be set as WEIGHTD_<FLAG> (e.g. WEIGHTD_MODEL_ROOT=/a,/b)\n"
    "or in a config file of \"flag = value\" lines (--config or WEIGHTD_CONFIG).\n";

// Profiles are small JSON documents; anything larger is a mistake.
constexpr uint64_t kMaxProfileBytes = 64ull << 20;

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
};

// Every flag also comes from the environment (WEIGHTD_<FLAG>, dashes as
// underscores, e.g. WEIGHTD_MODEL_ROOT; lists comma-separated) and from a
// config file (--config FILE or WEIGHTD_CONFIG: one "flag = value" per line,
// '#' comments, a repeated flag adds a value). The command line beats the
// environment, which beats the file; for list flags (model-root, preload) the
// strongest source that names the flag gives the whole list.
constexpr const char* kFlagNames[] = {
    "socket", "data-socket", "listen", "metrics-listen", "model-root", "host-memory-bytes",
    "preload", "lease-ttl-seconds", "shutdown-grace-seconds", "threads", "log-format",
    "log-level", "socket-mode", "warm-reserve-bytes", "reserve-chunk-bytes", "allow-uid",
    "allow-gid", "admin-uid", "admin-gid", "admin-token-names", "tls-cert", "tls-key", "tls-client-ca", "auth-token-file",
    "allow-insecure-token", "max-data-connections", "max-data-connections-per-uid",
    "max-watch-streams"};

// Flags that take no value on the command line; from the environment or a
// config file they take true/false.
bool IsSwitchFlag(const std::string& name) { return name == "allow-insecure-token"; }

struct FlagSource {
  std::string origin;                               // "file", "env", "argv"
  std::vector<std::pair<std::string, std::string>> values;  // flag -> value, in order
};

absl::StatusOr<FlagSource> ReadConfigFile(const std::string& path) {
  FlagSource src{absl::StrCat("config ", path), {}};
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open config file ", path));
  char line[4096];
  int number = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    ++number;
    std::string text(absl::StripAsciiWhitespace(line));
    if (text.empty() || text[0] == '#') continue;
    size_t eq = text.find('=');
    if (eq == std::string::npos) {
      std::fclose(f);
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": expected flag = value"));
    }
    std::string key(absl::StripAsciiWhitespace(text.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(text.substr(eq + 1)));
    if (absl::StartsWith(key, "--")) key = key.substr(2);
    src.values.emplace_back(key, value);
  }
  std::fclose(f);
  return src;
}

FlagSource ReadEnvironment() {
  FlagSource src{"environment", {}};
  for (const char* name : kFlagNames) {
    std::string var = absl::StrCat("WEIGHTD_", absl::AsciiStrToUpper(name));
    for (char& c : var) c = c == '-' ? '_' : c;
    const char* value = std::getenv(var.c_str());
    if (value == nullptr) continue;
    bool list = std::string(name) == "model-root" || std::string(name) == "preload";
    if (list) {
      for (absl::string_view v : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        src.values.emplace_back(name, std::string(v));
      }
    } else {
      src.values.emplace_back(name, value);
    }
  }
  return src;
}

// Merges file < env < argv into one argv-style list.
absl::StatusOr<std::vector<std::string>> CollectArgs(int argc, char** argv) {
  std::vector<std::string> cli(argv + 1, argv + argc);
  std::string config;
  if (const char* env = std::getenv("WEIGHTD_CONFIG")) config = env;
  std::vector<std::string> rest;
  for (size_t i = 0; i < cli.size(); ++i) {
    if (cli[i] == "--config" && i + 1 < cli.size()) {
      config = cli[++i];
    } else if (absl::StartsWith(cli[i], "--config=")) {
      config = cli[i].substr(9);
    } else {
      rest.push_back(cli[i]);
    }
  }
  std::vector<FlagSource> sources;
  if (!config.empty()) {
    WD_ASSIGN_OR_RETURN(FlagSource file, ReadConfigFile(config));
    sources.push_back(std::move(file));
  }
  sources.push_back(ReadEnvironment());
  std::vector<std::string> merged;
  std::set<std::string> on_cli;
  for (const std::string& a : rest) {
    if (!absl::StartsWith(a, "--")) continue;
    on_cli.insert(a.substr(2, a.find('=') == std::string::npos ? std::string::npos : a.find('=') - 2));
  }
  // Later sources override earlier ones flag by flag.
  std::map<std::string, std::vector<std::string>> chosen;
  std::vector<std::string> order;
  for (const FlagSource& src : sources) {
    std::map<std::string, std::vector<std::string>> mine;
    for (const auto& [k, v] : src.values) {
      if (std::find(std::begin(kFlagNames), std::end(kFlagNames), k) == std::end(kFlagNames)) {
        return absl::InvalidArgumentError(absl::StrCat(src.origin, ": unknown flag \"", k, "\""));
      }
      mine[k].push_back(v);
    }
    for (auto& [k, vs] : mine) {
      if (!chosen.count(k)) order.push_back(k);
      chosen[k] = std::move(vs);
    }
  }
  for (const std::string& k : order) {
    if (on_cli.count(k)) continue;
    for (const std::string& v : chosen[k]) {
      if (IsSwitchFlag(k)) {
        merged.push_back(absl::StrCat("--", k, "=", v));
        continue;
      }
      merged.push_back("--" + k);
      merged.push_back(v);
    }
  }
  merged.insert(merged.end(), rest.begin(), rest.end());
  return merged;
}

absl::Status ParseFlags(const std::vector<std::string>& args, DaemonFlags* flags) {
  mode_t mode = 0660;
  bool allow_insecure_token = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    bool inline_value = false;
    if (size_t eq = flag.find('='); absl::StartsWith(flag, "--") && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    auto next = [&]() -> absl::StatusOr<std::string> {
      if (inline_value) return value;
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
      return args[++i];
    };
    auto number = [&](uint64_t* out) -> absl::Status {
      auto v = next();
      if (!v.ok()) return v.status();
      if (!absl::SimpleAtoi(*v, out)) {
        return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", *v, "\" is not a number"));
      }
      return absl::OkStatus();
    };
    // Comma-separated numeric ids; a repeated flag adds to the list.
    auto ids = [&](std::vector<uint32_t>* out) -> absl::Status {
      auto text = next();
      if (!text.ok()) return text.status();
      WD_ASSIGN_OR_RETURN(std::vector<uint32_t> parsed, ParseIdList(flag, *text));
      out->insert(out->end(), parsed.begin(), parsed.end());
      return absl::OkStatus();
    };
    AccessPolicyOptions& access = flags->service.access;
    absl::StatusOr<std::string> v;
    uint64_t n = 0;
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (flag == "--socket") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.unix_socket = *v;
    } else if (flag == "--data-socket") {
      if (!(v = next()).ok()) return v.status();
      flags->data.path = *v;
    } else if (flag == "--listen") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.tcp_listen = *v;
    } else if (flag == "--metrics-listen") {
      if (!(v = next()).ok()) return v.status();
      flags->metrics_listen = *v;
    } else if (flag == "--model-root") {
      if (!(v = next()).ok()) return v.status();
      flags->service.model_roots.push_back(*v);
      // "--model-root A B C": further plain words are roots too.
      while (!inline_value && i + 1 < args.size() && !absl::StartsWith(args[i + 1], "--")) {
        flags->service.model_roots.push_back(args[++i]);
      }
    } else if (flag == "--host-memory-bytes") {
      WD_RETURN_IF_ERROR(number(&n));
      flags->service.host_memory_bytes = n;
    } else if (flag == "--warm-reserve-bytes") {
      WD_RETURN_IF_ERROR(number(&n));
      flags->service.warm_reserve_bytes = n;
    } else if (flag == "--reserve-chunk-bytes") {
      WD_RETURN_IF_ERROR(number(&n));
      if (n < 4096) return absl::InvalidArgumentError("--reserve-chunk-bytes must be >= 4096");
      flags->service.reserve_chunk_bytes = n;
    } else if (flag == "--lease-ttl-seconds") {
      WD_RETURN_IF_ERROR(number(&n));
      flags->service.lease_idle_ttl = absl::Seconds(static_cast<int64_t>(n));
    } else if (flag == "--shutdown-grace-seconds") {
      WD_RETURN_IF_ERROR(number(&n));
      if (n > 3600) return absl::InvalidArgumentError("--shutdown-grace-seconds must be 0..3600");
      flags->shutdown_grace = absl::Seconds(static_cast<int64_t>(n));
    } else if (flag == "--threads") {
      WD_RETURN_IF_ERROR(number(&n));
      if (n < 1 || n > 256) return absl::InvalidArgumentError("--threads must be 1..256");
      flags->service.worker_threads = static_cast<int>(n);
    } else if (flag == "--max-data-connections") {
      WD_RETURN_IF_ERROR(number(&n));
      flags->data.max_connections = n;  // 0: from the open-file limit
    } else if (flag == "--max-data-connections-per-uid") {
      WD_RETURN_IF_ERROR(number(&n));
      flags->data.max_connections_per_uid = n;  // 0: half the total
    } else if (flag == "--max-watch-streams") {
      WD_RETURN_IF_ERROR(number(&n));
      if (n < 1 || n > 65536) {
        return absl::InvalidArgumentError("--max-watch-streams must be 1..65536");
      }
      flags->grpc.max_watch_streams = static_cast<int>(n);
    } else if (flag == "--socket-mode") {
      if (!(v = next()).ok()) return v.status();
      char* end = nullptr;
      long m = std::strtol(v->c_str(), &end, 8);
      if (v->empty() || *end != '\0' || m < 0 || m > 0777) {
        return absl::InvalidArgumentError(absl::StrCat("--socket-mode: bad octal mode \"", *v, "\""));
      }
      mode = static_cast<mode_t>(m);
    } else if (flag == "--allow-uid") {
      WD_RETURN_IF_ERROR(ids(&access.allow_uids));
    } else if (flag == "--allow-gid") {
      WD_RETURN_IF_ERROR(ids(&access.allow_gids));
    } else if (flag == "--admin-uid") {
      WD_RETURN_IF_ERROR(ids(&access.admin_uids));
    } else if (flag == "--admin-gid") {
      WD_RETURN_IF_ERROR(ids(&access.admin_gids));
    } else if (flag == "--admin-token-names") {
      if (!(v = next()).ok()) return v.status();
      for (absl::string_view name : absl::StrSplit(*v, ',', absl::SkipWhitespace())) {
        access.admin_token_names.emplace_back(absl::StripAsciiWhitespace(name));
      }
    } else if (flag == "--tls-cert") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.tls_cert_file = *v;
    } else if (flag == "--tls-key") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.tls_key_file = *v;
    } else if (flag == "--tls-client-ca") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.tls_client_ca_file = *v;
    } else if (flag == "--auth-token-file") {
      if (!(v = next()).ok()) return v.status();
      flags->grpc.auth_token_file = *v;
    } else if (flag == "--allow-insecure-token") {
      std::string b = inline_value ? absl::AsciiStrToLower(value) : "true";
      if (b == "true" || b == "1" || b == "yes") {
        allow_insecure_token = true;
      } else if (b == "false" || b == "0" || b == "no") {
        allow_insecure_token = false;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--allow-insecure-token: expected true or false, got \"", value, "\""));
      }
    } else if (flag == "--log-format") {
      if (!(v = next()).ok()) return v.status();
      if (*v == "json") {
        SetLogFormat(LogFormat::kJson);
      } else if (*v == "text") {
        SetLogFormat(LogFormat::kText);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--log-format: expected text or json, got \"", *v, "\""));
      }
    } else if (flag == "--log-level") {
      if (!(v = next()).ok()) return v.status();
      if (*v == "debug") {
        SetMinLogLevel(LogLevel::kDebug);
      } else if (*v == "info") {
        SetMinLogLevel(LogLevel::kInfo);
      } else if (*v == "warning") {
        SetMinLogLevel(LogLevel::kWarning);
      } else if (*v == "error") {
        SetMinLogLevel(LogLevel::kError);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--log-level: expected debug|info|warning|error, got \"", *v, "\""));
      }
    } else if (flag == "--preload") {
      if (!(v = next()).ok()) return v.status();
      while (true) {
        std::string spec = *v;
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
        flags->preloads.push_back(std::move(p));
        if (inline_value || i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) break;
        v = args[++i];
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag \"", flag, "\"\n", kUsage));
    }
  }
  if (flags->grpc.unix_socket.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--socket is required\n", kUsage));
  }
  if (flags->service.model_roots.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--model-root is required\n", kUsage));
  }
  if (flags->data.path.empty()) flags->data.path = flags->grpc.unix_socket + ".data";
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
  if (!g.auth_token_file.empty() && !tls && !IsLoopbackListenAddress(g.tcp_listen) &&
      !allow_insecure_token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file without TLS on the non-loopback address ", g.tcp_listen,
        " would send bearer tokens in clear text; add --tls-cert/--tls-key, listen on a "
        "loopback address, or pass --allow-insecure-token"));
  }
  flags->grpc.unix_socket_mode = mode;
  flags->data.mode = mode;
  flags->service.data_socket_path = flags->data.path;
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
  // SO_PEERCRED reports effective ids; the daemon's own is always allowed.
  flags.service.access.daemon_uid = ::geteuid();
  auto args = CollectArgs(argc, argv);
  if (!args.ok()) return Fail(args.status());
  if (absl::Status s = ParseFlags(*args, &flags); !s.ok()) return Fail(s);
  // The effective configuration, whatever its sources.
  LogEvent(LogLevel::kInfo, "config", {{"args", absl::StrJoin(*args, " ")}});

  // Signals are taken synchronously by the main thread; every thread started
  // from here on inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto service = WeightService::Create(flags.service);
  if (!service.ok()) return Fail(service.status());
  for (const Preload& p : flags.preloads) {
    std::string profile;
    if (!p.profile.empty()) {
      auto text = ReadFileToString(p.profile, kMaxProfileBytes);
      if (!text.ok()) return Fail(text.status());
      profile = std::move(*text);
    }
    auto loaded = (*service)->LoadModel(p.name, p.path, profile, nullptr);
    if (!loaded.ok()) return Fail(loaded.status());
  }
  WeightService* svc = service->get();
  flags.data.authorize = [svc](const PeerIdentity& peer) {
    return svc->access().AdmitPeer(Principal::UnixPeer(peer));
  };
  flags.data.authorize_attach = [svc](const PeerIdentity& peer, uint64_t lease_id) {
    return svc->CheckLeaseUse(lease_id, Principal::UnixPeer(peer));
  };
  auto data = ShmDataServer::Start(flags.data, (*service)->leases());
  if (!data.ok()) return Fail(data.status());
  auto grpc = GrpcServer::Start(flags.grpc, service->get());
  if (!grpc.ok()) return Fail(grpc.status());
  std::unique_ptr<MetricsServer> metrics;
  if (!flags.metrics_listen.empty()) {
    auto started = MetricsServer::Start(flags.metrics_listen, service->get());
    if (!started.ok()) return Fail(started.status());
    metrics = std::move(*started);
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
  LogEvent(LogLevel::kInfo, "shutdown", {{"signal", strsignal(sig)}});
  g_data_socket_path = flags.data.path.c_str();
  signal(SIGALRM, OnTeardownStuck);
  alarm(static_cast<unsigned>(absl::ToInt64Seconds(flags.shutdown_grace)) + kTeardownSeconds);
  (*grpc)->Shutdown(flags.shutdown_grace);
  metrics.reset();
  (*data)->Stop();
  grpc->reset();
  data->reset();
  service->reset();
  LogEvent(LogLevel::kInfo, "stopped", {});
  return 0;
}

}  // namespace
}  // namespace weightd

int main(int argc, char** argv) { return weightd::Main(argc, argv); }
