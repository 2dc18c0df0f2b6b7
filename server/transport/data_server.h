// The shm transport's data socket: hands a lease's segment fds to the client
// that presents its id and token, and ends the lease when that client's
// connection closes — which is how a killed worker gives back what it held.
// A client may instead pass a memfd of its own and have the lease's tensors
// pushed into it (common/data_protocol.h; server/push/), or ask for an
// export: the copy runs on a small pool of push threads, never on the
// polling thread, and the connection reads nothing more until its push is
// answered. Which memory a push writes is the PushWriters' business
// (server/push/push_writer.h: host memory here, GPU memory through the
// writers the daemon adds); this server names no GPU type.
//
// One thread polls every connection and never blocks on one: sockets are
// non-blocking, a connection has at most one reply queued (its next request
// is read only once that reply is out), so a client that sends requests and
// reads no reply stalls its own connection only. Connections are capped in
// total and per peer uid; the excess is answered RESOURCE_EXHAUSTED and
// closed at once. An accept() that fails (EMFILE, ENFILE, ...) backs off
// instead of spinning.
//
// The parts: this class (listen, accept, poll, dispatch; data_server.cc),
// Connection and ConnectionLimits (one socket's parse and reply state, the
// caps; connection.h), and one handler per request magic, each a group of
// this class's methods in its own file: attach_request.cc (WDA1),
// push_request.cc (WDP1, WDC1), export_request.cc (WDC1 with handle kind 3),
// stage_request.cc (WDS1).
//
// Thread-safe: Start, Stop, Pause, Resume and the accessors may be called
// from any thread. The polling thread owns the connections; push threads
// hand their answers back through done_ (done_mu_), and fds the daemon lets
// go of are closed on a closer thread (closer_mu_). Neither lock is held
// while anything else is taken.
#ifndef WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_H_
#define WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_H_

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/base/accept_pause.h"
#include "common/data_protocol.h"
#include "common/fd.h"
#include "server/base/thread_pool.h"
#include "server/lease/lease_table.h"
#include "server/memory/host_memory.h"
#include "server/push/export_cache.h"
#include "server/push/push_writer.h"
#include "server/transport/connection.h"
#include "server/auth/peer_identity.h"

namespace weightd {

class DataServer {
 public:
  struct Options {
    std::string path;
    mode_t mode = 0660;  // the socket file's exact mode (never wider meanwhile)
    // Optional: decides whether a peer may use the socket at all. A refused
    // peer's every attach request is answered with this status (no fds),
    // then the connection is closed.
    std::function<absl::Status(const PeerIdentity&)> authorize;
    // Optional: decides whether this peer may attach this lease (checked
    // before the token, so a refused peer never ties the lease to itself).
    std::function<absl::Status(const PeerIdentity&, uint64_t lease_id)> authorize_attach;
    // Caps on open connections (each an fd of the daemon's), in all and
    // per peer uid. max_connections 0: half the daemon's open-file limit
    // (RLIMIT_NOFILE, soft) at Start, at most 65536; max_connections_per_uid
    // 0: half of max_connections. A connection past a cap gets
    // RESOURCE_EXHAUSTED.
    size_t max_connections = 0;
    size_t max_connections_per_uid = 0;
    // Threads that copy pushes into clients' memory (pushes past them
    // queue, FIFO).
    int push_threads = 2;
    // Pushes queued or running per peer uid; past it a push is answered
    // RESOURCE_EXHAUSTED, so one tenant cannot fill the queue. 0 = none.
    size_t max_pushes_per_uid = 8;
    // Optional: told of every push answered OK (its tensor bytes), before
    // the client is answered; the daemon counts them in its stats.
    std::function<void(uint64_t bytes)> on_push;
    // Optional: the staging memfd of publish session `session` for a peer
    // presenting its token (16 raw bytes; a StageRequest): a writable fd
    // the reply hands over. Without it a StageRequest is UNIMPLEMENTED.
    std::function<absl::StatusOr<UniqueFd>(const PeerIdentity&, uint64_t session,
                                           absl::string_view token)>
        stage;
    // Writers for pushes and exports beyond host memory, asked after the
    // host writer every server has (server/push/push_writer.h), e.g. the
    // CUDA writer (server/gpu/cuda_push_writer.h). Without one, a CUDA push
    // or an export to a GPU is UNIMPLEMENTED.
    std::vector<std::shared_ptr<const PushWriter>> push_writers;
    // Exported buffers (kCudaDaemonExport; export_cache.h), held by clients
    // or kept for the next export. Bytes per device, held or kept
    // (--device-memory-bytes); 0: each writer's default (a quarter of each
    // GPU's memory; for the host twin half of host_memory's budget, a
    // quarter of the machine's memory when that is unlimited).
    uint64_t export_budget = 0;
    // Bytes of the buffers one peer uid's open exports hold per device
    // (--max-export-bytes-per-uid); 0: half of the device's budget.
    uint64_t max_export_bytes_per_uid = 0;
    // Buffers in all (each keeps an fd of the daemon's); 0: a quarter of
    // the open-file limit (RLIMIT_NOFILE, soft) at Start, at most 4096. A
    // uid's open exports hold at most a quarter of them.
    size_t max_export_buffers = 0;
    // The host twin's buffers are segments of this manager, charged to its
    // budget (--host-memory-bytes, shown in stats as resident); its
    // reclaimer chain drops the unheld ones when memory runs short. Must
    // outlive the server. Null: a manager of the server's own, unlimited.
    HostMemoryManager* host_memory = nullptr;
    // An fd already listening at `path` (a predecessor's, at a hand-over):
    // served instead of binding a new socket; the server owns it. -1: bind.
    int adopt_listen_fd = -1;
  };

