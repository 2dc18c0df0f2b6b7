// Element-type conversion kernels. See cast.h for the contract.
//
// Layout: every kernel family (scalar, avx2, avx512) provides two tables of
// loops, "X -> F32" and "F32 -> X", for each floating type X. A cast between
// two non-F32 types runs both loops over an L1-sized F32 chunk, which also
// gives PyTorch's double rounding for F64 -> F16/BF16/FP8; the hot BF16 <-> F16
// pairs have fused loops instead. Outputs well past the LLC are written with
// non-temporal stores, which keeps the kernels near memcpy bandwidth. The
// vector loops must produce the scalar loops' bits for every input (cast_test
// checks it); where the hardware's NaN differs from c10's, NaN lanes are
// patched.
//
// The scalar element conversions are ports of c10 (c10/util/Half.h,
// BFloat16.h, Float8_e4m3fn.h, Float8_e5m2.h), in cast_elements.h, shared
// with the CUDA kernels. They assume the default MXCSR (no flush-to-zero,
// no denormals-are-zero), as c10 does.
#include "server/kernels/cast.h"

#include <cpuid.h>

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own
// _mm512_undefined_*() helpers when inlined; the warning is a false positive.
#if defined(__clang__)
#include <immintrin.h>
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/kernels/cast_elements.h"

namespace weightd {
// ---------------------------------------------------------------------------
// Scalar element conversions (c10 ports): shared with the CUDA kernels, in
// cast_elements.h.

float HalfToFloat(uint16_t h) { return elements::HalfToFloat(h); }
uint16_t FloatToHalf(float f) { return elements::FloatToHalf(f); }
float BFloat16ToFloat(uint16_t b) { return elements::BFloat16ToFloat(b); }
uint16_t FloatToBFloat16(float f) { return elements::FloatToBFloat16(f); }
float Fp8E4M3ToFloat(uint8_t v) { return elements::Fp8E4M3ToFloat(v); }
uint8_t FloatToFp8E4M3(float f) { return elements::FloatToFp8E4M3(f); }
float Fp8E5M2ToFloat(uint8_t v) { return elements::Fp8E5M2ToFloat(v); }
uint8_t FloatToFp8E5M2(float f) { return elements::FloatToFp8E5M2(f); }

namespace {

// ---------------------------------------------------------------------------
// Kernel tables.
//
// `stream`: use non-temporal stores, for outputs too large to stay in cache.

using ToF32Fn = void (*)(const void* src, float* dst, size_t n, bool stream);
using FromF32Fn = void (*)(const float* src, void* dst, size_t n, bool stream);
using DirectFn = void (*)(const void* src, void* dst, size_t n, bool stream);

struct KernelFamily {
  absl::string_view name;
  // Indexed by DType; null for F32 itself and for non-float types.
  ToF32Fn to_f32[kNumDTypes] = {};
  FromF32Fn from_f32[kNumDTypes] = {};
  // Optional fused [src][dst] loops that skip the F32 staging chunk.
  DirectFn direct[kNumDTypes][kNumDTypes] = {};
};

constexpr int Idx(DType d) { return static_cast<int>(d); }

// Streaming stores pay off once the output is well past the last-level
// cache; below that the caller likely reads it back soon.
constexpr size_t kStreamThresholdBytes = size_t{8} << 20;

// With `stream`, the number of leading elements to convert with plain stores
// so that `dst` reaches 64-byte alignment (all of them if it never does).
inline size_t StreamHead(const void* dst, size_t elem_size, size_t n,
                         bool stream) {
  if (!stream) return 0;
  const size_t mis = reinterpret_cast<uintptr_t>(dst) & 63;
  if (mis == 0) return 0;
  const size_t bytes = 64 - mis;
  if (bytes % elem_size != 0) return n;
  return bytes / elem_size < n ? bytes / elem_size : n;
}

inline void StreamFence(bool stream) {
  if (stream) _mm_sfence();
}

// --- scalar loops ----------------------------------------------------------

float F64ToF32Element(double d) { return elements::F64ToF32(d); }
double F32ToF64Element(float f) { return elements::F32ToF64(f); }
uint16_t BF16ToF16Element(uint16_t b) {
  return FloatToHalf(BFloat16ToFloat(b));
}
uint16_t F16ToBF16Element(uint16_t h) {
  return FloatToBFloat16(HalfToFloat(h));
}

// One element at a time. Loads and stores go through memcpy, so the buffers
// need no alignment at all (a safetensors payload need not be aligned).
template <typename From, typename To, To (*kConvert)(From)>
void ScalarLoop(const void* src, void* dst, size_t n) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    From in;
    std::memcpy(&in, s + i * sizeof(From), sizeof(From));
    const To out = kConvert(in);
    std::memcpy(d + i * sizeof(To), &out, sizeof(To));
  }
}

