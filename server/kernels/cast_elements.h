// The element conversions behind every cast kernel, written once for the
// CPU and the GPU: `WD_HOST_DEVICE` functions that nvcc compiles for both
// and a C++ compiler sees as plain inline functions. The CPU's scalar loops
// (cast.cc) call them, so the exhaustive 16-bit and FP8 tests in cast_test
// check exactly the code the CUDA cast kernels (server/kernels/cuda/) run.
//
// Ports of c10 (c10/util/Half.h, BFloat16.h, Float8_e4m3fn.h,
// Float8_e5m2.h); semantics in cast.h. They need IEEE single precision
// without flush-to-zero and without contraction of a multiply and an add
// into one FMA. On the CPU: the default MXCSR, and -ffp-contract=off on
// every target of ours (cmake/WeightdTargets.cmake) -- ISO C++ does not
// forbid contraction, and GCC contracts by default (-ffp-contract=fast,
// even with -std=c++20) wherever the ISA has FMA (-march=haswell or
// native, aarch64); fp_contract_test builds these functions with -mavx2
// -mfma and checks they still give the baseline's bits. A program of yours
// that includes this header needs the flag too. On the GPU every multiply
// and add below is an explicit round-to-nearest intrinsic (__fmul_rn /
// __fadd_rn never contract), the kernels are built with --fmad=false and
// without --use_fast_math (no FTZ).
#ifndef WEIGHTD_SERVER_KERNELS_CAST_ELEMENTS_H_
#define WEIGHTD_SERVER_KERNELS_CAST_ELEMENTS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WD_HOST_DEVICE __host__ __device__
#else
#define WD_HOST_DEVICE
#endif