  // Binds the socket and starts the polling thread. `leases` must outlive
  // the server.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(Options options, LeaseTable* leases);
  ~DataServer();  // Stop()s

  // Stops the thread, closes every connection (ending their leases) and
  // unlinks the socket file. Idempotent.
  void Stop();

  // A hand-over: stops accepting new connections (open ones are served on)
  // until Resume(); when Pause() returns, no accept is in progress. The
  // listening socket stays open (a successor accepts on it).
  void Pause() { pause_.Pause(); }
  void Resume() { pause_.Resume(); }
  // Stop() leaves the socket file (a successor serves it).
  void KeepSocketFile(bool keep = true) { keep_file_.store(keep); }
  int listen_fd() const { return listen_fd_.get(); }

  const std::string& path() const { return options_.path; }
  uint64_t connections_open() const { return open_.load(); }
  ExportCacheStats export_stats() const { return exports_.stats(); }
  // Bytes of exported buffers on `device` ("host" or a GPU's UUID).
  uint64_t export_bytes(const std::string& device) const { return exports_.bytes(device); }
  // The caps in force (0 in Options resolved).
  size_t max_connections() const { return options_.max_connections; }
  size_t max_connections_per_uid() const { return options_.max_connections_per_uid; }

 private:
  using Connections = std::map<int, Connection>;  // by fd

  // What a push thread is handed: the connection it answers (its fd, and
  // its id: the fd may have been reused by then), its peer's uid (whose
  // count of pushes drops), the lease and where to write it. `dest` is the
  // fd the request carried (-1: none), closed (Discard) when the push ends.
  struct PushTask {
    int conn_fd = -1;
    uint64_t connection = 0;
    uid_t uid = 0;
    std::shared_ptr<const LeaseContents> lease;
    std::vector<uint64_t> offsets;
    std::optional<CudaPushTarget> cuda;
    int dest = -1;
  };
  // A push finished on a push thread, for the polling thread to answer.
  struct PushDone {
    int fd;               // the connection's socket
    uint64_t connection;  // its id (the fd may have been reused)
    uid_t uid;            // its peer's, whose count of pushes drops
    absl::Status status;
    // An export's buffer, held, and what the reply says of it (status OK
    // only).
    ExportHold exported;
    ExportInfo info{};
  };

  DataServer(Options options, LeaseTable* leases, UniqueFd listen_fd, UniqueFd wake_fd,
             UniqueFd done_fd);

  // The polling thread (data_server.cc): the loop, accepting, closing,
  // reading and dispatching requests, answering finished pushes.
  void Run();
  // Polls once and serves what is ready. False: the loop must end.
  bool PollOnce(std::vector<pollfd>& pfds);
  void AcceptAll();
  // A connection just accepted: admitted, refused or kept to refuse its
  // every request.
  void Admit(UniqueFd fd);
  // A connection past a cap: answered at once (its socket buffer is empty,
  // so the reply fits) and closed; a client reads the reply when it reads.
  void Refuse(UniqueFd fd, const PeerIdentity& peer, const absl::Status& why);
  void Close(Connections::iterator it);
  // Serves a connection poll() found ready. False: close it.
  bool ServeReady(Connection& c);
  // Reads (part of) one request and queues its reply. False: close it.
  bool Serve(Connection& c);
  // A request's header arrived: its handler, by magic.
  void Dispatch(Connection& c);
  void AnswerPushes();
  // After the loop: waits for the pushes in flight, then closes every
  // connection.
  void Drain();

