// A push as the code that writes it sees it: pieces of host memory to copy
// (cast, and merge, on the way) into a destination at given offsets, in the
// order and on the streams PlanPushCopies chose (push_plan.h builds it from
// a lease: MakePushJob). The host push runs it with pwrite or memcpy
// (host_push.h); the CUDA plugin (server/gpu/cuda_plugin.h) runs it with
// cudaMemcpyAsync and the cast and merge kernels.
//
// This is the plugin's ABI, so it names no domain type: no lease, no
// buffer, no layout — only pointers, lengths, offsets and the dtypes and
// merge terms the kernels take (common/dtype.h, server/kernels/merge_elements.h).
// Changing a field here bumps kCudaPluginAbi; a field the lease table adds
// changes nothing that crosses dlopen().
//
// A job borrows everything it points to (the source bytes, the merge
// terms and their arrays): whoever made it keeps its lease alive while the
// job runs. A plain value; not synchronized.
#ifndef WEIGHTD_SERVER_PUSH_PUSH_JOB_H_
#define WEIGHTD_SERVER_PUSH_PUSH_JOB_H_

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "server/kernels/merge_elements.h"

namespace weightd {

// A merge the cast pieces of one tensor make on the way (the lease's
// PushMerge, flattened): the parameter's rows are `cols` elements long, the
// tensor's first element is at row `row_begin`, and the `num_terms` terms
// at `terms` are applied to each element (MergeElement).
struct PushJobMerge {
  int64_t cols = 1;
  int64_t row_begin = 0;
  const MergeTerm* terms = nullptr;
  uint32_t num_terms = 0;
};

// `length` bytes at `src` (host memory) go to [dst_offset, dst_offset +
// dst_length) of the destination, on stream `stream`. A cast piece reads
// elements of src_dtype and writes them as dst_dtype (dst_length bytes),
// merging merges[merge] on the way when `merge` >= 0; its first element is
// element `first_element` of its tensor (a merge needs to know its row).
struct PushJobCopy {
  const uint8_t* src = nullptr;
  uint64_t length = 0;
  uint64_t dst_offset = 0;
  uint64_t dst_length = 0;  // = length without a cast
  int32_t stream = 0;
  bool cast = false;
  DType src_dtype = DType::kF32;  // with `cast`
  DType dst_dtype = DType::kF32;  // with `cast`
  int32_t merge = -1;             // an index into PushJob::merges; -1: none
  uint64_t first_element = 0;
};

struct PushJob {
  // Bytes the destination must have (the layout's size).
  uint64_t size = 0;
  // Every copy's stream is below `streams`; every cast piece's source and
  // output fit `max_cast_bytes` (one scratch buffer of that size per stream
  // is enough).
  int32_t streams = 1;
  uint64_t max_cast_bytes = 0;
  // In destination order; every byte of every tensor once, padding never.
  std::vector<PushJobCopy> copies;
  std::vector<PushJobMerge> merges;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_PUSH_JOB_H_
