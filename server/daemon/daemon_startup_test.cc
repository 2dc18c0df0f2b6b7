// The daemon's start without a process: its flags as parsed and checked
// (daemon_flags.h), the start decisions (startup.h), and a restore from a
// real journal into a real WeightService (restore.h) followed by the
// preloads, as Daemon::Start runs them.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"
#include "common/unix_socket.h"
#include "server/daemon/daemon_flags.h"
#include "server/daemon/restore.h"
#include "server/daemon/startup.h"
#include "server/state/state_journal.h"

namespace weightd {
namespace {

// A temporary directory of the test's own (0700), removed with its files.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/daemon_startup_test.XXXXXX";
    path_ = ::mkdtemp(tmpl) != nullptr ? tmpl : "";
  }
  ~TempDir() { (void)!std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Parses `args` (and `env`, WEIGHTD_<FLAG> variables) as weightd does,
// then CheckFlags.
absl::Status Parse(DaemonFlags* f, const std::vector<std::string>& args,
                   const std::map<std::string, std::string>& env = {}) {
  FlagTable table = DaemonFlagTable(f);
  auto parsed = table.Parse(args, [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  if (!parsed.ok()) return parsed.status();
  return CheckFlags(table, f);
}

std::vector<std::string> Required(std::vector<std::string> more = {}) {
  std::vector<std::string> args = {"--socket", "/run/w/weightd.sock", "--model-root", "/models"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(DaemonFlagsTest, RequiredFlagsAreNamedWithTheUsage) {
  DaemonFlags f;
  absl::Status s = Parse(&f, {"--model-root", "/models"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "--socket is required\nusage: weightd")) << s;
  DaemonFlags g;
  s = Parse(&g, {"--socket", "/s"});
  EXPECT_TRUE(absl::StartsWith(s.message(), "--model-root is required\nusage: weightd")) << s;
}

TEST(DaemonFlagsTest, DerivedPathsFollowTheSockets) {
  DaemonFlags f;
  ASSERT_TRUE(Parse(&f, Required({"--state-dir", "/var/lib/w", "--socket-mode", "0600"})).ok());
  EXPECT_EQ(f.data.path, "/run/w/weightd.sock.data");
  EXPECT_EQ(f.service.data_socket_path, "/run/w/weightd.sock.data");
  EXPECT_EQ(f.service.data_socket_name, "weightd.sock.data");  // beside the gRPC socket
  EXPECT_EQ(f.handover_socket, "/var/lib/w/handover.sock");
  EXPECT_TRUE(f.handover_in_state_dir);
  EXPECT_EQ(f.grpc.unix_socket_mode, 0600u);
  EXPECT_EQ(f.data.mode, 0600u);
  EXPECT_EQ(f.service.huge_pages, HugePageMode::kAuto);
  EXPECT_EQ(f.service.access.daemon_uid, ::geteuid());

  DaemonFlags elsewhere;
  ASSERT_TRUE(Parse(&elsewhere, Required({"--data-socket", "/other/d.sock",
                                          "--handover-socket", "/h.sock"}))
                  .ok());
  EXPECT_EQ(elsewhere.service.data_socket_name, "");  // not beside it: not advertised by name
  EXPECT_EQ(elsewhere.handover_socket, "/h.sock");
  EXPECT_FALSE(elsewhere.handover_in_state_dir);
}

TEST(DaemonFlagsTest, ValuesReachTheirOptions) {
  DaemonFlags f;
  ASSERT_TRUE(Parse(&f, Required({"--preload", "a=/models/a@/p/a.json", "--preload", "b=/models/b",
                                  "--take-over-verify", "sample", "--peers", "h1:1, h2:2",
                                  "--peer-poll-seconds", "7", "--lease-ttl-seconds", "9",
                                  "--pin-host-memory", "off", "--allow-uid", "5,6",
                                  "--max-publish-sessions", "3",
                                  "--max-publish-sessions-per-caller", "2",
                                  "--publish-idle-seconds", "5"}))
                  .ok());
  ASSERT_EQ(f.preloads.size(), 2u);
  EXPECT_EQ(f.preloads[0].name, "a");
  EXPECT_EQ(f.preloads[0].path, "/models/a");
  EXPECT_EQ(f.preloads[0].profile, "/p/a.json");
  EXPECT_EQ(f.preloads[1].profile, "");
  EXPECT_EQ(f.take_over_verify, AdoptVerify::kSample);
  EXPECT_EQ(f.peers.addresses, (std::vector<std::string>{"h1:1", "h2:2"}));
  EXPECT_EQ(f.peers.poll_interval, absl::Seconds(7));
  EXPECT_EQ(f.service.lease_idle_ttl, absl::Seconds(9));
  EXPECT_EQ(f.service.pin_host_memory, WeightServiceOptions::Pin::kOff);
  EXPECT_EQ(f.service.access.allow_uids, (std::vector<uint32_t>{5, 6}));
  EXPECT_EQ(f.service.max_publish_sessions, 3u);
  EXPECT_EQ(f.service.max_publish_sessions_per_caller, 2u);
  EXPECT_EQ(f.service.publish_idle_timeout, absl::Seconds(5));
}

TEST(DaemonFlagsTest, EnvironmentGivesFlagsTheCommandLineOverrides) {
  DaemonFlags f;
  ASSERT_TRUE(Parse(&f, {"--socket", "/cli.sock"},
                    {{"WEIGHTD_SOCKET", "/env.sock"}, {"WEIGHTD_MODEL_ROOT", "/a,/b"}})
                  .ok());
  EXPECT_EQ(f.grpc.unix_socket, "/cli.sock");
  EXPECT_EQ(f.service.model_roots, (std::vector<std::string>{"/a", "/b"}));
}

TEST(DaemonFlagsTest, MalformedValuesNameTheirFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--preload", "noequals"}, "--preload: expected NAME=PATH[@PROFILE], got \"noequals\""},
      {{"--take-over-verify", "most"}, "--take-over-verify: expected full, sample or none"},
      {{"--socket-mode", "0999"}, "--socket-mode: bad octal mode \"0999\""},
      {{"--huge-pages", "always"}, "--huge-pages: expected auto, off or require"},
      {{"--fleet-members", "uid:5"}, "--fleet-members: only token:NAME and cn:NAME"},
  };
  for (const Case& c : cases) {
    DaemonFlags f;
    absl::Status s = Parse(&f, Required(c.args));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.args[0];
    EXPECT_TRUE(absl::StartsWith(s.message(), c.message)) << s;
  }
}

TEST(DaemonFlagsTest, CombinationsThatWouldLeaveTheDaemonOpenAreRefused) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--take-over"}, "--take-over needs --state-dir"},
      {{"--listen", "0.0.0.0:1", "--tls-cert", "c"}, "--tls-cert and --tls-key go together"},
      {{"--listen", "0.0.0.0:1", "--tls-client-ca", "ca"},
       "--tls-client-ca needs --tls-cert and --tls-key"},
      {{"--auth-token-file", "t"}, "--tls-cert/--tls-key/--auth-token-file secure the TCP"},
      {{"--admin-token-names", "ops"}, "--admin-token-names needs --auth-token-file"},
      {{"--fleet-members", "token:a"}, "--fleet-members token:NAME needs --auth-token-file"},
      {{"--listen", "10.0.0.1:1", "--auth-token-file", "t"},
       "--auth-token-file without TLS on the non-loopback address 10.0.0.1:1"},
  };
  for (const auto& [args, message] : cases) {
    DaemonFlags f;
    absl::Status s = Parse(&f, Required(args));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_TRUE(absl::StartsWith(s.message(), message)) << s;
  }
  DaemonFlags loopback, insecure;
  EXPECT_TRUE(Parse(&loopback, Required({"--listen", "127.0.0.1:1", "--auth-token-file", "t"}))
                  .ok());
  EXPECT_TRUE(Parse(&insecure, Required({"--listen", "10.0.0.1:1", "--auth-token-file", "t",
                                         "--allow-insecure-token"}))
                  .ok());
}

TEST(DaemonFlagsTest, UsageListsTheSectionsInOrder) {
  DaemonFlags f;
  const std::string usage = DaemonFlagTable(&f).Usage();
  // The first and last flag of each section, in the order of the sections.
  const std::vector<std::string> order = {
      "--socket ",        "--metrics-listen ",       "--model-root ",
      "--preload ",       "--state-dir ",            "--take-over-verify ",
      "--peers ",         "--fleet-members ",        "--warm-reserve-bytes ",
      "--max-watch-streams ", "--threads ",          "--checkpoint-segment-bytes ",
      "--log-format ",    "--log-level ",            "--socket-mode ",
      "--admin-token-names ", "--tls-cert ",         "--allow-insecure-token"};
  size_t at = 0;
  for (const std::string& flag : order) {
    const size_t found = usage.find("  " + flag, at);
    ASSERT_NE(found, std::string::npos) << flag << " after offset " << at << " in\n" << usage;
    at = found;
  }
}

TEST(StartupTest, PlanStartRestoresBeforeServingOnlyWhenTakingOver) {
  StartPlan fresh = PlanStart(false, 0, "/s", false);
  EXPECT_EQ(fresh.mode, StartMode::kFresh);
  EXPECT_TRUE(fresh.closed_at_start.ok());
  EXPECT_TRUE(fresh.changes_closed_at_start.ok());

  StartPlan restore = PlanStart(false, 3, "/var/lib/w", false);
  EXPECT_EQ(restore.mode, StartMode::kRestore);
  EXPECT_EQ(restore.closed_at_start.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(restore.closed_at_start.message(),
            "weightd is restoring its state from /var/lib/w (--state-dir); retry when health "
            "says SERVING");
  EXPECT_EQ(restore.changes_closed_at_start, restore.closed_at_start);

  StartPlan serving = PlanStart(false, 3, "/var/lib/w", true);
  EXPECT_TRUE(serving.closed_at_start.ok());  // --serve-during-restore
  EXPECT_EQ(serving.changes_closed_at_start.code(), absl::StatusCode::kUnavailable);

  // The predecessor serves while the successor restores: nothing closed.
  StartPlan taking = PlanStart(true, 3, "/var/lib/w", false);
  EXPECT_EQ(taking.mode, StartMode::kTakeOver);
  EXPECT_TRUE(taking.closed_at_start.ok());
  EXPECT_TRUE(taking.changes_closed_at_start.ok());
  EXPECT_EQ(PlanStart(true, 0, "/var/lib/w", false).mode, StartMode::kTakeOver);

  EXPECT_EQ(RestoreFloorMargin(nullptr), 0u);
}

TEST(StartupTest, PreloadsSkipWhatTheRestoreBroughtBackOrRefused) {
  RestoreReport restored;
  restored.skipped_names = {"changed"};
  EXPECT_EQ(DecidePreload({"m", "/p", ""}, /*served=*/true, restored),
            PreloadAction::kSkipRestored);
  EXPECT_EQ(DecidePreload({"changed", "/p", ""}, false, restored), PreloadAction::kSkipRefused);
  EXPECT_EQ(DecidePreload({"new", "/p", ""}, false, restored), PreloadAction::kLoad);
}

TEST(StartupTest, ATakeOverMustServeWhatThePredecessorServes) {
  RestoreReport restored;
  EXPECT_TRUE(CheckRestoredAll(restored).ok());
  restored.skipped_names = {"a", "b"};
  absl::Status s = CheckRestoredAll(restored);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "--take-over: the restore skipped a, b (restore_skipped in the log); the running "
            "daemon serves on");

  const std::vector<HandoverModel> theirs = {{"a", 2, "0123456789abcdef0123"}, {"b", 1, "ff"}};
  EXPECT_TRUE(CheckServesAsPredecessor(theirs, theirs).ok());
  std::vector<HandoverModel> mine = theirs;
  mine[0].generation = 3;
  s = CheckServesAsPredecessor(mine, theirs);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "--take-over: restored [a@3:0123456789ab b@1:ff] but the running daemon serves "
            "[a@2:0123456789ab b@1:ff]; it serves on");
  EXPECT_FALSE(CheckServesAsPredecessor({theirs[0]}, theirs).ok());
}

TEST(StartupTest, ADaemonListeningOnTheSocketIsRefused) {
  TempDir dir;
  const std::string socket = dir.path() + "/w.sock";
  EXPECT_TRUE(CheckNoDaemonServes(socket, false, "").ok());  // no file
  auto listening = ListenUnix(socket, 0600);
  ASSERT_TRUE(listening.ok()) << listening.status();
  absl::Status s = CheckNoDaemonServes(socket, false, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "a daemon already serves on " + socket +
                             "; stop it first, or start this one with --take-over");
  s = CheckNoDaemonServes(socket, true, "/state/handover.sock");
  EXPECT_TRUE(absl::StrContains(s.message(), " and offers no hand-over at /state/handover.sock"))
      << s;
  listening->Reset();  // a stale socket file: nobody serves
  EXPECT_TRUE(CheckNoDaemonServes(socket, false, "").ok());
}

// A model file of one F32 [4] tensor whose elements are `first`, first+1...
void WriteModel(const std::string& path, float first) {
  const std::vector<float> v = {first, first + 1, first + 2, first + 3};
  ASSERT_TRUE(WriteSafetensorsFile(path, {{"w", DType::kF32, {4}, F32Bytes(v)}}).ok());
}

// A journal in a state directory, and a service journaling into it, as
// Daemon::OpenJournal wires them.
class RestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::mkdir(State().c_str(), 0700), 0);
    ASSERT_EQ(::mkdir(Models().c_str(), 0755), 0);
    WriteModel(Models() + "/m.safetensors", 1);
    WriteModel(Models() + "/n.safetensors", 10);
  }
  std::string State() const { return dir_.path() + "/state"; }
  std::string Models() const { return dir_.path() + "/models"; }

  // Opens the journal (replaying what it held) and a service over it.
  void Open() {
    service_.reset();
    journal_.reset();
    auto journal = StateJournal::Open(State());
    ASSERT_TRUE(journal.ok()) << journal.status();
    journal_ = std::move(*journal);
    WeightServiceOptions options;
    options.model_roots = {Models()};
    options.data_socket_path = "/nonexistent/data.sock";
    StateJournal* j = journal_.get();
    options.on_state_change = [j](const StateRecord& r) { ASSERT_TRUE(j->Append(r).ok()); };
    auto service = WeightService::Create(std::move(options));
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = std::move(*service);
  }
  std::string ContentOf(const std::string& name) {
    for (const HandoverModel& m : ServedModels(*service_)) {
      if (m.name == name) return m.content;
    }
    return "";
  }

  TempDir dir_;
  std::unique_ptr<StateJournal> journal_;
  std::unique_ptr<WeightService> service_;
};