void ScalarF16ToF32(const void* src, float* dst, size_t n, bool) {
  ScalarLoop<uint16_t, float, HalfToFloat>(src, dst, n);
}
void ScalarBF16ToF32(const void* src, float* dst, size_t n, bool) {
  ScalarLoop<uint16_t, float, BFloat16ToFloat>(src, dst, n);
}
void ScalarF64ToF32(const void* src, float* dst, size_t n, bool) {
  ScalarLoop<double, float, F64ToF32Element>(src, dst, n);
}
void ScalarE4M3ToF32(const void* src, float* dst, size_t n, bool) {
  ScalarLoop<uint8_t, float, Fp8E4M3ToFloat>(src, dst, n);
}
void ScalarE5M2ToF32(const void* src, float* dst, size_t n, bool) {
  ScalarLoop<uint8_t, float, Fp8E5M2ToFloat>(src, dst, n);
}
void ScalarF32ToF16(const float* src, void* dst, size_t n, bool) {
  ScalarLoop<float, uint16_t, FloatToHalf>(src, dst, n);
}
void ScalarF32ToBF16(const float* src, void* dst, size_t n, bool) {
  ScalarLoop<float, uint16_t, FloatToBFloat16>(src, dst, n);
}
void ScalarF32ToF64(const float* src, void* dst, size_t n, bool) {
  ScalarLoop<float, double, F32ToF64Element>(src, dst, n);
}
void ScalarF32ToE4M3(const float* src, void* dst, size_t n, bool) {
  ScalarLoop<float, uint8_t, FloatToFp8E4M3>(src, dst, n);
}
void ScalarF32ToE5M2(const float* src, void* dst, size_t n, bool) {
  ScalarLoop<float, uint8_t, FloatToFp8E5M2>(src, dst, n);
}
void ScalarBF16ToF16(const void* src, void* dst, size_t n, bool) {
  ScalarLoop<uint16_t, uint16_t, BF16ToF16Element>(src, dst, n);
}
void ScalarF16ToBF16(const void* src, void* dst, size_t n, bool) {
  ScalarLoop<uint16_t, uint16_t, F16ToBF16Element>(src, dst, n);
}

KernelFamily MakeScalarFamily() {
  KernelFamily k;
  k.name = "scalar";
  k.to_f32[Idx(DType::kF16)] = ScalarF16ToF32;
  k.to_f32[Idx(DType::kBF16)] = ScalarBF16ToF32;
  k.to_f32[Idx(DType::kF64)] = ScalarF64ToF32;
  k.to_f32[Idx(DType::kF8E4M3)] = ScalarE4M3ToF32;
  k.to_f32[Idx(DType::kF8E5M2)] = ScalarE5M2ToF32;
  k.from_f32[Idx(DType::kF16)] = ScalarF32ToF16;
  k.from_f32[Idx(DType::kBF16)] = ScalarF32ToBF16;
  k.from_f32[Idx(DType::kF64)] = ScalarF32ToF64;
  k.from_f32[Idx(DType::kF8E4M3)] = ScalarF32ToE4M3;
  k.from_f32[Idx(DType::kF8E5M2)] = ScalarF32ToE5M2;
  return k;
}

// --- AVX2 + F16C loops -----------------------------------------------------
//
// Each loop does whole vectors; the scalar loop (same bits) does the head
// peeled for store alignment and the tail.

#define WD_AVX2 __attribute__((target("avx2,f16c,fma")))

WD_AVX2 inline void Store256(void* p, __m256i v, bool stream) {
  if (stream) {
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
}
WD_AVX2 inline void Store256(void* p, __m256 v, bool stream) {
  Store256(p, _mm256_castps_si256(v), stream);
}

// Keeps `x` in a register. Otherwise GCC folds one source load into the
// memory operands of several instructions, which on streaming input measured
// about 1.5-2x slower (F32 -> BF16 on 64 MiB).
WD_AVX2 inline void PinInRegister(__m256& x) { asm("" : "+x"(x)); }

WD_AVX2 inline __m128i Load128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}
WD_AVX2 inline __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// BF16 -> F32 for 8 lanes.
WD_AVX2 inline __m256 Avx2BF16ToF32Lanes(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// F32 -> F16 for 8 lanes: VCVTPS2PH rounds to nearest even like c10, but a
// NaN keeps its payload there while c10 gives 0x7E00 | sign.
WD_AVX2 inline __m128i Avx2F16Lanes(__m256 x) {
  PinInRegister(x);
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0)) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i fix = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                                   _mm256_set1_epi32(0x8000)),
                                  _mm256_set1_epi32(0x7E00));
    __m256i m = _mm256_castps_si256(nan);
    __m128i fix16 = _mm_packus_epi32(_mm256_castsi256_si128(fix),
                                     _mm256_extracti128_si256(fix, 1));
    __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(m),
                                  _mm256_extracti128_si256(m, 1));
    h = _mm_blendv_epi8(h, fix16, m16);
  }
  return h;
}

// F32 -> BF16 for 8 lanes, as 32-bit lanes holding the 16-bit result.
WD_AVX2 inline __m256i Avx2BF16Lanes(__m256 x) {
  PinInRegister(x);
  __m256i u = _mm256_castps_si256(x);
  __m256i odd =
      _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd),
      16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// Packs two vectors of 16-bit-valued 32-bit lanes into 16 halfwords in order.
