// One connection of the data socket (data_server.h) as its polling thread
// sees it: the socket and its peer, the request being read (a 32-byte
// header, then for a CUDA push its CudaPushTarget, then for a push its
// offsets: common/data_protocol.h), the reply being sent, and what the
// connection holds while it is open (the buffers and fds its reply hands
// over, the exports it took). ConnectionLimits, below, caps connections
// and pushes per peer uid.
//
// Reading never blocks and never piles up fds: fds are taken only with a
// request's first byte (where a push's rides), at most kMaxFdsPerRequest;
// the kernel discards any sent with later bytes. Replying never blocks
// either: Flush sends what the socket takes and keeps the rest. A
// connection's next request is read only once its reply is out, so a
// client that sends requests and reads no reply holds one reply, no more.
//
// Not thread-safe: both classes are owned by the polling thread. A push
// thread never touches a Connection; it is handed what it needs.
#ifndef WEIGHTD_SERVER_TRANSPORT_CONNECTION_H_
#define WEIGHTD_SERVER_TRANSPORT_CONNECTION_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/data_protocol.h"
#include "common/fd.h"
#include "server/lease/lease_table.h"
#include "server/memory/buffer.h"
#include "server/push/export_cache.h"
#include "server/auth/peer_identity.h"

namespace weightd {

// The most fds one request may carry: a push carries one; more arrive only
// from a client that errs, and are refused (the excess is closed by the
// kernel: MSG_CTRUNC).
inline constexpr size_t kMaxFdsPerRequest = 4;

// A push whose request is complete, taken from its connection to start.
struct PendingPush {
  std::shared_ptr<const LeaseContents> lease;
  std::vector<uint64_t> offsets;  // empty: the default layout
  std::optional<CudaPushTarget> cuda;  // a CUDA push's (or an export's) target
  std::vector<UniqueFd> fds;           // what rode on the request
  bool fds_truncated = false;          // the kernel dropped some (too many)
};

class Connection {
 public:
  // `admitted` not OK: every request gets it as its answer.
  Connection(UniqueFd fd, uint64_t id, PeerIdentity peer, bool counted, absl::Status admitted);
  Connection(Connection&&) = default;
  Connection& operator=(Connection&&) = default;

  int fd() const { return fd_.get(); }
  // Unique for the server's life (an fd may be reused once closed).
  uint64_t id() const { return id_; }
  const PeerIdentity& peer() const { return peer_; }
  // Counted against peer().uid's cap (ConnectionLimits::Admit).
  bool counted() const { return counted_; }
  const absl::Status& admitted() const { return admitted_; }

  // Reading. What Receive() completed: a request's header (request()),
  // a CUDA push's target (after ExpectCudaTarget), a push's offsets (after
  // ExpectOffsets); kNothing yet; kClosed when the peer closed or the
  // connection broke.
  enum class Part { kNothing, kHeader, kCudaTarget, kOffsets, kClosed };
  Part Receive();
  const AttachRequest& request() const { return request_; }
  // The next part read is a CudaPushTarget; then `offsets` u64s.
  void ExpectCudaTarget();
  void ExpectOffsets(uint32_t count);
  // The fds that came with the request (and whether the kernel dropped
  // some), handed to the caller; the connection keeps none.
  std::vector<UniqueFd> TakeFds(bool* truncated = nullptr);

  // A push being read: its lease (attached when its header arrived), then
  // everything at once when its request is complete.
  void HoldPushLease(std::shared_ptr<const LeaseContents> lease);
  PendingPush TakePush();
  // On a push thread: read nothing, poll nothing, until it is answered.
  bool pushing() const { return pushing_; }
  void set_pushing(bool pushing) { pushing_ = pushing; }