TEST_F(RestoreTest, ARestartServesTheSameBytesAndPreloadsOnlyWhatIsNew) {
  Open();
  ASSERT_TRUE(service_->LoadModel("m", Models() + "/m.safetensors", "", nullptr).ok());
  const std::string before = ContentOf("m");
  ASSERT_FALSE(before.empty());
  ASSERT_TRUE(journal_->Commit().ok());

  Open();  // the restart
  const RestorePlan plan = PlanRestore(journal_->previous().records);
  ASSERT_EQ(plan.entries(), 1u);
  RestoreReport restored = RestoreState(*service_, plan, journal_.get());
  EXPECT_EQ(restored.restored, 1u);
  EXPECT_TRUE(restored.skipped.empty());
  EXPECT_FALSE(restored.interrupted);
  EXPECT_EQ(ContentOf("m"), before);
  // "m" is served already (its preload would load other files under its
  // name); "n" is new.
  ASSERT_TRUE(RunPreloads(*service_,
                          {{"m", Models() + "/n.safetensors", ""},
                           {"n", Models() + "/n.safetensors", ""}},
                          restored)
                  .ok());
  EXPECT_EQ(ContentOf("m"), before);
  EXPECT_FALSE(ContentOf("n").empty());
  EXPECT_NE(ContentOf("n"), before);
}