WD_AVX2 inline __m256i Avx2PackHalfwords(__m256i a, __m256i b) {
  // packus works per 128-bit lane: a0 b0 | a1 b1 -> a0 a1 b0 b1.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}

WD_AVX2 void Avx2F16ToF32(const void* src, float* dst, size_t n, bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarF16ToF32(s, dst, i, false);
  // VCVTPH2PS quiets signalling NaNs keeping the payload, as c10 does.
  for (; i + 16 <= n; i += 16) {
    Store256(dst + i, _mm256_cvtph_ps(Load128(s + i)), stream);
    Store256(dst + i + 8, _mm256_cvtph_ps(Load128(s + i + 8)), stream);
  }
  StreamFence(stream);
  ScalarF16ToF32(s + i, dst + i, n - i, false);
}

WD_AVX2 void Avx2BF16ToF32(const void* src, float* dst, size_t n, bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarBF16ToF32(s, dst, i, false);
  for (; i + 16 <= n; i += 16) {
    Store256(dst + i, Avx2BF16ToF32Lanes(Load128(s + i)), stream);
    Store256(dst + i + 8, Avx2BF16ToF32Lanes(Load128(s + i + 8)), stream);
  }
  StreamFence(stream);
  ScalarBF16ToF32(s + i, dst + i, n - i, false);
}

WD_AVX2 void Avx2F64ToF32(const void* src, float* dst, size_t n, bool stream) {
  const double* s = static_cast<const double*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarF64ToF32(s, dst, i, false);
  for (; i + 8 <= n; i += 8) {
    __m128 a = _mm256_cvtpd_ps(_mm256_loadu_pd(s + i));
    __m128 b = _mm256_cvtpd_ps(_mm256_loadu_pd(s + i + 4));
    Store256(dst + i, _mm256_set_m128(b, a), stream);
  }
  StreamFence(stream);
  ScalarF64ToF32(s + i, dst + i, n - i, false);
}

// FP8 E4M3 -> F32: the 7 magnitude bits placed at F32 bit 20 make an F32
// (normal or subnormal) 2^120 times too small; one exact multiply fixes the
// scale. 0x7F (NaN) becomes c10's 0x7FF00000.
WD_AVX2 inline __m256 Avx2E4M3Lanes(__m256i v) {
  const __m256i sign =
      _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                           _mm256_castsi256_ps(_mm256_set1_epi32(247 << 23)));
  const __m256i is_nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
  __m256i bits = _mm256_blendv_epi8(_mm256_castps_si256(f),
                                    _mm256_set1_epi32(0x7FF00000), is_nan);
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

WD_AVX2 void Avx2E4M3ToF32(const void* src, float* dst, size_t n, bool stream) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarE4M3ToF32(s, dst, i, false);
  for (; i + 16 <= n; i += 16) {
    __m128i v = Load128(s + i);
    Store256(dst + i, Avx2E4M3Lanes(_mm256_cvtepu8_epi32(v)), stream);
    Store256(dst + i + 8,
             Avx2E4M3Lanes(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), stream);
  }
  StreamFence(stream);
  ScalarE4M3ToF32(s + i, dst + i, n - i, false);
}

WD_AVX2 void Avx2E5M2ToF32(const void* src, float* dst, size_t n, bool stream) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarE5M2ToF32(s, dst, i, false);
  for (; i + 16 <= n; i += 16) {
    __m128i v = Load128(s + i);
    // Each byte becomes the high byte of an F16.
    __m128i lo = _mm_unpacklo_epi8(_mm_setzero_si128(), v);
    __m128i hi = _mm_unpackhi_epi8(_mm_setzero_si128(), v);
    Store256(dst + i, _mm256_cvtph_ps(lo), stream);
    Store256(dst + i + 8, _mm256_cvtph_ps(hi), stream);
  }
  StreamFence(stream);
  ScalarE5M2ToF32(s + i, dst + i, n - i, false);
}

WD_AVX2 void Avx2F32ToF16(const float* src, void* dst, size_t n, bool stream) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF32ToF16(src, d, i, false);
  for (; i + 16 <= n; i += 16) {
    __m128i a = Avx2F16Lanes(_mm256_loadu_ps(src + i));
    __m128i b = Avx2F16Lanes(_mm256_loadu_ps(src + i + 8));
    Store256(d + i, _mm256_set_m128i(b, a), stream);
  }
  StreamFence(stream);
  ScalarF32ToF16(src + i, d + i, n - i, false);
}

WD_AVX2 void Avx2F32ToBF16(const float* src, void* dst, size_t n, bool stream) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF32ToBF16(src, d, i, false);
  for (; i + 16 <= n; i += 16) {
    __m256i a = Avx2BF16Lanes(_mm256_loadu_ps(src + i));
    __m256i b = Avx2BF16Lanes(_mm256_loadu_ps(src + i + 8));
    Store256(d + i, Avx2PackHalfwords(a, b), stream);
  }
  StreamFence(stream);
  ScalarF32ToBF16(src + i, d + i, n - i, false);
}

