// The data-socket protocol of the shm transport (DESIGN §5).
//
// After Fetch, a client connects to the daemon's data socket and sends an
// AttachRequest naming its lease. The daemon answers with an AttachReply
// header, then `message_len` bytes of error text (code != 0) — and, on
// success, passes one fd per segment of the lease with SCM_RIGHTS: the first
// batch (<= kMaxFdsPerMessage) rides on the header, each further batch on one
// byte of its own. Fds arrive in the segment order of the FetchResponse.
// The lease then lives as long as the connection stays open; several leases
// may be attached over one connection, one request after another (the
// daemon reads a connection's next request once its reply is sent). A
// daemon past its connection caps answers RESOURCE_EXHAUSTED at once, before
// any request, and closes the connection: a client whose send fails (EPIPE)
// still reads that reply.
#ifndef WEIGHTD_COMMON_DATA_PROTOCOL_H_
#define WEIGHTD_COMMON_DATA_PROTOCOL_H_

#include <cstdint>

namespace weightd {

inline constexpr char kAttachMagic[4] = {'W', 'D', 'A', '1'};
inline constexpr char kReplyMagic[4] = {'W', 'D', 'R', '1'};

struct AttachRequest {
  char magic[4];
  uint32_t reserved;
  uint64_t lease_id;
  uint8_t token[16];
};
static_assert(sizeof(AttachRequest) == 32);

struct AttachReply {
  char magic[4];
  int32_t code;  // absl::StatusCode
  uint32_t num_fds;
  uint32_t message_len;
};
static_assert(sizeof(AttachReply) == 16);

// Longest error text a reply carries.
inline constexpr uint32_t kMaxReplyMessage = 4096;

}  // namespace weightd

#endif  // WEIGHTD_COMMON_DATA_PROTOCOL_H_