TEST_F(RestoreTest, AChangedFileIsSkippedAndNotPreloadedBehindTheRestoresBack) {
  Open();
  ASSERT_TRUE(service_->LoadModel("m", Models() + "/m.safetensors", "", nullptr).ok());
  ASSERT_TRUE(journal_->Commit().ok());
  WriteModel(Models() + "/m.safetensors", 100);  // same layout, other bytes

  Open();
  RestoreReport restored =
      RestoreState(*service_, PlanRestore(journal_->previous().records), journal_.get());
  EXPECT_EQ(restored.restored, 0u);
  ASSERT_EQ(restored.skipped.size(), 1u);
  EXPECT_EQ(restored.skipped_names, (std::set<std::string>{"m"}));
  ASSERT_TRUE(RunPreloads(*service_, {{"m", Models() + "/m.safetensors", ""}}, restored).ok());
  EXPECT_EQ(ContentOf("m"), "");  // not loaded
  EXPECT_FALSE(CheckRestoredAll(restored).ok());
}

TEST_F(RestoreTest, AStopEndsTheRestoreBeforeTheNextEntry) {
  Open();
  ASSERT_TRUE(service_->LoadModel("m", Models() + "/m.safetensors", "", nullptr).ok());
  ASSERT_TRUE(service_->LoadModel("n", Models() + "/n.safetensors", "", nullptr).ok());
  ASSERT_TRUE(journal_->Commit().ok());

  Open();
  int asked = 0;
  RestoreReport restored =
      RestoreState(*service_, PlanRestore(journal_->previous().records), journal_.get(),
                   [&asked] { return ++asked > 1; });  // a signal after the first entry
  EXPECT_TRUE(restored.interrupted);
  EXPECT_EQ(restored.entries, 2u);
  EXPECT_EQ(restored.restored, 1u);
  EXPECT_EQ(ServedModels(*service_).size(), 1u);
}

}  // namespace
}  // namespace weightd
