#include "server/kernels/cuda/cuda_cast.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "server/kernels/cast_elements.h"
#include "server/kernels/merge_elements.h"

namespace weightd {
namespace {

// Every floating dtype through F32, as the CPU kernels do (which also
// gives PyTorch's double rounding for F64 -> F16/BF16/FP8); F32 -> F64 is
// exact.
__device__ float LoadAsF32(DType t, const void* src, size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(src)[i];
    case DType::kF64: return elements::F64ToF32(static_cast<const double*>(src)[i]);
    case DType::kF16: return elements::HalfToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kBF16: return elements::BFloat16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kF8E4M3: return elements::Fp8E4M3ToFloat(static_cast<const uint8_t*>(src)[i]);
    case DType::kF8E5M2: return elements::Fp8E5M2ToFloat(static_cast<const uint8_t*>(src)[i]);
    default: return 0.0f;  // not a floating type: refused before the launch
  }
}

__device__ void StoreFromF32(DType t, void* dst, size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(dst)[i] = v; break;
    case DType::kF64: static_cast<double*>(dst)[i] = elements::F32ToF64(v); break;
    case DType::kF16: static_cast<uint16_t*>(dst)[i] = elements::FloatToHalf(v); break;
    case DType::kBF16: static_cast<uint16_t*>(dst)[i] = elements::FloatToBFloat16(v); break;
    case DType::kF8E4M3: static_cast<uint8_t*>(dst)[i] = elements::FloatToFp8E4M3(v); break;
    case DType::kF8E5M2: static_cast<uint8_t*>(dst)[i] = elements::FloatToFp8E5M2(v); break;
    default: break;
  }
}

__global__ void CastKernel(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                           size_t count) {
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    StoreFromF32(dst_dtype, dst, i, LoadAsF32(src_dtype, src, i));
  }
}

__global__ void MergeKernel(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                            size_t count, uint64_t first, int64_t row_begin, int64_t cols,
                            const MergeTerm* terms, int n_terms) {
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t e = static_cast<int64_t>(first + i);
    const float acc = MergeElement(LoadAsF32(src_dtype, src, i), terms, n_terms,
                                   row_begin + e / cols, e % cols, cols);
    StoreFromF32(dst_dtype, dst, i, acc);
  }
}

unsigned BlocksFor(size_t count, int threads) {
  const size_t wanted = (count + threads - 1) / threads;
  return static_cast<unsigned>(wanted < 65535 * 8 ? wanted : 65535 * 8);
}

}  // namespace

absl::Status MergeBufferCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             size_t count, uint64_t first, int64_t row_begin, int64_t cols,
                             const MergeTerm* terms, int n_terms, cudaStream_t stream) {
  if (!IsFloating(src_dtype) || !IsFloating(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("a merge needs floating dtypes, not ",
                                                   DTypeName(src_dtype), " -> ",
                                                   DTypeName(dst_dtype)));
  }
  if (cols < 1) return absl::InvalidArgumentError("a merge needs rows of at least 1 element");
  if (count == 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  MergeKernel<<<BlocksFor(count, kThreads), kThreads, 0, stream>>>(
      src_dtype, src, dst_dtype, dst, count, first, row_begin, cols, terms, n_terms);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? absl::OkStatus() : CudaError(err, "merge kernel launch");
}

absl::Status CudaError(cudaError_t err, const char* what) {
  return absl::UnavailableError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorString(err)));
}

absl::Status CastBufferCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                            size_t count, cudaStream_t stream) {
  if (!CanCast(src_dtype, dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot convert ", DTypeName(src_dtype),
                                                   " to ", DTypeName(dst_dtype)));
  }
  if (count == 0) return absl::OkStatus();
  if (src_dtype == dst_dtype) {
    cudaError_t err = cudaMemcpyAsync(dst, src, count * DTypeSize(src_dtype),
                                      cudaMemcpyDeviceToDevice, stream);
    return err == cudaSuccess ? absl::OkStatus() : CudaError(err, "cudaMemcpyAsync");
  }
  constexpr int kThreads = 256;
  CastKernel<<<BlocksFor(count, kThreads), kThreads, 0, stream>>>(src_dtype, src, dst_dtype,
                                                                    dst, count);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? absl::OkStatus() : CudaError(err, "cast kernel launch");
}

}  // namespace weightd
