// Turns a gRPC call into a Principal (server/auth/access_control.h) and
// accepts the Unix-socket connections that make such calls possible.
//
// gRPC does not tell a handler the SO_PEERCRED of a Unix-socket caller, so
// the daemon accepts on the socket itself (UnixGrpcAcceptor), reads the
// peer's credentials, remembers them by fd and hands the fd to gRPC
// (grpc::AddInsecureChannelFromFd), whose calls then report the peer
// "fd:<N>". A live call keeps its transport, and so its fd, open: the fd
// cannot be closed and reused by another connection while a handler looks
// it up.
//
// TCP callers are identified by their bearer token (BearerTokens) and, with
// --tls-client-ca, the verified client-certificate CN.
#ifndef WEIGHTD_SERVER_GRPC_CALL_AUTH_H_
#define WEIGHTD_SERVER_GRPC_CALL_AUTH_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/base/accept_pause.h"
#include "common/fd.h"
#include "server/grpc/call_drain.h"
#include "server/auth/access_control.h"

namespace weightd {

// The identity of each connection accepted on the gRPC Unix socket, by fd.
// An entry is replaced when its fd number is reused by a newer connection
// (so there is at most one per fd number); gRPC does not say when it closes
// one. Thread-safe.
class UnixPeerRegistry {
 public:
  void Set(int fd, PeerIdentity peer) ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<PeerIdentity> Find(int fd) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, PeerIdentity> peers_ ABSL_GUARDED_BY(mu_);
};

class CallAuthenticator {
 public:
  // `policy`, `peers`, `drain` borrowed; `tokens` null = TCP callers need
  // no token; `drain` null = never draining.
  CallAuthenticator(const AccessPolicy* policy, const UnixPeerRegistry* peers,
                    std::shared_ptr<const BearerTokens> tokens, const CallDrain* drain = nullptr)
      : policy_(policy), peers_(peers), tokens_(std::move(tokens)), drain_(drain) {}

  // Who is calling, if they may use the daemon at all: UNAVAILABLE once the
  // daemon drains for shutdown (CallDrain), PERMISSION_DENIED
  // for a Unix peer outside --allow-uid/--allow-gid, UNAUTHENTICATED for a
  // TCP caller without a valid bearer token (when tokens are configured).
  absl::StatusOr<Principal> Authenticate(grpc::CallbackServerContext* ctx) const;
  // Authenticate, then AccessPolicy::CheckAdmin(action).
  absl::StatusOr<Principal> AuthenticateAdmin(grpc::CallbackServerContext* ctx,
                                              absl::string_view action) const;

  const AccessPolicy& policy() const { return *policy_; }

 private:
  const AccessPolicy* const policy_;
  const UnixPeerRegistry* const peers_;
  const std::shared_ptr<const BearerTokens> tokens_;
  const CallDrain* const drain_;
};

// Accepts connections on the gRPC Unix socket for `server` (already
// started), recording each peer in `peers`. One thread; Stop() joins it.
class UnixGrpcAcceptor {
 public:
  // `adopt_fd` >= 0: a socket already listening at `path` (a predecessor's,
  // at a hand-over), owned from now on, instead of binding one.
  static absl::StatusOr<std::unique_ptr<UnixGrpcAcceptor>> Start(const std::string& path,
                                                                 mode_t mode,
                                                                 grpc::Server* server,
                                                                 UnixPeerRegistry* peers,
                                                                 int adopt_fd = -1);
  ~UnixGrpcAcceptor();  // Stop()s
  // Stops accepting and unlinks the socket file (unless KeepSocketFile());
  // open connections stay with gRPC. Idempotent.
  void Stop();
  // A hand-over: no accepts from when Pause() returns until Resume(); the
  // listening socket stays open (a successor accepts on it).
  void Pause() { pause_.Pause(); }
  void Resume() { pause_.Resume(); }
  void KeepSocketFile(bool keep = true) { keep_file_.store(keep); }
  int listen_fd() const { return listen_fd_.get(); }

 private:
  UnixGrpcAcceptor(std::string path, UniqueFd listen_fd, UniqueFd wake_fd, grpc::Server* server,
                   UnixPeerRegistry* peers);
  void Run();

  const std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;
  grpc::Server* const server_;
  UnixPeerRegistry* const peers_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> keep_file_{false};
  AcceptPause pause_;  // after wake_fd_, whose fd it borrows
  std::thread thread_;
};

// True when HOST of HOST:PORT is a loopback name or address (localhost,
// 127.0.0.0/8, ::1).
bool IsLoopbackListenAddress(const std::string& host_port);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_CALL_AUTH_H_
