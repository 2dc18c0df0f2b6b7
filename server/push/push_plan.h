// The copies a push makes: plain C++, shared by the host push (pwrite, one
// stream) and the CUDA push (cudaMemcpyAsync on the daemon's streams), and
// unit-tested here. MakePushJob turns a lease and its layout into the flat
// PushJob (push_job.h) that both run: the plan is made here, in the
// daemon, never in the CUDA plugin.
//
// Pure functions: no locks, no I/O.
#ifndef WEIGHTD_SERVER_PUSH_PUSH_PLAN_H_
#define WEIGHTD_SERVER_PUSH_PUSH_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/push_layout.h"
#include "server/lease/lease_table.h"
#include "server/push/push_job.h"

namespace weightd {

// Bytes [src_offset, src_offset + length) of the lease's buffers[buffer]
// go to [dst_offset, dst_offset + length) of the destination, on `stream`.
// A cast piece (`cast`) reads `length` bytes of src_dtype and writes their
// elements converted to dst_dtype, dst_length bytes: the host push converts
// them into a bounce buffer it then writes, the CUDA push copies them into
// a device scratch buffer and converts from there into the destination.
struct PushCopy {
  uint32_t buffer = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  int stream = 0;
  bool cast = false;
  DType src_dtype = DType::kF32;
  DType dst_dtype = DType::kF32;
  uint64_t dst_length = 0;  // = length without a cast
  // A cast that merges on the way (LeaseTensor::merge, borrowed from the
  // lease): the piece's first element is element `first_element` of its
  // lease tensor.
  const PushMerge* merge = nullptr;
  uint64_t first_element = 0;
};

struct PushPlanOptions {
  uint64_t max_copy_bytes = uint64_t{64} << 20;  // > 0
  int streams = 1;                               // >= 1
  // A cast piece's source and output each fit this (its scratch buffer);
  // at least one element of the widest dtype.
  uint64_t max_cast_bytes = uint64_t{16} << 20;
};

// INTERNAL naming the first of `lease`'s tensors that does not lie inside
// its buffer (a daemon bug, checked before any copy).
absl::Status CheckLeaseTensors(const LeaseContents& lease);

// The copies that write tensors[i] at layout.offsets[i], every byte once:
// runs of tensors that lie back to back both in one source buffer and in
// the destination become one copy (padding between tensors is never
// copied), which is then cut into pieces of at most max_copy_bytes; a
// tensor with a cast (LeaseTensor::cast) is never joined to another and is
// cut on element boundaries into pieces whose source and output each fit
// max_cast_bytes. Each piece goes to the stream with the fewest bytes so
// far (the larger of its source and output; the lowest on a tie). Empty
// tensors make none. In destination order.
std::vector<PushCopy> PlanPushCopies(absl::Span<const LeaseTensor> tensors,
                                     const PushLayout& layout, const PushPlanOptions& options);

// The layout of `lease`'s tensors: the default one for empty `offsets`,
// else the client's, checked (CheckPushLayout).
absl::StatusOr<PushLayout> LayoutForPush(const LeaseContents& lease,
                                         absl::Span<const uint64_t> offsets);

// The job that writes `lease` at `layout`: CheckLeaseTensors, then
// PlanPushCopies with `options`, each piece's source resolved to its host
// address and each merge flattened once (PushJobMerge). The job borrows
// the lease's bytes and merge terms: keep the lease alive while it runs.
// REQUIRES: every buffer of `lease` is host memory (the writers refuse
// other kinds first, each in its own words); one that is not is INTERNAL,
// as is a layout that does not match the lease.
absl::StatusOr<PushJob> MakePushJob(const LeaseContents& lease, const PushLayout& layout,
                                    const PushPlanOptions& options);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_PUSH_PLAN_H_