WD_AVX2 void Avx2F32ToF64(const float* src, void* dst, size_t n, bool stream) {
  double* d = static_cast<double*>(dst);
  size_t i = StreamHead(d, sizeof(double), n, stream);
  ScalarF32ToF64(src, d, i, false);
  for (; i + 8 <= n; i += 8) {
    Store256(d + i, _mm256_castpd_si256(_mm256_cvtps_pd(_mm_loadu_ps(src + i))),
             stream);
    Store256(d + i + 4,
             _mm256_castpd_si256(_mm256_cvtps_pd(_mm_loadu_ps(src + i + 4))),
             stream);
  }
  StreamFence(stream);
  ScalarF32ToF64(src + i, d + i, n - i, false);
}

WD_AVX2 void Avx2BF16ToF16(const void* src, void* dst, size_t n, bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarBF16ToF16(s, d, i, false);
  for (; i + 16 <= n; i += 16) {
    __m128i a = Avx2F16Lanes(Avx2BF16ToF32Lanes(Load128(s + i)));
    __m128i b = Avx2F16Lanes(Avx2BF16ToF32Lanes(Load128(s + i + 8)));
    Store256(d + i, _mm256_set_m128i(b, a), stream);
  }
  StreamFence(stream);
  ScalarBF16ToF16(s + i, d + i, n - i, false);
}

WD_AVX2 void Avx2F16ToBF16(const void* src, void* dst, size_t n, bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF16ToBF16(s, d, i, false);
  for (; i + 16 <= n; i += 16) {
    __m256i a = Avx2BF16Lanes(_mm256_cvtph_ps(Load128(s + i)));
    __m256i b = Avx2BF16Lanes(_mm256_cvtph_ps(Load128(s + i + 8)));
    Store256(d + i, Avx2PackHalfwords(a, b), stream);
  }
  StreamFence(stream);
  ScalarF16ToBF16(s + i, d + i, n - i, false);
}

