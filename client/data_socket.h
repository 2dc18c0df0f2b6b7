// The C++ client's side of the daemon's data socket (common/data_protocol.h,
// docs/DESIGN.md §4.5 and §9.1, §4.5): the request frames, one request/reply exchange, and
// the three things the client does there — attach a lease (shm), push a
// shard into a memfd of its own (kPush), take a publish session's staging
// memfd. The CUDA push (client/cuda/) uses the frames and the exchange too.
// Stateless; thread-safe for distinct connections.
#ifndef WEIGHTD_CLIENT_DATA_SOCKET_H_
#define WEIGHTD_CLIENT_DATA_SOCKET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/fd.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// The 32 bytes of a request naming lease `lease_id`: an AttachRequest
// (kAttachMagic), or a PushRequest (kPushMagic, kCudaPushMagic) for the
// default layout (num_offsets 0). `token`: the lease's 16 bytes; INTERNAL
// "daemon sent a lease token of the wrong size" otherwise.
absl::StatusOr<std::string> EncodeLeaseRequest(const char (&magic)[4], uint64_t lease_id,
                                               absl::string_view token);
// A StageRequest for publish session `session` (token: 16 raw bytes;
// INTERNAL "daemon sent a publish token of the wrong size" otherwise).
absl::StatusOr<std::string> EncodeStageRequest(uint64_t session, absl::string_view token);
// The CudaPushTarget that follows a kCudaPushMagic request: the GPU's UUID,
// the allocation's size and how it is shared (CudaHandleKind).
std::string EncodeCudaPushTarget(const uint8_t (&gpu_uuid)[16], uint64_t size,
                                 uint32_t handle_kind);

// Sends one request on `conn` (`send_fds` riding on it) and reads the
// reply's header and message: the daemon's status, with the reply's fd
// count in `*num_fds`; fds arriving meanwhile are appended to `fds`. A
// daemon past its connection caps answers at once and closes, maybe before
// the request is sent: its reply says why.
absl::Status Exchange(int conn, absl::string_view request, absl::Span<const int> send_fds,
                      uint32_t* num_fds, std::vector<UniqueFd>* fds);

// The data socket to use: beside the Unix socket this client connected to
// when the daemon's lies beside its own (the directory may be mounted at
// another path here than in the daemon's container), else the daemon's
// path.
std::string DataSocketFor(const std::string& socket_path, const std::string& data_socket,
                          const std::string& data_socket_name);

// shm: attaches the lease of `resp` on the data socket at `path` and
// receives one fd per segment; `*conn` then holds the lease.
absl::Status AttachLease(const std::string& path, const v1::FetchResponse& resp, UniqueFd* conn,
                         std::vector<UniqueFd>* fds);

// kPush: allocates the client's destination (a memfd, allocated with
// fallocate so its pages are the client's, sealed against growing and
// shrinking), has the daemon write the shard into it at the default layout
// and maps it read-write. Fills `offsets` (one per tensor); the connection
// is closed on return, which ends the lease.
absl::Status PushIntoNewMemfd(const v1::FetchResponse& resp, UniqueFd* memfd, MappedRegion* map,
                              std::vector<uint64_t>* offsets);

// A publish session's staging memfd, writable (a StageRequest on the data
// socket at `path`; the connection is closed on return).
// FAILED_PRECONDITION when the daemon named no data socket.
absl::StatusOr<UniqueFd> TakeStaging(const std::string& path, const v1::PublishSession& session);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_DATA_SOCKET_H_
