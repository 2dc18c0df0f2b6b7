// Hand-over on upgrade (docs/restarts.md): a new daemon started with
// --take-over receives the running daemon's checkpoint segments and
// listening sockets, restores the same state from the same --state-dir
// without reading the checkpoints again, and takes over the sockets while
// the old daemon drains and exits; clients see no refused connection.
//
// The old daemon listens on its hand-over socket (--handover-socket,
// default <state-dir>/handover.sock, bound, connected and removed relative
// to the state directory; mode 0600, and only a peer of the daemon's own
// uid is served). The successor in turn takes sockets only from a
// predecessor of its own uid or root (SO_PEERCRED): a user who could bind
// the socket's path cannot hand it listening sockets of its own. One
// successor at a time; the conversation is
//
//   successor                       predecessor
//   BEGIN {pid, host}         ->
//                                   closes changes (loads, unloads, applies,
//                                   publishes: UNAVAILABLE), waits for those
//                                   in flight and for published saves
//                             <-    MANIFEST (JSON, in parts) and FDS: the
//                                   gRPC and data listening sockets, then
//                                   every resident checkpoint's segments
//   restores from --state-dir,
//   adopting the segments
//   READY                     ->
//                                   refuses new calls (UNAVAILABLE: clients
//                                   retry), stops accepting, frees the
//                                   metrics port
//                             <-    GO
//   serves on the sockets
//   STARTED                   ->
//                             <-    DONE; shuts down as on SIGTERM, leaving
//                                   the socket files, and exits 0
//   commits its journal
//
// Every message is "WDH1" | u8 kind | 3 zero bytes | u32 length (LE) |
// payload; fds ride on a message's header (SCM_RIGHTS, at most 250 each).
// Until GO the predecessor owns the outcome: a successor that closes the
// connection, lies (a malformed message) or stalls past the timeouts leaves
// it serving exactly as before (changes reopened, accepting again). After
// GO the successor serves on the shared sockets and keeps their files
// whatever happens; the predecessor resumes if the successor goes away or
// stalls before STARTED, and a successor that then gets no DONE exits (so
// they never both serve for long). A predecessor stopped (SIGTERM) after GO
// leaves the socket files to the successor. A daemon refuses to hand back
// to the host (pod) it took over from: a restarted container of the
// replaced pod must not take the sockets back.
// Leases do not move: the successor's lease ids continue past the
// predecessor's, an attach of a predecessor's lease is UNAVAILABLE (the
// client fetches again, from the successor) and its Release is OK; the
// clients' mappings keep their bytes either way.
#ifndef WEIGHTD_SERVER_DAEMON_HANDOVER_H_
#define WEIGHTD_SERVER_DAEMON_HANDOVER_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd.h"
#include "server/state/state_dir.h"
#include "server/store/donated_checkpoints.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

// Where the hand-over socket is: `name` in the state directory `dir`
// (StateDir::ListenUnix/ConnectUnix/Remove: no link followed), or, with no
// `dir`, the path `name` (--handover-socket elsewhere).
struct HandoverSocket {
  std::shared_ptr<const StateDir> dir;
  std::string name;
  std::string Describe() const { return dir != nullptr ? dir->PathOf(name) : name; }
};

// What a predecessor hands over: the manifest (JSON) and the fds it names,
// borrowed from whatever `keep_alive` holds until they are sent.
struct HandoverOffer {
  std::string manifest;  // MakeHandoverOffer
  std::vector<int> fds;
  std::shared_ptr<const void> keep_alive;
};

// A model as the predecessor serves it: the successor must restore it so.
struct HandoverModel {
  std::string name;
  uint64_t generation = 0;
  std::string content;  // hex digest of the served content (weights_id)
  bool operator==(const HandoverModel& o) const {
    return name == o.name && generation == o.generation && content == o.content;
  }
};

// The offer of a daemon: its pid, host, --state-dir, models, its
// listening sockets and every checkpoint in `resident` with the segment
// size it was laid out with and each tensor's digest and place. (The next
// lease id comes with GO, once no call can grant another.)
HandoverOffer MakeHandoverOffer(const std::string& state_dir, int grpc_listen_fd, int data_listen_fd, int handover_listen_fd,
                                const ResidentCheckpoints& resident,
                                uint64_t segment_target_bytes,
                                const std::vector<HandoverModel>& models);

// This machine's host name (a pod's name in Kubernetes).
std::string HostName();

// What a successor received.
struct HandoverReceived {
  int64_t pid = 0;
  std::string state_dir;  // the predecessor's --state-dir (its journal)
  std::string host;
  std::vector<HandoverModel> models;  // by name
  UniqueFd grpc_listen_fd;
  UniqueFd data_listen_fd;
  UniqueFd handover_listen_fd;  // the successor serves its own successor on it
  std::vector<DonatedCheckpoint> checkpoints;
  uint64_t segment_bytes = 0;  // of all the checkpoints' segments
};