// c10's fp8e4m3fn_from_fp32_value on 8 lanes; result in the low byte.
WD_AVX2 inline __m256i Avx2E4M3FromLanes(__m256 x) {
  PinInRegister(x);
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(u, sign);  // |x|, as a non-negative int
  // Denormal path: let the FPU round |x| + 2^14 at the fp8 subnormal step.
  const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
  __m256i den = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a),
                                        _mm256_castsi256_ps(denorm_mask))),
      denorm_mask);
  // Normal path: integer round to nearest even at bit 20.
  __m256i odd =
      _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i nrm = _mm256_add_epi32(
      a, _mm256_set1_epi32(static_cast<int32_t>(
             (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF)));
  nrm = _mm256_srli_epi32(_mm256_add_epi32(nrm, odd), 20);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
  const __m256i big =
      _mm256_cmpgt_epi32(a, _mm256_set1_epi32((1087 << 20) - 1));
  __m256i r = _mm256_blendv_epi8(nrm, den, small);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), big);
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xFF));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// c10's fp8e5m2_from_fp32_value on 8 lanes; result in the low byte.
WD_AVX2 inline __m256i Avx2E5M2FromLanes(__m256 x) {
  PinInRegister(x);
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(u, sign);
  const __m256i denorm_mask = _mm256_set1_epi32(134 << 23);
  __m256i den = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a),
                                        _mm256_castsi256_ps(denorm_mask))),
      denorm_mask);
  __m256i odd =
      _mm256_and_si256(_mm256_srli_epi32(a, 21), _mm256_set1_epi32(1));
  __m256i nrm = _mm256_add_epi32(
      a, _mm256_set1_epi32(static_cast<int32_t>(
             (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF)));
  nrm = _mm256_srli_epi32(_mm256_add_epi32(nrm, odd), 21);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(113 << 23), a);
  const __m256i big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((143 << 23) - 1));
  const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(255 << 23));
  const __m256i overflow = _mm256_blendv_epi8(_mm256_set1_epi32(0x7C),
                                              _mm256_set1_epi32(0x7F), is_nan);
  __m256i r = _mm256_blendv_epi8(nrm, den, small);
  r = _mm256_blendv_epi8(r, overflow, big);
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xFF));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// Packs four vectors of byte-valued 32-bit lanes into 32 bytes in order.
WD_AVX2 inline __m256i Avx2PackBytes(__m256i r0, __m256i r1, __m256i r2,
                                     __m256i r3) {
  __m256i p01 = _mm256_packus_epi32(r0, r1);
  __m256i p23 = _mm256_packus_epi32(r2, r3);
  __m256i b = _mm256_packus_epi16(p01, p23);
  return _mm256_permutevar8x32_epi32(b,
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <__m256i (*Lanes)(__m256), FromF32Fn Tail>
WD_AVX2 void Avx2F32ToFp8(const float* src, void* dst, size_t n, bool stream) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  size_t i = StreamHead(d, 1, n, stream);
  Tail(src, d, i, false);
  for (; i + 32 <= n; i += 32) {
    __m256i v = Avx2PackBytes(Lanes(_mm256_loadu_ps(src + i)),
                              Lanes(_mm256_loadu_ps(src + i + 8)),
                              Lanes(_mm256_loadu_ps(src + i + 16)),
                              Lanes(_mm256_loadu_ps(src + i + 24)));
    Store256(d + i, v, stream);
  }
  StreamFence(stream);
  Tail(src + i, d + i, n - i, false);
}

KernelFamily MakeAvx2Family() {
  KernelFamily k;
  k.name = "avx2";
  k.to_f32[Idx(DType::kF16)] = Avx2F16ToF32;
  k.to_f32[Idx(DType::kBF16)] = Avx2BF16ToF32;
  k.to_f32[Idx(DType::kF64)] = Avx2F64ToF32;
  k.to_f32[Idx(DType::kF8E4M3)] = Avx2E4M3ToF32;
  k.to_f32[Idx(DType::kF8E5M2)] = Avx2E5M2ToF32;
  k.from_f32[Idx(DType::kF16)] = Avx2F32ToF16;
  k.from_f32[Idx(DType::kBF16)] = Avx2F32ToBF16;
  k.from_f32[Idx(DType::kF64)] = Avx2F32ToF64;
  k.from_f32[Idx(DType::kF8E4M3)] =
      Avx2F32ToFp8<Avx2E4M3FromLanes, ScalarF32ToE4M3>;
  k.from_f32[Idx(DType::kF8E5M2)] =
      Avx2F32ToFp8<Avx2E5M2FromLanes, ScalarF32ToE5M2>;
  k.direct[Idx(DType::kBF16)][Idx(DType::kF16)] = Avx2BF16ToF16;
  k.direct[Idx(DType::kF16)][Idx(DType::kBF16)] = Avx2F16ToBF16;
  return k;
}

// --- AVX-512 loops ---------------------------------------------------------
//
// Tails go to the AVX2 loops (a subset of the required ISA).

#define WD_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma")))

WD_AVX512 inline void Store512(void* p, __m512i v, bool stream) {
  if (stream) {
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  } else {
    _mm512_storeu_si512(p, v);
  }
}
WD_AVX512 inline void Store512(void* p, __m512 v, bool stream) {
  Store512(p, _mm512_castps_si512(v), stream);
}
WD_AVX512 inline void PinInRegister(__m512& x) { asm("" : "+v"(x)); }
WD_AVX512 inline __m512i Join256(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

WD_AVX512 inline __m512 Avx512BF16ToF32Lanes(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

WD_AVX512 inline __m256i Avx512F16Lanes(__m512 x) {
  PinInRegister(x);
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (__builtin_expect(nan != 0, 0)) {
    __m512i fix = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16),
                         _mm512_set1_epi32(0x8000)),
        _mm512_set1_epi32(0x7E00));
    h = _mm256_mask_blend_epi16(nan, h, _mm512_cvtepi32_epi16(fix));
  }
  return h;
}

