// Push into a client's host memory (docs/DESIGN.md §9.1, §4.5, common/data_protocol.h): the
// client owns the destination, a memfd it passed over the data socket; the
// daemon checks it and writes each tensor of a lease into it at the layout's
// offsets. The host twin of the CUDA push: the same lease, layout, checks
// and PushJob (push_plan.h MakePushJob), with pwrite instead of a device
// copy. Pure functions of their arguments; thread-safe.
//
// The destination is written with pwrite, never through a mapping, so
// nothing a client does to its memfd mid-push can fault the daemon; it must
// be sealed against shrinking, and a write seal added mid-push ends the push
// ABORTED.
#ifndef WEIGHTD_SERVER_PUSH_HOST_PUSH_H_
#define WEIGHTD_SERVER_PUSH_HOST_PUSH_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/push_layout.h"
#include "server/lease/lease_table.h"
#include "server/push/push_plan.h"  // LayoutForPush

namespace weightd {

// Checks that `fd` can take a push of `layout`, without calling into the
// filesystem of anything but a memfd:
//   INVALID_ARGUMENT: not an open fd, not a memfd (a file, pipe, socket),
//     smaller than layout.size;
//   FAILED_PRECONDITION: opened read-only, sealed against writes, not sealed
//     against both shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW: a
//     destination whose size may change mid-push would have the daemon's
//     writes allocate pages), or not allocated whole (st_blocks: written or
//     fallocated) — its memory must be the client's, not pages charged to
//     the daemon's memory cgroup;
//   UNIMPLEMENTED: a hugetlbfs memfd (it takes no pwrite).
// Never maps the destination nor moves its file offset.
absl::Status CheckHostDestination(int fd, const PushLayout& layout);

// Writes every tensor of `lease` (host buffers only; another kind is
// UNIMPLEMENTED) into `fd` at layout.offsets. Checks the destination first
// (CheckHostDestination). ABORTED when the client seals it against writes
// meanwhile; UNAVAILABLE when `cancel` becomes true (checked between
// chunks of at most 64 MiB).
absl::Status PushToHost(const LeaseContents& lease, const PushLayout& layout, int fd,
                        const std::atomic<bool>* cancel);

// The same copies, casts and merges into memory of the daemon's own that no
// client can write yet (the host twin of an export, filled before its fd is
// handed out): [dest, dest + dest_size), at least layout.size bytes.
// UNAVAILABLE when `cancel` becomes true.
absl::Status CopyLeaseToHost(const LeaseContents& lease, const PushLayout& layout, uint8_t* dest,
                             uint64_t dest_size, const std::atomic<bool>* cancel);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_HOST_PUSH_H_
