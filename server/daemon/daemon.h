// The daemon's composition root: builds the parts its flags ask for, in
// dependency order, serves, and stops them in the reverse order.
//
// Start() runs the steps of a start (docs/restarts.md): signals; GPUs and
// host pages; the state directory; the take-over of a running daemon
// (takeover.h) or the check that none serves on the sockets; the journal
// and its restore plan; the fleet's peers; the service; what comes back
// before serving (preloads, or a take-over's restore); the data, gRPC and
// metrics servers; what comes back while serving (a restore) or completes a
// take-over; the hand-over server a successor takes this daemon over
// through (handover.h; its hooks are in handover_hooks.cc). The rules each
// step follows are in startup.h.
//
// The parts are members declared in the order they are built, so that the
// destructor stops each before the parts it borrows (the hand-over server
// first, the state directory last); Shutdown() does only what must come
// before that: the hand-over server stopped, the calls in flight given the
// grace, the listeners closed.
//
// Not thread-safe: Start, WaitForSignal and Shutdown on the main thread.
// The hand-over server's thread calls the hooks (OnHandover*), which touch
// the parts through their own thread-safe interfaces and the metrics server
// under mu_.
#ifndef WEIGHTD_SERVER_DAEMON_DAEMON_H_
#define WEIGHTD_SERVER_DAEMON_DAEMON_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/daemon/daemon_flags.h"
#include "server/daemon/handover.h"
#include "server/daemon/restore.h"
#include "server/daemon/startup.h"
#include "server/daemon/takeover.h"
#include "server/grpc/grpc_server.h"
#include "server/fleet/fleet.h"
#include "server/metrics/prometheus_exporter.h"
#include "server/engine/weight_service.h"
#include "server/source/source_opener.h"
#include "server/state/state_dir.h"
#include "server/state/state_journal.h"
#include "server/transport/data_server.h"

namespace weightd {

class Daemon {
 public:
  // `flags` as CheckFlags left them.
  explicit Daemon(DaemonFlags flags);
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;
  // Stops whatever Start started, each part before those it borrows.
  ~Daemon();

  // Starts the daemon. OK with serving(): it serves until WaitForSignal
  // returns. OK without: a signal ended a take-over before this daemon
  // served (logged stopped; the running daemon serves on): exit 0. An
  // error: the daemon must exit (what started is stopped by the
  // destructor; a take-over's socket files are left to the predecessor).
  // Once.
  absl::Status Start();
  bool serving() const { return serving_; }

  // Waits for SIGTERM or SIGINT (a completed hand-over sends one) and
  // returns it. REQUIRES: serving().
  int WaitForSignal();
  // Stops serving after `signal`: the hand-over server, then the calls in
  // flight get --shutdown-grace-seconds, then the metrics and data servers;
  // the teardown is bounded (signals.h). The socket files are removed
  // unless a successor serves on them. Destroy the daemon next.
  // REQUIRES: serving().
  void Shutdown(int signal);

 private:
  // Start's steps, in order.
  void FindGpus();
  void LogHostPages() const;
  absl::Status OpenStateDir();
  absl::Status BeginTakeOver();
  absl::Status OpenJournal();
  absl::Status StartPeers();
  // --model-source: the client and opener URL loads go through.
  absl::Status StartSources();
  absl::Status StartUcx();
  // What comes back before serving; false when a signal stopped a
  // take-over.
  absl::StatusOr<bool> PrepareBeforeServing();
  absl::StatusOr<bool> TakeOverBeforeServing();
  absl::Status StartServers();
  absl::Status FinishWhileServing();
  void StartHandoverServer();
  void LogServing() const;

  // The predecessor's hooks (handover_hooks.cc), on the hand-over server's
  // thread.
  HandoverServer::Hooks HandoverHooks();
  absl::StatusOr<HandoverOffer> OnHandoverBegin(int64_t successor_pid,
                                                const std::string& successor_host);
  uint64_t OnHandoverPause();
  void OnHandoverResume();
  void OnHandedOver();
  void StopMetrics() ABSL_LOCKS_EXCLUDED(mu_);
  void RestartMetrics() ABSL_LOCKS_EXCLUDED(mu_);

  // Set by Start() on the main thread, in this order, before the hand-over
  // server's thread exists; read-only from then on. Destroyed in reverse:
  // each part after those that borrow it (the service borrows the
  // journal, the take-over's checkpoints and the peers; the servers borrow
  // the service).
  DaemonFlags flags_;
  std::shared_ptr<const StateDir> state_dir_;
  HandoverSocket handover_at_;
  std::unique_ptr<TakeOver> take_over_;  // --take-over found a predecessor
  std::string took_over_from_host_;      // TakeOver::from_host()
  std::unique_ptr<StateJournal> journal_;
  RestorePlan plan_;
  StartPlan start_;
  RestoreReport restored_;
  bool serving_ = false;
  std::unique_ptr<UcxPlane> ucx_;  // --peer-transport auto|ucx (the fleet and gRPC borrow it)
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<SourceClient> source_client_;
  std::unique_ptr<RemoteFileOpener> sources_;
  std::unique_ptr<WeightService> service_;
  std::unique_ptr<DataServer> data_;
  std::unique_ptr<GrpcServer> grpc_;

  // Protected by mu_: the hand-over hooks stop the metrics server (its
  // port is the successor's) and restart it when the successor fails.
  absl::Mutex mu_;
  std::unique_ptr<MetricsServer> metrics_ ABSL_GUARDED_BY(mu_);

  // Own synchronization. The hand-over server is destroyed first: its
  // thread calls the hooks.
  std::atomic<HandoverServer*> handover_server_{nullptr};  // set once it serves
  std::atomic<bool> handed_over_{false};
  std::unique_ptr<HandoverServer> handover_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_DAEMON_H_