// Parses a manifest and takes its fds (in order). INVALID_ARGUMENT naming
// what is wrong for a manifest that does not match its fds.
absl::StatusOr<HandoverReceived> ParseHandoverManifest(const std::string& manifest,
                                                       std::vector<UniqueFd> fds);

// The predecessor's side: a thread serving the hand-over socket, one
// successor's conversation at a time; the hooks run on that thread.
// Thread-safe. Owns the listening socket, its wake-up eventfd and the
// thread.
class HandoverServer {
 public:
  struct Hooks {
    // BEGIN from `successor_pid` on `successor_host`: close changes, wait
    // for what is in flight, describe what is served. An error is sent to
    // the successor (the daemon serves on unchanged; `resume` is called).
    std::function<absl::StatusOr<HandoverOffer>(int64_t successor_pid,
                                                const std::string& successor_host)>
        begin;
    // READY: stop serving and accepting; returns the lease id past every
    // lease granted (sent with GO).
    std::function<uint64_t()> pause;
    // The successor failed before STARTED: serve again as before `begin`.
    std::function<void(const absl::Status& why)> resume;
    // STARTED (DONE sent): the successor serves; shut down, leaving the
    // socket files.
    std::function<void()> handed_over;
  };
  struct Timeouts {
    absl::Duration message = absl::Seconds(30);  // BEGIN, GO..STARTED, each part
    absl::Duration restore = absl::Minutes(30);  // MANIFEST..READY (the restore)
  };

  // `adopt_fd` >= 0: the predecessor's hand-over socket, already listening
  // at `where` (owned from now on), instead of binding one.
  static absl::StatusOr<std::unique_ptr<HandoverServer>> Start(const HandoverSocket& where,
                                                               Hooks hooks, Timeouts timeouts,
                                                               int adopt_fd = -1);
  static absl::StatusOr<std::unique_ptr<HandoverServer>> Start(const HandoverSocket& where,
                                                               Hooks hooks) {
    return Start(where, std::move(hooks), Timeouts());
  }
  int listen_fd() const { return listen_fd_.get(); }
  // True once a successor serves, or may: handed over, or cut off by Stop()
  // after GO. The socket files are then the successor's.
  bool successor_may_serve() const { return handed_over_.load() || abandoned_.load(); }
  ~HandoverServer();  // Stop()s
  // Stops serving; the socket file is removed unless a hand-over completed
  // (the successor then owns the path). Waits for a conversation in
  // progress to end. Idempotent.
  void Stop();

 private:
  HandoverServer(HandoverSocket where, UniqueFd listen_fd, UniqueFd wake_fd, Hooks hooks,
                 Timeouts timeouts);
  void Run();
  // One successor's conversation; true when it completed (STARTED).
  bool Serve(int fd);

  // Constant after construction (listen_fd_ is closed by Stop(), once the
  // thread is joined).
  const HandoverSocket where_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;
  const Hooks hooks_;
  const Timeouts timeouts_;

  // Own synchronization.
  std::atomic<bool> stopped_{false};
  std::atomic<bool> handed_over_{false};
  std::atomic<bool> abandoned_{false};  // cut by Stop() after GO
  std::atomic<int> conn_fd_{-1};  // the conversation's socket (Stop() cuts it)
  std::thread thread_;  // started by Start(), joined by Stop()
};

// The successor's side: one conversation with the predecessor, over the
// connection it owns. Not thread-safe; owned by one thread.
class HandoverClient {
 public:
  // Connects to the predecessor's hand-over socket: NOT_FOUND when nothing
  // listens there (no socket file, or a stale one), UNAVAILABLE when it
  // does not answer, PERMISSION_DENIED when the process listening runs as
  // another uid than this one's effective uid and not as root (SO_PEERCRED;
  // nothing is sent to it). Then sends BEGIN and receives the manifest and
  // fds (FAILED_PRECONDITION with the predecessor's reason when it refuses).
  static absl::StatusOr<std::unique_ptr<HandoverClient>> Begin(const HandoverSocket& where,
                                                               absl::Duration timeout);
  HandoverReceived& received() { return received_; }
  // READY, then waits for GO; returns the lease id past every lease the
  // predecessor granted (LeaseTable::InheritIdsBelow).
  absl::StatusOr<uint64_t> Ready(absl::Duration timeout);
  // STARTED, then waits for DONE: the predecessor exits now. An error
  // means it may have resumed serving: this daemon must exit at once,
  // leaving the socket files.
  absl::Status Started(absl::Duration timeout);

 private:
  explicit HandoverClient(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
  HandoverReceived received_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_HANDOVER_H_