  // Replying. Queues the reply to one request: the header and message
  // carry the first batch of `fds`, each further batch rides on one byte
  // of its own. An OK reply's message is `payload` (an export's
  // ExportInfo). The fds must stay open until sent: Pin / KeepUntilSent.
  void QueueReply(const absl::Status& status, absl::Span<const int> fds = {},
                  absl::string_view payload = {});
  // Keeps `buffers` (their fds) / `fd` open until the reply is sent.
  void Pin(absl::Span<const BufferPtr> buffers);
  void KeepUntilSent(UniqueFd fd);
  // Sends what the socket takes of the queued reply. OK with nothing left:
  // all sent (what was pinned for it is let go); OK with some left: the
  // socket is full (poll for POLLOUT).
  absl::Status Flush();
  bool replying() const { return !out_.empty(); }
  // Closed once the reply is out (its stream cannot be trusted any more).
  void CloseAfterReply() { close_after_reply_ = true; }
  bool finished() const { return out_.empty() && close_after_reply_; }
  // An exported buffer this connection took: held while it is open.
  void HoldExport(ExportHold hold) { exports_.push_back(std::move(hold)); }

 private:
  // One message of a reply not yet (fully) sent: its fds ride on its first
  // byte.
  struct Outgoing {
    std::string bytes;
    std::vector<int> fds;
    size_t sent = 0;
  };
  // Receives what the socket has of `size` bytes into `buf`; `first`: the
  // request's first byte, which may carry fds. Returns the bytes received;
  // 0 with `*closed` when the peer closed (or the connection broke).
  size_t TryRecv(void* buf, size_t size, bool first, bool* closed);
  // Reads on into `part` (`*received` of `size` bytes so far): whether it
  // is complete, or kClosed.
  Part ReceiveInto(void* part, size_t size, size_t* received, bool fds, Part done);

  // The connection: constant after construction.
  UniqueFd fd_;
  uint64_t id_ = 0;
  PeerIdentity peer_;
  bool counted_ = false;
  absl::Status admitted_;

  // The request being read.
  AttachRequest request_{};
  size_t received_ = 0;
  CudaPushTarget cuda_target_{};
  size_t target_received_ = 0;
  bool reading_target_ = false;
  bool cuda_push_ = false;  // this push's target has been read
  std::vector<uint64_t> offsets_;
  size_t offsets_received_ = 0;  // bytes
  bool reading_offsets_ = false;
  std::shared_ptr<const LeaseContents> push_lease_;
  std::vector<UniqueFd> fds_in_;
  bool fds_truncated_ = false;
  bool pushing_ = false;

  // The reply being sent. Requests are read only while it is empty.
  std::deque<Outgoing> out_;
  std::vector<BufferPtr> pinned_;  // keeps the fds in `out_` open
  std::vector<UniqueFd> owned_;    // as pinned_, fds of the daemon's own (staging, exports)
  bool close_after_reply_ = false;
  // What the connection holds while it is open.
  std::vector<ExportHold> exports_;
};

// Caps on the data socket's open connections, in all and per peer uid, and
// on each uid's pushes queued or running (data_server.h Options say what
// they are for). Refusals are RESOURCE_EXHAUSTED naming the flag.
class ConnectionLimits {
 public:
  struct Options {
    size_t max_connections = 0;          // > 0
    size_t max_connections_per_uid = 0;  // > 0
    size_t max_pushes_per_uid = 0;       // 0: none
  };
  explicit ConnectionLimits(Options options) : options_(options) {}

  // A new connection of `uid`, with `open` connections open now: counted,
  // or refused (and not counted).
  absl::Status Admit(uid_t uid, size_t open);
  // A connection Admit counted closed.
  void Leave(uid_t uid);
  // A push of `uid` is queued: counted, or refused (and not counted).
  absl::Status StartPush(uid_t uid);
  // A push StartPush counted was answered.
  void EndPush(uid_t uid);

 private:
  // Constant after construction.
  const Options options_;
  // Open connections and pushes queued or running, per uid (none: absent).
  absl::flat_hash_map<uid_t, size_t> connections_;
  absl::flat_hash_map<uid_t, size_t> pushes_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_TRANSPORT_CONNECTION_H_
