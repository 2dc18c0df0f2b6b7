#include "server/daemon/daemon.h"

#include <string.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/daemon/signals.h"
#include "server/gpu/gpu_devices.h"
#include "server/memory/huge_pages.h"

namespace weightd {

Daemon::Daemon(DaemonFlags flags) : flags_(std::move(flags)) {}

Daemon::~Daemon() = default;

absl::Status Daemon::Start() {
  // Signals are taken synchronously by the main thread; every thread
  // started from here on inherits the mask.
  InstallTermSignals();
  FindGpus();
  LogHostPages();
  WD_RETURN_IF_ERROR(OpenStateDir());
  WD_RETURN_IF_ERROR(BeginTakeOver());
  if (take_over_ == nullptr) {
    WD_RETURN_IF_ERROR(
        CheckNoDaemonServes(flags_.grpc.unix_socket, flags_.take_over, flags_.handover_socket));
  }
  WD_RETURN_IF_ERROR(OpenJournal());
  start_ = PlanStart(take_over_ != nullptr, plan_.entries(), flags_.state_dir,
                     flags_.serve_during_restore);
  flags_.grpc.changes_closed_at_start = start_.changes_closed_at_start;
  flags_.grpc.closed_at_start = start_.closed_at_start;
  WD_RETURN_IF_ERROR(StartPeers());
  WD_RETURN_IF_ERROR(StartSources());
  WD_ASSIGN_OR_RETURN(service_, WeightService::Create(flags_.service));
  WD_ASSIGN_OR_RETURN(const bool serve, PrepareBeforeServing());
  if (!serve) return absl::OkStatus();
  WD_RETURN_IF_ERROR(StartServers());
  WD_RETURN_IF_ERROR(FinishWhileServing());
  StartHandoverServer();
  LogServing();
  serving_ = true;
  return absl::OkStatus();
}

// Which GPUs there are, or why none: asked once (the CUDA runtime starts
// the driver), logged, reported by stats.
void Daemon::FindGpus() {
  flags_.service.gpus = weightd::DiscoverGpus();
  std::vector<std::string> found;
  for (const GpuDevice& g : flags_.service.gpus.devices) {
    found.push_back(absl::StrCat(g.ordinal, ":", g.uuid, ":", g.name));
  }
  LogEvent(LogLevel::kInfo, "gpus",
           {{"found", absl::StrJoin(found, ",")},
            {"unavailable", flags_.service.gpus.unavailable}});
}

// What the host offers for --huge-pages (the pool as seen now; a pod's
// hugetlb cgroup limit may allow less).
void Daemon::LogHostPages() const {
  const HostPages host = ReadHostPages();
  LogEvent(LogLevel::kInfo, "host_pages",
           {{"huge_pages", HugePageModeName(flags_.service.huge_pages)},
            {"hugetlb_2m_free", absl::StrCat(host.hugetlb_free)},
            {"hugetlb_2m_total", absl::StrCat(host.hugetlb_total)},
            {"shmem_thp", host.shmem_thp.empty() ? "unknown" : host.shmem_thp},
            {"shmem_thp_honoured", ShmemThpHonoured(host.shmem_thp) ? "yes" : "no"}});
  if (flags_.service.huge_pages == HugePageMode::kRequire && host.hugetlb_free == 0) {
    LogEvent(LogLevel::kWarning, "huge_pages_short",
             {{"reason", "--huge-pages=require and the 2 MiB hugetlb pool has no free page: "
                         "every load of 2 MiB or more will fail until vm.nr_hugepages is "
                         "raised"}});
  }
}

// --state-dir: a directory of the daemon's own that no other user may
// write, held open; every file in it is opened relative to it, never
// through a link (state_dir.h). Checked before anything uses it.
absl::Status Daemon::OpenStateDir() {
  if (!flags_.state_dir.empty()) {
    auto opened = StateDir::Open(flags_.state_dir, ::geteuid());
    if (!opened.ok()) return Annotate(opened.status(), "--state-dir");
    state_dir_ = std::move(*opened);
    WD_RETURN_IF_ERROR_CTX(CheckStateDirEntries(*state_dir_), "--state-dir");
  }
  handover_at_ = HandoverSocket{
      flags_.handover_in_state_dir ? state_dir_ : nullptr,
      flags_.handover_in_state_dir ? "handover.sock" : flags_.handover_socket};
  return absl::OkStatus();
}

// --take-over: the running daemon's memory and sockets, if one runs.
absl::Status Daemon::BeginTakeOver() {
  if (!flags_.take_over) return absl::OkStatus();  // CheckFlags: with --state-dir
  WD_ASSIGN_OR_RETURN(take_over_, TakeOver::Begin(handover_at_, *state_dir_, flags_));
  if (take_over_ == nullptr) return absl::OkStatus();
  take_over_->LendTo(&flags_);
  took_over_from_host_ = take_over_->from_host();
  return absl::OkStatus();
}

// --state-dir: the journal of what was served, replayed into a restore
// plan; from here on every change is journaled (into journal.new until
// the restore is done).
absl::Status Daemon::OpenJournal() {
  if (flags_.state_dir.empty()) return absl::OkStatus();
  auto opened = StateJournal::Open(state_dir_);
  if (!opened.ok()) return Annotate(opened.status(), "--state-dir");
  journal_ = std::move(*opened);
  for (const JournalProblem& p : journal_->previous().problems) {
    LogEvent(LogLevel::kWarning, "state_journal_damaged",
             {{"dir", flags_.state_dir}, {"offset", absl::StrCat(p.offset)}, {"what", p.what}});
  }
  plan_ = PlanRestore(journal_->previous().records);
  flags_.service.state_dir = state_dir_;
  StateJournal* j = journal_.get();
  flags_.service.on_state_change = [j](const StateRecord& r) {
    if (absl::Status s = j->Append(r); !s.ok()) {
      LogEvent(LogLevel::kError, "state_journal_failed",
               {{"entry", DescribeRecord(r)}, {"error", s.ToString()}});
    }
  };
  return absl::OkStatus();
}

// Before the service, which borrows it (loads ask peers for bytes), and
// destroyed after it.
absl::Status Daemon::StartPeers() {
  WD_RETURN_IF_ERROR(StartUcx());
  if (flags_.peers.addresses.empty() && flags_.peers.dns.empty()) return absl::OkStatus();
  flags_.peers.tls_cert_file = flags_.grpc.tls_cert_file;
  flags_.peers.tls_key_file = flags_.grpc.tls_key_file;
  // Room for a true answer and every stream's range in flight, whole (a
  // peer sends a range as fast as the link takes it; gRPC buffers what the
  // reader has not taken yet, and past the quota it cancels a stream:
  // "Buffers full"), and a message being put together besides.
  flags_.peers.receive_budget_bytes =
      (32ull << 20) + static_cast<uint64_t>(flags_.service.peer_streams) *
                          (flags_.service.read_chunk_bytes + (8ull << 20));
  WD_ASSIGN_OR_RETURN(fleet_, Fleet::Start(flags_.peers, ucx_.get()));
  flags_.grpc.peers = fleet_->table();
  flags_.grpc.peer_client = fleet_->checkpoint_client();
  flags_.service.peers = fleet_->checkpoint_peers();
  return absl::OkStatus();
}

absl::Status Daemon::StartSources() {
  WD_ASSIGN_OR_RETURN(SourceAllowList allowed, SourceAllowList::Create(flags_.model_sources));
  WD_ASSIGN_OR_RETURN(source_client_, SourceClient::Create(flags_.source));
  sources_ = std::make_unique<RemoteFileOpener>(source_client_.get(), std::move(allowed));
  flags_.service.sources = sources_.get();
  if (!flags_.model_sources.empty()) {
    LogEvent(LogLevel::kInfo, "model_sources",
             {{"prefixes", absl::StrJoin(sources_->allowed().prefixes(), ", ")}});
  }
  return absl::OkStatus();
}

// The UCX data plane (--peer-transport auto|ucx): a holder grants reads
// over it, a loader reads over it. Said at start: the transports UCX found,
// or why none (auto then serves and reads over gRPC; ucx fails the start).
absl::Status Daemon::StartUcx() {
  const PeerTransport want = flags_.peers.transport;
  if (want == PeerTransport::kGrpc) {
    LogEvent(LogLevel::kInfo, "ucx", {{"state", "off"}, {"why", "--peer-transport grpc"}});
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<UcxPlane>> plane = UcxPlane::Start();
  if (!plane.ok()) {
    if (want == PeerTransport::kUcx) {
      return absl::FailedPreconditionError(
          absl::StrCat("--peer-transport ucx: ", plane.status().message()));
    }
    LogEvent(LogLevel::kWarning, "ucx",
             {{"state", "off"}, {"why", plane.status().ToString()},
              {"action", "peers are read and served over gRPC"}});
    flags_.peers.transport = PeerTransport::kGrpc;
    return absl::OkStatus();
  }
  ucx_ = std::move(*plane);
  flags_.grpc.ucx = ucx_.get();
  LogEvent(LogLevel::kInfo, "ucx",
           {{"state", "on"}, {"peer_transport", PeerTransportName(want)},
            {"transports", ucx_->transports()}});
  return absl::OkStatus();
}

absl::StatusOr<bool> Daemon::PrepareBeforeServing() {
  switch (start_.mode) {
    case StartMode::kTakeOver:
      return TakeOverBeforeServing();
    case StartMode::kRestore:
      return true;  // while serving (FinishWhileServing)
    case StartMode::kFresh:
      break;
  }
  WD_RETURN_IF_ERROR(RunPreloads(*service_, flags_.preloads, restored_));
  if (journal_ != nullptr) {
    WD_RETURN_IF_ERROR(journal_->Commit());
    KeepPublished(*service_, {});
  }
  return true;
}

// Taking over: the state comes back before this daemon serves (the
// predecessor serves meanwhile), its checkpoints adopted, not read.
absl::StatusOr<bool> Daemon::TakeOverBeforeServing() {
  auto stopped = [] {
    LogEvent(LogLevel::kInfo, "stopped",
             {{"reason", "signalled during the take-over; the running daemon serves on"}});
    return false;
  };
  if (plan_.entries() > 0) {
    restored_ = take_over_->Restore(*service_, plan_, journal_.get(), TermSignalPending,
                                    RestoreFloorMargin(journal_.get()));
    if (restored_.interrupted) return stopped();
  }
  WD_RETURN_IF_ERROR(RunPreloads(*service_, flags_.preloads, restored_));
  WD_RETURN_IF_ERROR(take_over_->Confirm(*service_, restored_));
  if (TermSignalPending()) return stopped();
  WD_RETURN_IF_ERROR(take_over_->Ready(*service_));
  return true;
}

absl::Status Daemon::StartServers() {
  ConnectDataSocket(service_.get(), &flags_.data);
  WD_ASSIGN_OR_RETURN(data_, DataServer::Start(flags_.data, service_->leases()));
  // Taking over: the socket files stay whatever happens until DONE (the
  // predecessor may be serving on them again).
  if (take_over_ != nullptr) data_->KeepSocketFile(true);
  WD_ASSIGN_OR_RETURN(grpc_, GrpcServer::Start(flags_.grpc, service_.get()));
  if (take_over_ != nullptr) grpc_->KeepSocketFile(true);
  if (!flags_.metrics_listen.empty()) {
    WD_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> metrics,
                        MetricsServer::Start(flags_.metrics_listen, service_.get(),
                                             fleet_ ? fleet_->checkpoint_client() : nullptr));
    absl::MutexLock lock(&mu_);
    metrics_ = std::move(metrics);
  }
  return absl::OkStatus();
}

absl::Status Daemon::FinishWhileServing() {
  if (start_.mode == StartMode::kTakeOver) {
    // Serving on the predecessor's sockets: it may go. Without its DONE it
    // may be serving again: exit, leaving the socket files.
    WD_RETURN_IF_ERROR(take_over_->Started());
    data_->KeepSocketFile(false);
    grpc_->KeepSocketFile(false);
    // The journal is this daemon's now (the predecessor wrote its last
    // record before the manifest). Saved published weights are left as
    // they are: the predecessor's restore removed what no model serves.
    if (absl::Status s = journal_->Commit(); !s.ok()) {
      LogEvent(LogLevel::kError, "state_journal_failed",
               {{"entry", "commit after the take-over"}, {"error", s.ToString()}});
    }
    LogEvent(LogLevel::kInfo, "taken_over", {});
  } else if (start_.mode == StartMode::kRestore) {
    // Serving (health NOT_SERVING, calls refused UNAVAILABLE unless
    // --serve-during-restore) while the models come back. A SIGTERM ends it
    // between two entries, and the old journal stays as it was.
    restored_ = RestoreState(*service_, plan_, journal_.get(), TermSignalPending,
                             RestoreFloorMargin(journal_.get()));
    if (!restored_.interrupted) {
      WD_RETURN_IF_ERROR(RunPreloads(*service_, flags_.preloads, restored_));
      WD_RETURN_IF_ERROR(journal_->Commit());
      KeepPublished(*service_, restored_.published_files);
      grpc_->Restored();
    }
  }
  return absl::OkStatus();
}

// A successor takes over through the hand-over socket (handover.h).
void Daemon::StartHandoverServer() {
  if (flags_.handover_socket.empty()) return;
  UniqueFd adopt = take_over_ != nullptr ? take_over_->TakeHandoverListenFd() : UniqueFd();
  auto started = HandoverServer::Start(handover_at_, HandoverHooks(), HandoverServer::Timeouts(),
                                       adopt.valid() ? adopt.release() : -1);
  if (!started.ok()) {
    // Serving matters more than upgrades without a reload.
    LogEvent(LogLevel::kError, "handover_unavailable",
             {{"handover_socket", flags_.handover_socket},
              {"error", started.status().ToString()},
              {"effect", "no successor can take this daemon over"}});
    return;
  }
  handover_ = std::move(*started);
  handover_server_.store(handover_.get());
}

void Daemon::LogServing() const {
  LogEvent(LogLevel::kInfo, "serving",
           {{"socket", flags_.grpc.unix_socket},
            {"data_socket", flags_.data.path},
            {"max_data_connections", absl::StrCat(data_->max_connections())},
            {"max_data_connections_per_uid", absl::StrCat(data_->max_connections_per_uid())},
            {"listen", flags_.grpc.tcp_listen},
            {"metrics_listen", flags_.metrics_listen},
            {"pid", absl::StrCat(getpid())}});
}

int Daemon::WaitForSignal() { return WaitForTermSignal(); }

void Daemon::Shutdown(int signal) {
  ArmTeardownAlarm(flags_.shutdown_grace);
  // A successor that took over (or may have: stopped after GO) owns the
  // sockets' paths from here on.
  if (handover_ != nullptr) handover_->Stop();
  const bool successor = handover_ != nullptr && handover_->successor_may_serve();
  if (successor) {
    grpc_->KeepSocketFile(true);
    data_->KeepSocketFile(true);
  }
  LogEvent(LogLevel::kInfo, "shutdown",
           {{"signal", strsignal(signal)},
            {"reason", handed_over_.load() ? "handed over to a successor" : "signal"}});
  if (!successor) UnlinkIfTeardownStuck(flags_.data.path.c_str());
  // Loads reading remote objects stop at their next callback (CANCELLED).
  if (source_client_ != nullptr) source_client_->Cancel();
  grpc_->Shutdown(flags_.shutdown_grace);
  StopMetrics();
  data_->Stop();
}

}  // namespace weightd
