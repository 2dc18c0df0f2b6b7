#include "server/grpc/call_auth.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <grpcpp/security/auth_context.h>
#include <grpcpp/server_posix.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "common/status_macros.h"

namespace weightd {

void UnixPeerRegistry::Set(int fd, PeerIdentity peer) {
  absl::MutexLock lock(&mu_);
  peers_[fd] = std::move(peer);
}

std::optional<PeerIdentity> UnixPeerRegistry::Find(int fd) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<Principal> CallAuthenticator::Authenticate(
    grpc::CallbackServerContext* ctx) const {
  if (drain_ != nullptr) WD_RETURN_IF_ERROR(drain_->CheckOpen());
  const std::string peer = ctx->peer();
  if (absl::StartsWith(peer, "fd:")) {
    int fd = -1;
    std::optional<PeerIdentity> id;
    if (absl::SimpleAtoi(absl::string_view(peer).substr(3), &fd)) id = peers_->Find(fd);
    if (!id.has_value()) {
      return absl::PermissionDeniedError(absl::StrCat("unknown Unix-socket connection ", peer));
    }
    Principal p = Principal::UnixPeer(std::move(*id));
    WD_RETURN_IF_ERROR(policy_->AdmitPeer(p));
    return p;
  }
  // TCP (ipv4:/ipv6:). The client certificate, when --tls-client-ca made
  // gRPC require and verify one.
  std::string cn;
  std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& v : auth->FindPropertyValues("x509_common_name")) {
      cn.assign(v.data(), v.size());
    }
  }
  std::string token_name;
  if (tokens_ != nullptr) {
    std::optional<absl::string_view> header;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it != md.end()) header = absl::string_view(it->second.data(), it->second.size());
    WD_ASSIGN_OR_RETURN(token_name, tokens_->Authenticate(header));
  }
  return Principal::Tcp(std::move(token_name), std::move(cn));
}

absl::StatusOr<Principal> CallAuthenticator::AuthenticateAdmin(grpc::CallbackServerContext* ctx,
                                                               absl::string_view action) const {
  WD_ASSIGN_OR_RETURN(Principal p, Authenticate(ctx));
  WD_RETURN_IF_ERROR(policy_->CheckAdmin(p, action));
  return p;
}

absl::StatusOr<std::unique_ptr<UnixGrpcAcceptor>> UnixGrpcAcceptor::Start(
    const std::string& path, mode_t mode, grpc::Server* server, UnixPeerRegistry* peers,
    int adopt_fd) {
  UniqueFd listen_fd;
  if (adopt_fd >= 0) {
    listen_fd.Reset(adopt_fd);
  } else {
    WD_ASSIGN_OR_RETURN(listen_fd, ListenUnixWithMode(path, mode));
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(errno, "eventfd");
  auto acceptor = std::unique_ptr<UnixGrpcAcceptor>(
      new UnixGrpcAcceptor(path, std::move(listen_fd), std::move(wake), server, peers));
  acceptor->thread_ = std::thread([a = acceptor.get()] {
    a->Run();
    a->pause_.Exited();
  });
  return acceptor;
}

UnixGrpcAcceptor::UnixGrpcAcceptor(std::string path, UniqueFd listen_fd, UniqueFd wake_fd,
                                   grpc::Server* server, UnixPeerRegistry* peers)
    : path_(std::move(path)),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      server_(server),
      peers_(peers),
      pause_(wake_fd_.get()) {}

UnixGrpcAcceptor::~UnixGrpcAcceptor() { Stop(); }

void UnixGrpcAcceptor::Stop() {
  if (stopped_.exchange(true)) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  listen_fd_.Reset();
  if (!keep_file_.load()) ::unlink(path_.c_str());
}

void UnixGrpcAcceptor::Run() {
  while (true) {
    const bool accepting = pause_.AcceptAllowed();
    // A negative fd is ignored by poll(): the listen socket while paused.
    pollfd pfds[2] = {{wake_fd_.get(), POLLIN, 0},
                      {accepting ? listen_fd_.get() : -1, POLLIN, 0}};
    int n = ::poll(pfds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      WD_LOG(ERROR) << "gRPC socket poll: " << std::strerror(errno);
      return;
    }
    if (pfds[0].revents) {
      if (stopped_.load()) return;
      uint64_t count;  // a pause or resume: seen at the top of the loop
      (void)!::read(wake_fd_.get(), &count, sizeof(count));
      continue;
    }
    while (true) {
      int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
          WD_LOG(WARNING) << "gRPC socket accept: " << std::strerror(errno);
          // EMFILE and friends: back off instead of spinning on poll.
          ::usleep(10000);
        }
        break;
      }
      auto peer = ReadPeerIdentity(fd);
      if (!peer.ok()) {
        WD_LOG(WARNING) << "gRPC socket: " << peer.status();
        ::close(fd);
        continue;
      }
      // Refused peers are still handed to gRPC: each of their calls is then
      // answered PERMISSION_DENIED naming them (CallAuthenticator), which
      // clients do not retry, instead of a bare connection reset.
      peers_->Set(fd, std::move(*peer));
      grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns fd now
    }
  }
}

bool IsLoopbackListenAddress(const std::string& host_port) {
  std::string host = host_port;
  if (absl::StartsWith(host, "[")) {
    size_t close = host.find(']');
    host = close == std::string::npos ? host : host.substr(1, close - 1);
  } else if (size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  if (host == "localhost" || host == "::1") return true;
  // A dotted-quad 127.x.y.z, not a host name that merely starts so.
  if (!absl::StartsWith(host, "127.") || std::count(host.begin(), host.end(), '.') != 3) {
    return false;
  }
  return std::all_of(host.begin(), host.end(),
                     [](char c) { return c == '.' || (c >= '0' && c <= '9'); });
}

}  // namespace weightd
