// Unix-domain stream sockets with file-descriptor passing (SCM_RIGHTS) and
// peer credentials (SO_PEERCRED).
#ifndef WEIGHTD_COMMON_UNIX_SOCKET_H_
#define WEIGHTD_COMMON_UNIX_SOCKET_H_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/fd.h"

namespace weightd {

// The most fds one message carries (the kernel's SCM_MAX_FD is 253).
inline constexpr size_t kMaxFdsPerMessage = 250;

// Makes way for a new listener at `path`: nothing there is fine; a socket
// file nobody listens on (left by a daemon that died: connect() says
// ECONNREFUSED) is unlinked; a socket a live process accepts on is
// FAILED_PRECONDITION ("already in use": two daemons must not share one
// path, and the second must not silently take it over); any other kind of
// file is FAILED_PRECONDITION too.
absl::Status RemoveStaleSocket(const std::string& path);

// Binds and listens on `path` (RemoveStaleSocket first), chmod to `mode`.
// The socket is close-on-exec.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode);
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path);
// The path a Unix socket is bound to (getsockname).
absl::StatusOr<std::string> BoundUnixPath(int fd);

// Sends `data` (non-empty) with `fds` attached (<= kMaxFdsPerMessage).
absl::Status SendWithFds(int sock, absl::string_view data,
                         absl::Span<const int> fds);

// Sends what `sock` takes now of `data` (non-empty) without blocking, with
// `fds` (<= kMaxFdsPerMessage) riding on its first byte. Returns the bytes
// sent; 0 when the socket's buffer is full, in which case nothing went out,
// the fds included. Errors: the connection is unusable (EPIPE, ...).
absl::StatusOr<size_t> TrySendWithFds(int sock, absl::string_view data,
                                      absl::Span<const int> fds);

// Receives exactly `size` bytes; fds arriving with them are appended to
// `fds`. A peer that closes first is UNAVAILABLE ("connection closed").
absl::Status RecvWithFds(int sock, void* buf, size_t size,
                         std::vector<UniqueFd>* fds);

// Sends / receives exactly `size` bytes.
absl::Status SendAll(int sock, const void* buf, size_t size);
absl::Status RecvAll(int sock, void* buf, size_t size);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_UNIX_SOCKET_H_
