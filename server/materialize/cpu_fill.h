// The CPU fill backend: computes materialized items into host memory —
// slicing, casting with PyTorch's rounding, LoRA patches merged in fp32 with
// one rounding at the end (docs/DESIGN.md §2.5), FP8 quantization — and digests the
// bytes while they are still in cache.
//
// This is the one place that reads stored tensors with the CPU; it needs
// their buffers in host memory (UNIMPLEMENTED naming the kind otherwise).
// A backend for another memory kind (a CUDA one, issue [gpu]) takes the same
// jobs with destinations in its own memory; planning (pack_plan.h) and the
// cache (materialize_cache.h) do not change.
#ifndef WEIGHTD_SERVER_MATERIALIZE_CPU_FILL_H_
#define WEIGHTD_SERVER_MATERIALIZE_CPU_FILL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/base/thread_pool.h"
#include "server/materialize/item.h"

namespace weightd {

// One item to compute into `dst` (OutputElements * out size bytes), or,
// with `dst` null, a view: `length` bytes at `view_offset` of `view_of`
// (borrowed), which only need their digest.
struct FillJob {
  const MaterializeItem* item = nullptr;
  uint8_t* dst = nullptr;
  const Buffer* view_of = nullptr;
  uint64_t view_offset = 0;
  uint64_t length = 0;
};

// Thread-safe. One executor for all calls: `threads` workers at most per
// call, the caller's thread included (the other threads - 1 are started
// once, best effort: at the thread limit a call runs on fewer).
class CpuFillBackend {
 public:
  explicit CpuFillBackend(int threads);
  CpuFillBackend(const CpuFillBackend&) = delete;
  CpuFillBackend& operator=(const CpuFillBackend&) = delete;

  // Fills every job and returns the digests of their bytes, in order. The
  // first error, annotated with its tensor's name, fails the whole call.
  absl::StatusOr<std::vector<Digest>> Run(absl::Span<const FillJob> jobs);

 private:
  const int threads_;
  ThreadPool helpers_;
};

// Copies the `box` of the row-major tensor at `src` (dtype `src_dtype`,
// shape `global_shape`) into `dst`, densely, converting to `dst_dtype`.
absl::Status CopyBox(const uint8_t* src, DType src_dtype,
                     absl::Span<const int64_t> global_shape, const ShardBox& box,
                     uint8_t* dst, DType dst_dtype);

// Writes the item's output into `dst` (OutputElements * out size bytes).
// With `digest`, feeds it every byte written, in order, while the bytes are
// still in cache (the same digest as DigestBytes over the output after).
absl::Status FillItem(const MaterializeItem& item, uint8_t* dst,
                      DigestBuilder* digest = nullptr);

// max |x| over the fp32 values of `slices` (patches applied), NaN ignored.
absl::StatusOr<float> AbsMax(absl::Span<const PartSlice> slices);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_CPU_FILL_H_