  // attach_request.cc: WDA1, a lease's segment fds.
  void ServeAttach(Connection& c);
  // Logs an attach or push a PERMISSION_DENIED `status` refused.
  static void LogAttachRefused(const PeerIdentity& peer, uint64_t lease_id,
                               const absl::Status& status);
  // stage_request.cc: WDS1, a publish session's staging memfd.
  void ServeStage(Connection& c);
  // push_request.cc: WDP1 and WDC1. The header arrived (a CUDA push's
  // target too): checks it and its lease; reads its offsets next, or
  // starts it.
  void OnPushHeader(Connection& c);
  // The push's request is complete: hands it to a push thread, or answers
  // why not (an export goes to StartExport).
  void StartPush(Connection& c);
  // Counts the push against its uid, starts the push threads if needed and
  // runs `run` (RunPush, RunExport) with the push's task on one; refused:
  // answered, the push's fds discarded.
  void QueuePush(Connection& c, PendingPush push, void (DataServer::*run)(PushTask));
  // Runs on a push thread: writes, then queues the answer.
  void RunPush(PushTask task) ABSL_LOCKS_EXCLUDED(done_mu_, closer_mu_);
  // export_request.cc: WDC1 with handle kind kCudaDaemonExport.
  void StartExport(Connection& c, PendingPush push);
  // Runs on a push thread: the export's buffer (filled now, or cached),
  // then queues the answer.
  void RunExport(PushTask task) ABSL_LOCKS_EXCLUDED(done_mu_);
  // Answers a finished export that has a buffer: the client's own fd of it.
  void AnswerExport(Connection& c, PushDone& done);

  // Queues a finished push's or export's answer for the polling thread.
  void Finish(PushDone done) ABSL_LOCKS_EXCLUDED(done_mu_);
  // Closes fds clients sent that the daemon lets go of, on the closer
  // thread where it can start one.
  void Discard(std::vector<UniqueFd> fds) ABSL_LOCKS_EXCLUDED(closer_mu_);

  // Constant after construction.
  const Options options_;
  LeaseTable* const leases_;
  // options_.host_memory, or own_memory_.
  std::unique_ptr<HostMemoryManager> own_memory_;
  HostMemoryManager* const host_memory_;
  // The host writer, then options_.push_writers.
  const PushWriters writers_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd that breaks poll() on Stop()
  UniqueFd done_fd_;  // eventfd: a push finished (see done_)

  // Own synchronization.
  std::atomic<uint64_t> reclaimer_{0};  // on host_memory_, until Stop()
  std::atomic<bool> stopping_{false};
  std::atomic<bool> keep_file_{false};
  AcceptPause pause_;  // after wake_fd_, whose fd it borrows
  // Exported buffers (kCudaDaemonExport), per device; after options_,
  // before everything that holds them (done_, the connections).
  ExportCache exports_;
  std::atomic<uint64_t> open_{0};

  // Touched by the polling thread only (Run and what it calls), until
  // Stop() joins it.
  Connections conns_;
  ConnectionLimits limits_;
  uint64_t next_id_ = 1;
  absl::Time accept_resume_ = absl::InfinitePast();
  absl::Duration accept_backoff_;
  absl::Time refusal_logged_ = absl::InfinitePast();
  uint64_t refused_since_log_ = 0;
  // Started with the first push (a daemon that never sees one starts no
  // thread for it; under a thread limit that matters); joined by Stop()
  // after thread_.
  std::unique_ptr<ThreadPool> push_pool_;

  // Protected by done_mu_.
  absl::Mutex done_mu_;
  std::vector<PushDone> done_ ABSL_GUARDED_BY(done_mu_);

  // Protected by closer_mu_. Closes fds clients sent that the daemon lets
  // go of: close() of a file on a FUSE mount waits for its server, never on
  // the polling thread or the push threads. Started when first needed
  // (without it, the fds are closed where they are let go of); joined by
  // Stop() last.
  absl::Mutex closer_mu_;
  std::unique_ptr<ThreadPool> closer_ ABSL_GUARDED_BY(closer_mu_);

  // The polling thread; last, so that it starts once everything above is.
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_H_