// F32 -> BF16 for 16 lanes, as 32-bit lanes holding the 16-bit result.
WD_AVX512 inline __m512i Avx512BF16Lanes(__m512 x) {
  PinInRegister(x);
  __m512i u = _mm512_castps_si512(x);
  __m512i odd =
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  r = _mm512_srli_epi32(r, 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

// Packs two vectors of 16-bit-valued 32-bit lanes into 32 halfwords in order.
WD_AVX512 inline __m512i Avx512PackHalfwords(__m512i a, __m512i b) {
  // packus interleaves per 128-bit lane; the permutation restores order.
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  return _mm512_permutexvar_epi64(order, _mm512_packus_epi32(a, b));
}

WD_AVX512 void Avx512F16ToF32(const void* src, float* dst, size_t n,
                              bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarF16ToF32(s, dst, i, false);
  for (; i + 32 <= n; i += 32) {
    Store512(dst + i, _mm512_cvtph_ps(Load256(s + i)), stream);
    Store512(dst + i + 16, _mm512_cvtph_ps(Load256(s + i + 16)), stream);
  }
  StreamFence(stream);
  Avx2F16ToF32(s + i, dst + i, n - i, false);
}

WD_AVX512 void Avx512BF16ToF32(const void* src, float* dst, size_t n,
                               bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarBF16ToF32(s, dst, i, false);
  for (; i + 32 <= n; i += 32) {
    Store512(dst + i, Avx512BF16ToF32Lanes(Load256(s + i)), stream);
    Store512(dst + i + 16, Avx512BF16ToF32Lanes(Load256(s + i + 16)), stream);
  }
  StreamFence(stream);
  Avx2BF16ToF32(s + i, dst + i, n - i, false);
}

WD_AVX512 void Avx512F64ToF32(const void* src, float* dst, size_t n,
                              bool stream) {
  const double* s = static_cast<const double*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarF64ToF32(s, dst, i, false);
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm512_cvtpd_ps(_mm512_loadu_pd(s + i));
    __m256 b = _mm512_cvtpd_ps(_mm512_loadu_pd(s + i + 8));
    Store512(dst + i, Join256(_mm256_castps_si256(a), _mm256_castps_si256(b)),
             stream);
  }
  StreamFence(stream);
  Avx2F64ToF32(s + i, dst + i, n - i, false);
}

WD_AVX512 inline __m512 Avx512E4M3Lanes(__m128i bytes) {
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag_mask = _mm512_set1_epi32(0x7F);
  const __m512i sign = _mm512_slli_epi32(_mm512_andnot_si512(mag_mask, v), 24);
  const __m512i mag = _mm512_and_si512(v, mag_mask);
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                           _mm512_castsi512_ps(_mm512_set1_epi32(247 << 23)));
  __m512i bits = _mm512_mask_mov_epi32(_mm512_castps_si512(f),
                                       _mm512_cmpeq_epi32_mask(mag, mag_mask),
                                       _mm512_set1_epi32(0x7FF00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

WD_AVX512 void Avx512E4M3ToF32(const void* src, float* dst, size_t n,
                               bool stream) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarE4M3ToF32(s, dst, i, false);
  for (; i + 32 <= n; i += 32) {
    Store512(dst + i, Avx512E4M3Lanes(Load128(s + i)), stream);
    Store512(dst + i + 16, Avx512E4M3Lanes(Load128(s + i + 16)), stream);
  }
  StreamFence(stream);
  Avx2E4M3ToF32(s + i, dst + i, n - i, false);
}

WD_AVX512 void Avx512E5M2ToF32(const void* src, float* dst, size_t n,
                               bool stream) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  size_t i = StreamHead(dst, sizeof(float), n, stream);
  ScalarE5M2ToF32(s, dst, i, false);
  for (; i + 32 <= n; i += 32) {
    __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(Load256(s + i)), 8);
    Store512(dst + i, _mm512_cvtph_ps(_mm512_castsi512_si256(h)), stream);
    Store512(dst + i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)),
             stream);
  }
  StreamFence(stream);
  Avx2E5M2ToF32(s + i, dst + i, n - i, false);
}

WD_AVX512 void Avx512F32ToF16(const float* src, void* dst, size_t n,
                              bool stream) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF32ToF16(src, d, i, false);
  for (; i + 32 <= n; i += 32) {
    __m256i a = Avx512F16Lanes(_mm512_loadu_ps(src + i));
    __m256i b = Avx512F16Lanes(_mm512_loadu_ps(src + i + 16));
    Store512(d + i, Join256(a, b), stream);
  }
  StreamFence(stream);
  Avx2F32ToF16(src + i, d + i, n - i, false);
}

WD_AVX512 void Avx512F32ToBF16(const float* src, void* dst, size_t n,
                               bool stream) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF32ToBF16(src, d, i, false);
  for (; i + 32 <= n; i += 32) {
    __m512i a = Avx512BF16Lanes(_mm512_loadu_ps(src + i));
    __m512i b = Avx512BF16Lanes(_mm512_loadu_ps(src + i + 16));
    Store512(d + i, Avx512PackHalfwords(a, b), stream);
  }
  StreamFence(stream);
  Avx2F32ToBF16(src + i, d + i, n - i, false);
}

WD_AVX512 void Avx512F32ToF64(const float* src, void* dst, size_t n,
                              bool stream) {
  double* d = static_cast<double*>(dst);
  size_t i = StreamHead(d, sizeof(double), n, stream);
  ScalarF32ToF64(src, d, i, false);
  for (; i + 16 <= n; i += 16) {
    Store512(d + i,
             _mm512_castpd_si512(_mm512_cvtps_pd(_mm256_loadu_ps(src + i))),
             stream);
    Store512(d + i + 8,
             _mm512_castpd_si512(_mm512_cvtps_pd(_mm256_loadu_ps(src + i + 8))),
             stream);
  }
  StreamFence(stream);
  Avx2F32ToF64(src + i, d + i, n - i, false);
}

WD_AVX512 void Avx512BF16ToF16(const void* src, void* dst, size_t n,
                               bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarBF16ToF16(s, d, i, false);
  for (; i + 32 <= n; i += 32) {
    __m256i a = Avx512F16Lanes(Avx512BF16ToF32Lanes(Load256(s + i)));
    __m256i b = Avx512F16Lanes(Avx512BF16ToF32Lanes(Load256(s + i + 16)));
    Store512(d + i, Join256(a, b), stream);
  }
  StreamFence(stream);
  Avx2BF16ToF16(s + i, d + i, n - i, false);
}

WD_AVX512 void Avx512F16ToBF16(const void* src, void* dst, size_t n,
                               bool stream) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  size_t i = StreamHead(d, 2, n, stream);
  ScalarF16ToBF16(s, d, i, false);
  for (; i + 32 <= n; i += 32) {
    __m512i a = Avx512BF16Lanes(_mm512_cvtph_ps(Load256(s + i)));
    __m512i b = Avx512BF16Lanes(_mm512_cvtph_ps(Load256(s + i + 16)));
    Store512(d + i, Avx512PackHalfwords(a, b), stream);
  }
  StreamFence(stream);
  Avx2F16ToBF16(s + i, d + i, n - i, false);
}

