#include "common/unix_socket.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

absl::StatusOr<sockaddr_un> MakeAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path \"", path, "\" is empty or longer than ",
        sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

}  // namespace

absl::Status RemoveStaleSocket(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, absl::StrCat("stat ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
  }
  auto addr = MakeAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe.valid()) return ErrnoStatus(errno, "socket");
  int rc;
  do {
    rc = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_un));
  } while (rc != 0 && errno == EINTR);
  const int err = rc == 0 ? 0 : errno;
  // A full backlog (EAGAIN) is a live listener too.
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is already in use: a live process (another weightd?) accepts connections on "
              "it; stop it first or choose another socket path"));
  }
  if (err != ECONNREFUSED && err != ENOENT) {
    return ErrnoStatus(err, absl::StrCat("probing the socket ", path, " before replacing it"));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("removing the stale socket ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode) {
  auto addr = MakeAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  if (absl::Status s = RemoveStaleSocket(path); !s.ok()) return s;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr),
             sizeof(sockaddr_un)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("bind ", path));
  }
  if (::chmod(path.c_str(), mode) != 0) {
    return ErrnoStatus(errno, absl::StrCat("chmod ", path));
  }
  if (::listen(fd.get(), 256) != 0) {
    return ErrnoStatus(errno, absl::StrCat("listen ", path));
  }
  return fd;
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  auto addr = MakeAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr),
                sizeof(sockaddr_un)) != 0) {
    int err = errno;
    return absl::UnavailableError(
        absl::StrCat("connect ", path, ": ", std::strerror(err)));
  }
  return fd;
}

absl::StatusOr<std::string> BoundUnixPath(int fd) {
  sockaddr_un addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return ErrnoStatus(errno, "getsockname");
  }
  if (addr.sun_family != AF_UNIX || len <= offsetof(sockaddr_un, sun_path) ||
      addr.sun_path[0] == '\0') {
    return absl::InvalidArgumentError(absl::StrCat("fd ", fd, " is not a Unix socket bound to a path"));
  }
  return std::string(addr.sun_path, strnlen(addr.sun_path, sizeof(addr.sun_path)));
}

namespace {

// One sendmsg of `data` with `fds` attached; -1 with errno on failure.
ssize_t SendMsgWithFds(int sock, absl::string_view data, absl::Span<const int> fds,
                       int flags) {
  iovec iov{const_cast<char*>(data.data()), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
  } while (n < 0 && errno == EINTR);
  return n;
}

absl::Status CheckSendArgs(absl::string_view data, absl::Span<const int> fds) {
  if (data.empty()) return absl::InvalidArgumentError("SendWithFds: no data");
  if (fds.size() > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError("SendWithFds: too many fds");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SendWithFds(int sock, absl::string_view data,
                         absl::Span<const int> fds) {
  if (absl::Status s = CheckSendArgs(data, fds); !s.ok()) return s;
  ssize_t n = SendMsgWithFds(sock, data, fds, 0);
  if (n < 0) return ErrnoStatus(errno, "sendmsg");
  // The fds went with the first byte; send whatever the kernel did not take.
  if (static_cast<size_t>(n) < data.size()) {
    return SendAll(sock, data.data() + n, data.size() - n);
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> TrySendWithFds(int sock, absl::string_view data,
                                      absl::Span<const int> fds) {
  if (absl::Status s = CheckSendArgs(data, fds); !s.ok()) return s;
  ssize_t n = SendMsgWithFds(sock, data, fds, MSG_DONTWAIT);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
    return ErrnoStatus(errno, "sendmsg");
  }
  return static_cast<size_t>(n);
}

absl::Status RecvWithFds(int sock, void* buf, size_t size,
                         std::vector<UniqueFd>* fds) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < size) {
    iovec iov{p + done, size - done};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "recvmsg");
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          if (fds != nullptr) {
            fds->emplace_back(fd);
          } else {
            ::close(fd);
          }
        }
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
      return absl::ResourceExhaustedError("recvmsg: file descriptors truncated");
    }
    if (n == 0) return absl::UnavailableError("connection closed");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SendAll(int sock, const void* buf, size_t size) {
  const auto* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::send(sock, p + done, size - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "send");
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int sock, void* buf, size_t size) {
  return RecvWithFds(sock, buf, size, nullptr);
}

}  // namespace weightd
