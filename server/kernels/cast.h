// Element-type conversion kernels, bit-exact with PyTorch's `tensor.to(dtype)`.
//
// Semantics (docs/DESIGN.md §2.3): round to nearest, ties to even; NaN stays NaN (quiet);
// ±Inf and −0 kept; F16 overflow -> ±Inf; subnormals kept (no flush to zero).
// F64 input is first rounded to F32, then to the narrower type, as PyTorch
// does. FP8 outputs follow c10's Float8_e4m3fn / Float8_e5m2 conversions
// (e4m3fn: saturation is NOT applied, out-of-range and NaN -> 0x7F/0xFF NaN;
// e5m2: RNE on the F16 bit pattern, overflow -> Inf).
//
// Thread safety: all functions are pure and may run concurrently.
#ifndef WEIGHTD_SERVER_KERNELS_CAST_H_
#define WEIGHTD_SERVER_KERNELS_CAST_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace weightd {

// Converts `count` elements from `src` (of `src_dtype`) to `dst` (of
// `dst_dtype`). Identity copies are memcpy. REQUIRES: CanCast(src, dst);
// buffers do not overlap; dst holds count * DTypeSize(dst_dtype) bytes.
// Uses the widest kernel the CPU supports (picked once at run time).
// Returns INVALID_ARGUMENT for an unsupported pair.
absl::Status CastBuffer(DType src_dtype, const void* src, DType dst_dtype,
                        void* dst, size_t count);

// The same conversion with the portable scalar kernels only: the reference
// the vectorized kernels are tested against.
absl::Status CastBufferScalar(DType src_dtype, const void* src,
                              DType dst_dtype, void* dst, size_t count);

// Name of the kernel family CastBuffer dispatches to: "avx512", "avx2",
// or "scalar". Setting WEIGHTD_CAST_KERNEL=scalar|avx2|avx512 in the
// environment before the first call forces a family (when supported).
absl::string_view CastKernelName();

// Scalar element conversions (exposed for tests and other kernels).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);
float Fp8E4M3ToFloat(uint8_t v);
uint8_t FloatToFp8E4M3(float f);
float Fp8E5M2ToFloat(uint8_t v);
uint8_t FloatToFp8E5M2(float f);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_KERNELS_CAST_H_