WD_AVX512 inline __m128i Avx512E4M3FromLanes(__m512 x) {
  PinInRegister(x);
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(u, sign);
  const __m512i denorm_mask = _mm512_set1_epi32(141 << 23);
  __m512i den = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                        _mm512_castsi512_ps(denorm_mask))),
      denorm_mask);
  __m512i odd =
      _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i nrm = _mm512_add_epi32(
      a, _mm512_set1_epi32(static_cast<int32_t>(
             (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF)));
  nrm = _mm512_srli_epi32(_mm512_add_epi32(nrm, odd), 20);
  __m512i r = _mm512_mask_mov_epi32(
      nrm, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(121 << 23)), den);
  r = _mm512_mask_mov_epi32(
      r, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(1087 << 20)),
      _mm512_set1_epi32(0x7F));
  r = _mm512_and_si512(r, _mm512_set1_epi32(0xFF));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}

WD_AVX512 inline __m128i Avx512E5M2FromLanes(__m512 x) {
  PinInRegister(x);
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(u, sign);
  const __m512i denorm_mask = _mm512_set1_epi32(134 << 23);
  __m512i den = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                        _mm512_castsi512_ps(denorm_mask))),
      denorm_mask);
  __m512i odd =
      _mm512_and_si512(_mm512_srli_epi32(a, 21), _mm512_set1_epi32(1));
  __m512i nrm = _mm512_add_epi32(
      a, _mm512_set1_epi32(static_cast<int32_t>(
             (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFF)));
  nrm = _mm512_srli_epi32(_mm512_add_epi32(nrm, odd), 21);
  __m512i overflow = _mm512_mask_mov_epi32(
      _mm512_set1_epi32(0x7C),
      _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(255 << 23)),
      _mm512_set1_epi32(0x7F));
  __m512i r = _mm512_mask_mov_epi32(
      nrm, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(113 << 23)), den);
  r = _mm512_mask_mov_epi32(
      r, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(143 << 23)), overflow);
  r = _mm512_and_si512(r, _mm512_set1_epi32(0xFF));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}

template <__m128i (*Lanes)(__m512), FromF32Fn Tail>
WD_AVX512 void Avx512F32ToFp8(const float* src, void* dst, size_t n,
                              bool stream) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  size_t i = StreamHead(d, 1, n, stream);
  Tail(src, d, i, false);
  for (; i + 64 <= n; i += 64) {
    __m256i lo = _mm256_set_m128i(Lanes(_mm512_loadu_ps(src + i + 16)),
                                  Lanes(_mm512_loadu_ps(src + i)));
    __m256i hi = _mm256_set_m128i(Lanes(_mm512_loadu_ps(src + i + 48)),
                                  Lanes(_mm512_loadu_ps(src + i + 32)));
    Store512(d + i, Join256(lo, hi), stream);
  }
  StreamFence(stream);
  Tail(src + i, d + i, n - i, false);
}

KernelFamily MakeAvx512Family() {
  KernelFamily k;
  k.name = "avx512";
  k.to_f32[Idx(DType::kF16)] = Avx512F16ToF32;
  k.to_f32[Idx(DType::kBF16)] = Avx512BF16ToF32;
  k.to_f32[Idx(DType::kF64)] = Avx512F64ToF32;
  k.to_f32[Idx(DType::kF8E4M3)] = Avx512E4M3ToF32;
  k.to_f32[Idx(DType::kF8E5M2)] = Avx512E5M2ToF32;
  k.from_f32[Idx(DType::kF16)] = Avx512F32ToF16;
  k.from_f32[Idx(DType::kBF16)] = Avx512F32ToBF16;
  k.from_f32[Idx(DType::kF64)] = Avx512F32ToF64;
  k.from_f32[Idx(DType::kF8E4M3)] =
      Avx512F32ToFp8<Avx512E4M3FromLanes,
                     Avx2F32ToFp8<Avx2E4M3FromLanes, ScalarF32ToE4M3>>;
  k.from_f32[Idx(DType::kF8E5M2)] =
      Avx512F32ToFp8<Avx512E5M2FromLanes,
                     Avx2F32ToFp8<Avx2E5M2FromLanes, ScalarF32ToE5M2>>;
  k.direct[Idx(DType::kBF16)][Idx(DType::kF16)] = Avx512BF16ToF16;
  k.direct[Idx(DType::kF16)][Idx(DType::kBF16)] = Avx512F16ToBF16;
  return k;
}

#undef WD_AVX2
#undef WD_AVX512

// ---------------------------------------------------------------------------
// Family selection.

// F16C straight from CPUID: clang before 16 rejects
// __builtin_cpu_supports("f16c").
bool CpuHasF16c() {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}

