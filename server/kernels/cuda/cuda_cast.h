// Dtype conversion on the GPU, bit-exact with CastBuffer (server/kernels/cast.h):
// the kernels run the element conversions of server/kernels/cast_elements.h, the
// same code the CPU's scalar loops run, so the exhaustive CPU tests cover
// their arithmetic; cuda_cast_test compares the two on a device.
//
// Only built with WEIGHTD_CUDA; the functions take device pointers.
#ifndef WEIGHTD_SERVER_KERNELS_CUDA_CUDA_CAST_H_
#define WEIGHTD_SERVER_KERNELS_CUDA_CUDA_CAST_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "server/kernels/merge_elements.h"

namespace weightd {

// Enqueues the conversion of `count` elements from device memory `src` (of
// `src_dtype`) to device memory `dst` on `stream`; the caller synchronizes.
// Identity pairs are a device-to-device copy. INVALID_ARGUMENT when
// !CanCast(src_dtype, dst_dtype); UNAVAILABLE with CUDA's message when the
// launch fails (no device, no driver).
absl::Status CastBufferCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                            size_t count, cudaStream_t stream);

// MergeBufferHost (server/kernels/merge.h) on the GPU, enqueued on `stream`: the
// same MergeElement for each element. `terms` (n_terms of them) and the
// arrays they point to are device memory. INVALID_ARGUMENT for a
// non-floating dtype or cols < 1; UNAVAILABLE when the launch fails.
absl::Status MergeBufferCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             size_t count, uint64_t first, int64_t row_begin, int64_t cols,
                             const MergeTerm* terms, int n_terms, cudaStream_t stream);

// "cuda: <reason>" for a failed CUDA call, as UNAVAILABLE.
absl::Status CudaError(cudaError_t err, const char* what);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_KERNELS_CUDA_CUDA_CAST_H_
