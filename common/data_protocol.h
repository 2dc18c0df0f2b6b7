// The data-socket protocol of the shm transport (docs/DESIGN.md §4.5).
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
//
// Push (the client owns the memory, docs/DESIGN.md §4.5, §9.1): instead of an
// AttachRequest the client sends a PushRequest naming its lease, with the
// fd of a memfd it allocated riding on the request (SCM_RIGHTS), then
// `num_offsets` u64 byte offsets (host order), one per tensor of the
// FetchResponse in its order — or none (num_offsets 0) for the default
// layout (DefaultPushLayout: each tensor at the next multiple of
// kPushAlignment after the previous one's end, the first at 0). Client
// offsets must be multiples of kPushAlignment and the tensors must not
// overlap. The daemon writes each tensor's bytes (cast and merged as the
// fetch asked) into the memfd at its offset and answers an AttachReply
// with no fds once every byte is in place. The destination must be a
// writable memfd at least as large as the layout, sealed against
// shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW; MFD_ALLOW_SEALING)
// but not against writes, allocated whole (fallocate) — so its memory is
// the client's, never charged to the daemon. Fds ride on a request's first
// byte; any sent with later bytes are discarded. The lease is
// attached to the connection when the header arrives, as by an
// AttachRequest (so closing the connection after a refused push ends it).
// A push refused before its offsets are read (unknown lease, wrong token,
// an offsets count neither 0 nor the lease's tensor count) with offsets
// following is answered and the connection closed; other refusals leave
// the connection open for the next request.
//
// CUDA push (docs/DESIGN.md §9.3): the same, into the client's GPU memory. The
// request's magic is kCudaPushMagic; a CudaPushTarget follows the 32-byte
// header (before the offsets) naming the GPU by UUID, the allocation's size
// and how it is shared: kCudaVmmPosixFd — a CUDA VMM allocation
// (cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) whose
// exported fd rides on the header (the default: it crosses PID namespaces,
// i.e. sidecars and DaemonSets) — or kCudaLegacyIpc — a cudaIpcMemHandle_t
// in `ipc_handle`, no fd (the processes must share a PID namespace). The
// daemon maps it, copies each tensor to its offset on its own streams and
// answers only once the streams are synchronized: every byte is in place.
// Offsets follow the same rules (kPushAlignment); the layout must fit in
// `size` bytes.
//
// Publish staging (zero-copy publish, docs/DESIGN.md §6.2 and
// docs/publish.md): a publisher that opened a publish session (Models.
// BeginPublish) sends a StageRequest naming the session and its token (the
// session's hex token decoded: 16 bytes). The daemon answers an AttachReply
// carrying one fd: the session's staging memfd, writable, sealed against
// growing and shrinking, laid out as PublishSession.offsets says. The
// publisher maps it shared, writes its tensors' bytes in place, UNMAPS it,
// then declares what it wrote (PublishChunk.in_place runs, no data). The
// commit seals the memfd with F_SEAL_WRITE, which the kernel refuses while
// any process still maps it shared: the session then fails with
// FAILED_PRECONDITION and nothing is published. Staging needs the same
// rights as publishing (an admin who may read the model); the connection
// may close at once.
#ifndef WEIGHTD_COMMON_DATA_PROTOCOL_H_
#define WEIGHTD_COMMON_DATA_PROTOCOL_H_

#include <cstdint>

namespace weightd {

inline constexpr char kAttachMagic[4] = {'W', 'D', 'A', '1'};
inline constexpr char kReplyMagic[4] = {'W', 'D', 'R', '1'};
inline constexpr char kPushMagic[4] = {'W', 'D', 'P', '1'};
inline constexpr char kCudaPushMagic[4] = {'W', 'D', 'C', '1'};
inline constexpr char kStageMagic[4] = {'W', 'D', 'S', '1'};

struct AttachRequest {
  char magic[4];
  uint32_t reserved;
  uint64_t lease_id;
  uint8_t token[16];
};
static_assert(sizeof(AttachRequest) == 32);

// The same size as AttachRequest: the data socket reads 32 bytes, then
// tells the two apart by their magic.
struct PushRequest {
  char magic[4];
  uint32_t num_offsets;  // 0 = the default layout
  uint64_t lease_id;
  uint8_t token[16];
};
static_assert(sizeof(PushRequest) == sizeof(AttachRequest));

// The same size again: a publish session's staging memfd (above).
struct StageRequest {
  char magic[4];
  uint32_t reserved;
  uint64_t session;
  uint8_t token[16];
};
static_assert(sizeof(StageRequest) == sizeof(AttachRequest));

enum CudaHandleKind : uint32_t {
  kCudaVmmPosixFd = 1,  // the fd rides on the request (SCM_RIGHTS)
  kCudaLegacyIpc = 2,   // cudaIpcMemHandle_t in ipc_handle; no fd
  // Export: no fd, size 0, no offsets. The daemon owns the destination: it
  // fills a buffer of its own with the lease's tensors at the default
  // layout once (cast and merged on the way, as a push), keeps it for
  // every export of the same fetch table to the same device, and answers
  // with one fd: a CUDA VMM allocation's POSIX fd on the GPU `gpu_uuid`
  // names (map it read-only: cuMemImportFromShareableHandle), or — an
  // all-zero gpu_uuid, the host twin — a memfd sealed against writes (map
  // it read-only). The reply's message bytes are an ExportInfo. The lease
  // stays attached to the connection; the buffer is held while any
  // connection that took it is open, and counts against the daemon's
  // --device-memory-bytes per device until it is evicted.
  kCudaDaemonExport = 3,
};

// Follows a PushRequest whose magic is kCudaPushMagic.
struct CudaPushTarget {
  uint8_t gpu_uuid[16];  // the GPU the allocation lives on (cudaDeviceProp::uuid)
  uint64_t size;         // the allocation's bytes
  uint32_t handle_kind;  // CudaHandleKind
  uint32_t reserved;
  uint8_t ipc_handle[64];  // kCudaLegacyIpc only
};
static_assert(sizeof(CudaPushTarget) == 96);

// The message of an OK reply to an export (kCudaDaemonExport).
struct ExportInfo {
  uint64_t size;         // the buffer's bytes (map this many)
  uint64_t layout_size;  // bytes the default layout uses
};
static_assert(sizeof(ExportInfo) == 16);

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
