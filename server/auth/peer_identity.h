// Who is on the other end of a Unix-domain socket: SO_PEERCRED (the uid,
// gid and pid the peer had when it called connect(), as the kernel recorded
// them, so a peer cannot lie about them) plus SO_PEERGROUPS (its
// supplementary groups at the same moment). Values are translated into the
// daemon's user and pid namespaces by the kernel.
#ifndef WEIGHTD_SERVER_AUTH_PEER_IDENTITY_H_
#define WEIGHTD_SERVER_AUTH_PEER_IDENTITY_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/fd.h"

namespace weightd {

struct PeerIdentity {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;                // primary group
  std::vector<gid_t> groups;    // supplementary groups (may repeat gid)

  // True when `g` is the primary group or one of the supplementary ones.
  bool InGroup(gid_t g) const;
  // "uid 1000 gid 1000 pid 42", for logs and error messages.
  std::string Describe() const;
};

// Reads the identity of the peer of connected Unix socket `fd`. Missing
// SO_PEERGROUPS (kernels before 4.13) leaves `groups` empty.
absl::StatusOr<PeerIdentity> ReadPeerIdentity(int fd);

// Binds a listening Unix stream socket at `path` whose file has exactly
// `mode`, with no moment at which it is more permissive: the socket inode's
// mode is set before bind (the kernel creates the file with that mode minus
// the umask), then the file is chmod'ed to `mode` after bind. A stale socket
// file at `path` is replaced; a socket a live process listens on, or any
// other kind of file, is FAILED_PRECONDITION (RemoveStaleSocket).
// The socket is close-on-exec and non-blocking.
absl::StatusOr<UniqueFd> ListenUnixWithMode(const std::string& path, mode_t mode);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_AUTH_PEER_IDENTITY_H_
