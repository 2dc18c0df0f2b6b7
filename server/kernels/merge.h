// The host twin of the GPU's merge as a push writes (merge_elements.h):
// the same per-element arithmetic, on the CPU.
#ifndef WEIGHTD_SERVER_KERNELS_MERGE_H_
#define WEIGHTD_SERVER_KERNELS_MERGE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "server/kernels/merge_elements.h"

namespace weightd {

// Element i of `src` (of src_dtype, floating) is element first + i of a
// parameter's rows from row_begin on, rows of `cols` elements: it is
// converted to fp32, merged with `terms` (MergeElement at row
// row_begin + (first + i) / cols, column (first + i) % cols), and rounded
// to dst_dtype into dst[i]. INVALID_ARGUMENT for a non-floating dtype or
// cols < 1.
absl::Status MergeBufferHost(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             size_t count, uint64_t first, int64_t row_begin, int64_t cols,
                             absl::Span<const MergeTerm> terms);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_KERNELS_MERGE_H_
