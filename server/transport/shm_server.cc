#include "server/transport/shm_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <vector>

#include "common/log.h"
#include "absl/strings/str_cat.h"
#include "common/data_protocol.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

struct Connection {
  UniqueFd fd;
  uint64_t id = 0;
  AttachRequest request{};
  size_t received = 0;
  PeerIdentity peer;
  absl::Status admitted;  // not OK: every request gets this answer
};

absl::Status SendReply(int sock, const absl::Status& status, absl::Span<const int> fds) {
  std::string msg(status.message().substr(0, kMaxReplyMessage));
  AttachReply reply;
  std::memcpy(reply.magic, kReplyMagic, 4);
  reply.code = static_cast<int32_t>(status.code());
  reply.num_fds = static_cast<uint32_t>(fds.size());
  reply.message_len = static_cast<uint32_t>(msg.size());
  std::string wire(reinterpret_cast<const char*>(&reply), sizeof(reply));
  wire += msg;
  size_t first = std::min(fds.size(), kMaxFdsPerMessage);
  WD_RETURN_IF_ERROR(SendWithFds(sock, wire, fds.subspan(0, first)));
  for (size_t done = first; done < fds.size(); done += kMaxFdsPerMessage) {
    size_t n = std::min(kMaxFdsPerMessage, fds.size() - done);
    WD_RETURN_IF_ERROR(SendWithFds(sock, absl::string_view("F", 1), fds.subspan(done, n)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmDataServer>> ShmDataServer::Start(Options options,
                                                                     LeaseTable* leases) {
  WD_ASSIGN_OR_RETURN(UniqueFd listen_fd, ListenUnixWithMode(options.path, options.mode));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(errno, "eventfd");
  auto server = std::unique_ptr<ShmDataServer>(
      new ShmDataServer(std::move(options), leases, std::move(listen_fd), std::move(wake)));
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

ShmDataServer::ShmDataServer(Options options, LeaseTable* leases, UniqueFd listen_fd,
                             UniqueFd wake_fd)
    : options_(std::move(options)),
      leases_(leases),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)) {}

ShmDataServer::~ShmDataServer() { Stop(); }

void ShmDataServer::Stop() {
  if (stopping_.exchange(true)) {
    if (thread_.joinable()) thread_.join();
    return;
  }
  uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  ::unlink(options_.path.c_str());
}

void ShmDataServer::Run() {
  std::map<int, Connection> conns;  // by fd
  uint64_t next_id = 1;
  auto close_conn = [&](std::map<int, Connection>::iterator it) {
    size_t ended = leases_->ReleaseConnection(it->second.id);
    if (ended > 0) {
      LogEvent(LogLevel::kDebug, "lease_end",
               {{"connection", absl::StrCat(it->second.id)},
                {"leases", absl::StrCat(ended)},
                {"reason", "data connection closed"}});
    }
    conns.erase(it);
    open_.fetch_sub(1);
  };
  std::vector<pollfd> pfds;
  while (!stopping_.load()) {
    pfds.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (auto& [fd, c] : conns) pfds.push_back({fd, POLLIN, 0});
    int n = ::poll(pfds.data(), pfds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      WD_LOG(ERROR) << "data socket poll: " << std::strerror(errno);
      break;
    }
    if (pfds[0].revents) break;
    if (pfds[1].revents & POLLIN) {
      while (true) {
        int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) break;
        UniqueFd owned(fd);
        Connection c;
        auto peer = ReadPeerIdentity(fd);
        if (!peer.ok()) {
          c.admitted = peer.status();
        } else {
          c.peer = std::move(*peer);
          if (options_.authorize) c.admitted = options_.authorize(c.peer);
        }
        if (!c.admitted.ok()) {
          LogEvent(LogLevel::kWarning, "data_peer_refused",
                   {{"peer", c.peer.Describe()}, {"error", c.admitted.ToString()}});
        }
        c.id = next_id++;
        c.fd = std::move(owned);
        conns.emplace(fd, std::move(c));
        open_.fetch_add(1);
      }
    }
    for (size_t i = 2; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      auto it = conns.find(pfds[i].fd);
      if (it == conns.end()) continue;
      Connection& c = it->second;
      auto* buf = reinterpret_cast<uint8_t*>(&c.request);
      ssize_t got = ::recv(c.fd.get(), buf + c.received, sizeof(AttachRequest) - c.received,
                           MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got <= 0) {
        close_conn(it);
        continue;
      }
      c.received += static_cast<size_t>(got);
      if (c.received < sizeof(AttachRequest)) continue;
      c.received = 0;
      if (std::memcmp(c.request.magic, kAttachMagic, 4) != 0) {
        (void)SendReply(c.fd.get(), absl::InvalidArgumentError("bad attach request magic"), {});
        close_conn(it);
        continue;
      }
      if (!c.admitted.ok()) {
        (void)SendReply(c.fd.get(), c.admitted, {});
        close_conn(it);
        continue;
      }
      absl::Status status;
      if (options_.authorize_attach) status = options_.authorize_attach(c.peer, c.request.lease_id);
      std::vector<int> fds;
      if (status.ok()) {
        absl::string_view token(reinterpret_cast<const char*>(c.request.token), 16);
        auto contents = leases_->Attach(c.request.lease_id, token, c.id);
        status = contents.status();
        if (contents.ok()) {
          for (const SegmentPtr& seg : (*contents)->segments) fds.push_back(seg->fd());
        }
      }
      if (!status.ok() && absl::IsPermissionDenied(status)) {
        LogEvent(LogLevel::kWarning, "attach_refused",
                 {{"peer", c.peer.Describe()},
                  {"lease", absl::StrCat(c.request.lease_id)},
                  {"error", std::string(status.message())}});
      }
      absl::Status sent = SendReply(c.fd.get(), status, fds);
      if (!sent.ok()) {
        WD_LOG(WARNING) << "data connection " << c.id << ": " << sent;
        close_conn(it);
      }
    }
  }
  while (!conns.empty()) close_conn(conns.begin());
}

}  // namespace weightd
