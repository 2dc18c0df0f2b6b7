// The predecessor's side of a hand-over (handover.h): what this daemon does
// at each step of a successor's conversation. Daemon members, called on the
// hand-over server's thread once Start() has built every part they touch.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "server/daemon/daemon.h"
#include "server/daemon/signals.h"
#include "server/daemon/startup.h"

namespace weightd {

HandoverServer::Hooks Daemon::HandoverHooks() {
  HandoverServer::Hooks hooks;
  hooks.begin = [this](int64_t pid, const std::string& host) {
    return OnHandoverBegin(pid, host);
  };
  hooks.pause = [this] { return OnHandoverPause(); };
  hooks.resume = [this](const absl::Status&) { OnHandoverResume(); };
  hooks.handed_over = [this] { OnHandedOver(); };
  return hooks;
}

// BEGIN: refuse what a successor could not take over, close changes, wait
// for those in flight and for published saves, describe what is served.
absl::StatusOr<HandoverOffer> Daemon::OnHandoverBegin(int64_t pid, const std::string& host) {
  HandoverServer* server = handover_server_.load();
  if (server == nullptr) return absl::UnavailableError("still starting");
  if (!took_over_from_host_.empty() && host == took_over_from_host_) {
    // A restarted container of the pod this daemon replaced.
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon took over from host ", host, "; it does not hand back to it"));
  }
  if (flags_.state_dir.empty()) {
    return absl::FailedPreconditionError(
        "this daemon runs without --state-dir: a successor could not restore what it serves");
  }
  if (restored_.interrupted) {
    return absl::FailedPreconditionError("this daemon did not finish restoring its state");
  }
  grpc_->CloseChanges(absl::UnavailableError(absl::StrCat(
      "weightd is handing over to a new daemon (pid ", pid, "); retry in a moment")));
  if (int64_t left = grpc_->WaitChangesIdle(absl::Now() + absl::Seconds(30)); left > 0) {
    return absl::UnavailableError(absl::StrCat(
        left, " loads, applies or publishes still ran after 30 s; try again later"));
  }
  if (PublishedStore* store = service_->published_store();
      store != nullptr && !store->WaitIdle(absl::Seconds(60))) {
    return absl::UnavailableError("published weights were still being saved after 60 s");
  }
  return MakeHandoverOffer(flags_.state_dir, grpc_->unix_listen_fd(), data_->listen_fd(),
                           server->listen_fd(), service_->resident_checkpoints(),
                           service_->checkpoint_segment_bytes(), ServedModels(*service_));
}

// READY: refuse new calls (clients retry), stop accepting, free the
// metrics port for the successor; the lease id past every lease granted.
uint64_t Daemon::OnHandoverPause() {
  grpc_->Restoring(absl::UnavailableError("weightd is handing over to a new daemon; retry"));
  grpc_->PauseAccepting();
  data_->Pause();
  StopMetrics();  // its port, for the successor
  return service_->leases()->next_id();
}

// The successor failed before STARTED: serve again as before BEGIN.
void Daemon::OnHandoverResume() {
  grpc_->ResumeAccepting();
  data_->Resume();
  grpc_->Restored();
  if (!flags_.metrics_listen.empty()) RestartMetrics();
}

// STARTED: the successor serves on the sockets; stop as on SIGTERM,
// leaving their files.
void Daemon::OnHandedOver() {
  handed_over_.store(true);
  grpc_->KeepSocketFile(true);
  data_->KeepSocketFile(true);
  StopMainThread();
}

void Daemon::StopMetrics() {
  std::unique_ptr<MetricsServer> stopping;
  {
    absl::MutexLock lock(&mu_);
    stopping = std::move(metrics_);
  }
  stopping.reset();  // joins its thread: outside the lock
}

void Daemon::RestartMetrics() {
  {
    absl::MutexLock lock(&mu_);
    if (metrics_ != nullptr) return;
  }
  auto again = MetricsServer::Start(flags_.metrics_listen, service_.get(),
                                    fleet_ ? fleet_->checkpoint_client() : nullptr);
  if (!again.ok()) {
    LogEvent(LogLevel::kError, "metrics_restart_failed", {{"error", again.status().ToString()}});
    return;
  }
  absl::MutexLock lock(&mu_);
  metrics_ = std::move(*again);
}

}  // namespace weightd