bool CpuHasAvx2() {
  return __builtin_cpu_supports("avx2") && CpuHasF16c() && __builtin_cpu_supports("fma");
}

bool CpuHasAvx512() {
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

const KernelFamily& ScalarFamily() {
  static const KernelFamily k = MakeScalarFamily();
  return k;
}
const KernelFamily& Avx2Family() {
  static const KernelFamily k = MakeAvx2Family();
  return k;
}
const KernelFamily& Avx512Family() {
  static const KernelFamily k = MakeAvx512Family();
  return k;
}

// The named family, or null when the CPU lacks it or the name is unknown.
const KernelFamily* FamilyByName(absl::string_view name) {
  if (name == "scalar") return &ScalarFamily();
  if (name == "avx2") return CpuHasAvx2() ? &Avx2Family() : nullptr;
  if (name == "avx512") return CpuHasAvx512() ? &Avx512Family() : nullptr;
  return nullptr;
}

const KernelFamily& SelectFamily() {
  // A forced family the CPU lacks falls back to the best narrower one.
  const char* env = std::getenv("WEIGHTD_CAST_KERNEL");
  absl::string_view want = env != nullptr ? env : "";
  if (want == "scalar") return ScalarFamily();
  if (CpuHasAvx512() && want != "avx2") return Avx512Family();
  if (CpuHasAvx2()) return Avx2Family();
  return ScalarFamily();
}

const KernelFamily& ActiveFamily() {
  static const KernelFamily& k = SelectFamily();
  return k;
}

// Elements per F32 staging chunk for casts between two non-F32 types: 16 KiB
// of floats, which stays in L1 between the two passes.
constexpr size_t kChunk = 4096;

absl::Status CastWith(const KernelFamily& k, DType src_dtype, const void* src,
                      DType dst_dtype, void* dst, size_t count) {
  if (src_dtype == dst_dtype) {
    if (count != 0) std::memcpy(dst, src, count * DTypeSize(src_dtype));
    return absl::OkStatus();
  }
  if (!IsFloating(src_dtype) || !IsFloating(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cast ", DTypeName(src_dtype), " to ", DTypeName(dst_dtype)));
  }
  if (count == 0) return absl::OkStatus();
  // Streaming needs an element-aligned dst to reach vector alignment.
  const bool stream =
      count * DTypeSize(dst_dtype) >= kStreamThresholdBytes &&
      reinterpret_cast<uintptr_t>(dst) % DTypeSize(dst_dtype) == 0;
  if (src_dtype == DType::kF32) {
    k.from_f32[Idx(dst_dtype)](static_cast<const float*>(src), dst, count,
                               stream);
    return absl::OkStatus();
  }
  if (dst_dtype == DType::kF32) {
    k.to_f32[Idx(src_dtype)](src, static_cast<float*>(dst), count, stream);
    return absl::OkStatus();
  }
  if (DirectFn direct = k.direct[Idx(src_dtype)][Idx(dst_dtype)]) {
    direct(src, dst, count, stream);
    return absl::OkStatus();
  }
  ToF32Fn to = k.to_f32[Idx(src_dtype)];
  FromF32Fn from = k.from_f32[Idx(dst_dtype)];
  const size_t src_size = DTypeSize(src_dtype);
  const size_t dst_size = DTypeSize(dst_dtype);
  alignas(64) float chunk[kChunk];
  for (size_t done = 0; done < count; done += kChunk) {
    const size_t n = count - done < kChunk ? count - done : kChunk;
    to(static_cast<const char*>(src) + done * src_size, chunk, n, false);
    from(chunk, static_cast<char*>(dst) + done * dst_size, n, stream);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CastBuffer(DType src_dtype, const void* src, DType dst_dtype,
                        void* dst, size_t count) {
  return CastWith(ActiveFamily(), src_dtype, src, dst_dtype, dst, count);
}

absl::Status CastBufferScalar(DType src_dtype, const void* src, DType dst_dtype,
                              void* dst, size_t count) {
  return CastWith(ScalarFamily(), src_dtype, src, dst_dtype, dst, count);
}

absl::string_view CastKernelName() { return ActiveFamily().name; }

namespace cast_internal {

// For tests and benchmarks (declared where used, not in cast.h): runs one
// named family regardless of the dispatch choice. FAILED_PRECONDITION when
// this CPU lacks it; INVALID_ARGUMENT for an unknown name.
absl::Status CastBufferWithKernel(absl::string_view kernel, DType src_dtype,
                                  const void* src, DType dst_dtype, void* dst,
                                  size_t count) {
  const KernelFamily* k = FamilyByName(kernel);
  if (k == nullptr) {
    if (kernel == "avx2" || kernel == "avx512") {
      return absl::FailedPreconditionError(
          absl::StrCat("cast kernel ", kernel, " not supported by this CPU"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cast kernel \"", kernel, "\""));
  }
  return CastWith(*k, src_dtype, src, dst_dtype, dst, count);
}

}  // namespace cast_internal
}  // namespace weightd
