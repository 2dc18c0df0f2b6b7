#include "server/auth/peer_identity.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fd.h"
#include "common/unix_socket.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59
#endif

namespace weightd {

bool PeerIdentity::InGroup(gid_t g) const {
  return gid == g || std::find(groups.begin(), groups.end(), g) != groups.end();
}

std::string PeerIdentity::Describe() const {
  return absl::StrCat("uid ", uid, " gid ", gid, " pid ", pid);
}

absl::StatusOr<PeerIdentity> ReadPeerIdentity(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus(errno, "getsockopt SO_PEERCRED");
  }
  PeerIdentity id;
  id.pid = cred.pid;
  id.uid = cred.uid;
  id.gid = cred.gid;
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) == 0) {
      groups.resize(glen / sizeof(gid_t));
      id.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;  // ENOPROTOOPT on old kernels: primary gid only
    groups.resize(glen / sizeof(gid_t) + 1);
  }
  return id;
}

absl::StatusOr<UniqueFd> ListenUnixWithMode(const std::string& path, mode_t mode) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path \"", path, "\" must be 1 to ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  // A live daemon's socket is refused, a dead one's replaced.
  if (absl::Status s = RemoveStaleSocket(path); !s.ok()) return s;
  // Linux creates the socket file with the socket inode's mode minus the
  // umask, so the file is never more open than `mode`, even for a moment.
  if (::fchmod(fd.get(), mode) != 0) return ErrnoStatus(errno, "fchmod socket");
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("bind ", path));
  }
  // The umask may have taken bits away; put back exactly `mode`.
  if (::chmod(path.c_str(), mode) != 0) {
    absl::Status s = ErrnoStatus(errno, absl::StrCat("chmod ", path));
    ::unlink(path.c_str());
    return s;
  }
  if (::listen(fd.get(), 256) != 0) {
    absl::Status s = ErrnoStatus(errno, absl::StrCat("listen ", path));
    ::unlink(path.c_str());
    return s;
  }
  return fd;
}

}  // namespace weightd