namespace weightd {
namespace elements {

WD_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
#endif
}

WD_HOST_DEVICE inline float BitsFloat(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(w);
#else
  float f;
  std::memcpy(&f, &w, 4);
  return f;
#endif
}

WD_HOST_DEVICE inline float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

WD_HOST_DEVICE inline float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

WD_HOST_DEVICE inline int CountLeadingZeros(uint32_t v) {  // 32 for 0
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return v == 0 ? 32 : __builtin_clz(v);
#endif
}

WD_HOST_DEVICE inline float HalfToFloat(uint16_t h) {
  // c10::detail::fp16_ieee_to_fp32_value. A NaN is built from its bits: the
  // multiply below would give x86's quieted input (sign, payload << 13, quiet
  // bit) but the GPU's canonical NaN; this is the x86 result on both.
  if ((h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0) {
    return BitsFloat((static_cast<uint32_t>(h & 0x8000) << 16) | UINT32_C(0x7FC00000) |
                     (static_cast<uint32_t>(h & 0x03FF) << 13));
  }
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = BitsFloat(UINT32_C(15) << 23);  // 2^-112
  // Inf/NaN keep exponent 0xFF through the multiply; NaN comes out quiet.
  const float normalized_value = Mul(BitsFloat((two_w >> 4) + exp_offset), exp_scale);
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = Add(BitsFloat((two_w >> 17) | magic_mask), -magic_bias);
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? FloatBits(denormalized_value)
                                          : FloatBits(normalized_value));
  return BitsFloat(result);
}

WD_HOST_DEVICE inline uint16_t FloatToHalf(float f) {
  // c10::detail::fp16_ieee_from_fp32_value.
  const float scale_to_inf = BitsFloat(UINT32_C(239) << 23);  // 2^112
  const float scale_to_zero = BitsFloat(UINT32_C(17) << 23);  // 2^-110
  const float abs_f = BitsFloat(FloatBits(f) & UINT32_C(0x7FFFFFFF));
  float base = Mul(Mul(abs_f, scale_to_inf), scale_to_zero);
  const uint32_t w = FloatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = Add(BitsFloat((bias >> 1) + UINT32_C(0x07800000)), base);
  const uint32_t bits = FloatBits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) |
                               (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

WD_HOST_DEVICE inline float BFloat16ToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

WD_HOST_DEVICE inline uint16_t FloatToBFloat16(float f) {
  // c10::detail::round_to_nearest_even: every NaN becomes +0x7FC0.
  const uint32_t u = FloatBits(f);
  if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) return UINT16_C(0x7FC0);  // NaN
  const uint32_t rounding_bias = ((u >> 16) & 1) + UINT32_C(0x7FFF);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

WD_HOST_DEVICE inline float Fp8E4M3ToFloat(uint8_t v) {
  // c10::detail::fp8e4m3fn_to_fp32_value.
  const uint32_t w = static_cast<uint32_t>(v) << 24;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t nonsign = w & UINT32_C(0x7FFFFFFF);
  uint32_t renorm_shift = static_cast<uint32_t>(CountLeadingZeros(nonsign));
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask =
      (static_cast<int32_t>(nonsign + 0x01000000) >> 8) & INT32_C(0x7F800000);
  const int32_t zero_mask = static_cast<int32_t>(nonsign - 1) >> 31;
  const uint32_t result =
      sign | ((((nonsign << renorm_shift >> 4) + ((0x78 - renorm_shift) << 23)) |
               static_cast<uint32_t>(inf_nan_mask)) &
              ~static_cast<uint32_t>(zero_mask));
  return BitsFloat(result);
}

WD_HOST_DEVICE inline uint8_t FloatToFp8E4M3(float f) {
  // c10::detail::fp8e4m3fn_from_fp32_value: no saturation; |f| >= 480 and
  // NaN/Inf give NaN (0x7F | sign).
  constexpr uint32_t kFp8Max = UINT32_C(1087) << 20;     // 480.0f
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;  // 2^14
  uint32_t f_bits = FloatBits(f);
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kFp8Max) {
    result = 0x7F;
  } else if (f_bits < (UINT32_C(121) << 23)) {  // below 2^-6: denormal
    f_bits = FloatBits(Add(BitsFloat(f_bits), BitsFloat(kDenormMask)));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

WD_HOST_DEVICE inline float Fp8E5M2ToFloat(uint8_t v) {
  // c10::detail::fp8e5m2_to_fp32_value: the top byte of an F16.
  return HalfToFloat(static_cast<uint16_t>(static_cast<uint16_t>(v) << 8));
}

WD_HOST_DEVICE inline uint8_t FloatToFp8E5M2(float f) {
  // c10::detail::fp8e5m2_from_fp32_value.
  constexpr uint32_t kFp32Inf = UINT32_C(255) << 23;
  constexpr uint32_t kFp8Max = UINT32_C(143) << 23;      // 65536.0f
  constexpr uint32_t kDenormMask = UINT32_C(134) << 23;  // 2^7
  uint32_t f_bits = FloatBits(f);
  const uint32_t sign = f_bits & UINT32_C(0x80000000);
  f_bits ^= sign;
  uint8_t result;
  if (f_bits >= kFp8Max) {
    result = f_bits > kFp32Inf ? UINT8_C(0x7F) : UINT8_C(0x7C);
  } else if (f_bits < (UINT32_C(113) << 23)) {  // below 2^-14: denormal
    f_bits = FloatBits(Add(BitsFloat(f_bits), BitsFloat(kDenormMask)));
    result = static_cast<uint8_t>(f_bits - kDenormMask);
  } else {
    const uint32_t mant_odd = (f_bits >> 21) & 1;
    f_bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 21);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// F64 in: rounded to F32 first (then to the narrower type), as PyTorch does.
// NaN keeps its sign and top payload bits, quieted, as x86's cvtsd2ss does
// (the GPU's conversion would give its canonical NaN).
WD_HOST_DEVICE inline float F64ToF32(double d) {
#if defined(__CUDA_ARCH__)
  const uint64_t b = static_cast<uint64_t>(__double_as_longlong(d));
  if ((b & UINT64_C(0x7FFFFFFFFFFFFFFF)) > UINT64_C(0x7FF0000000000000)) {
    return BitsFloat(static_cast<uint32_t>(b >> 32 & 0x80000000) | UINT32_C(0x7FC00000) |
                     static_cast<uint32_t>(b >> 29 & 0x3FFFFF));
  }
  return __double2float_rn(d);
#else
  return static_cast<float>(d);
#endif
}

// F32 out to F64: exact; NaN as x86's cvtss2sd (sign, payload << 29, quiet).
WD_HOST_DEVICE inline double F32ToF64(float f) {
#if defined(__CUDA_ARCH__)
  const uint32_t w = FloatBits(f);
  if ((w & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) {
    return __longlong_as_double(static_cast<long long>(
        (static_cast<uint64_t>(w & 0x80000000) << 32) | UINT64_C(0x7FF8000000000000) |
        (static_cast<uint64_t>(w & 0x3FFFFF) << 29)));
  }
#endif
  return static_cast<double>(f);
}

}  // namespace elements
}  // namespace weightd

#endif  // WEIGHTD_SERVER_KERNELS_CAST_ELEMENTS_H_
