// weightd: the per-node weight-serving daemon. Parses its flags
// (server/daemon/daemon_flags.h), starts the daemon (server/daemon/daemon.h),
// serves until SIGTERM or SIGINT, and stops.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "server/base/flag_table.h"
#include "server/base/log.h"
#include "server/daemon/daemon.h"
#include "server/daemon/daemon_flags.h"

namespace weightd {
namespace {

// "error: CODE: message" on stderr; exit status 2 for a usage error, else 1.
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

  auto daemon = std::make_unique<Daemon>(std::move(flags));
  if (absl::Status s = daemon->Start(); !s.ok()) return Fail(s);
  if (!daemon->serving()) return 0;  // a signal ended a take-over (logged)
  daemon->Shutdown(daemon->WaitForSignal());
  daemon.reset();
  LogEvent(LogLevel::kInfo, "stopped", {});
  return 0;
}

}  // namespace
}  // namespace weightd

int main(int argc, char** argv) { return weightd::Main(argc, argv); }
