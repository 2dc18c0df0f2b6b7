#include "server/kernels/cast.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace weightd {
namespace cast_internal {
// Defined in cast.cc; runs one named kernel family ("scalar", "avx2",
// "avx512"). FAILED_PRECONDITION when this CPU lacks it.
absl::Status CastBufferWithKernel(absl::string_view kernel, DType src_dtype,
                                  const void* src, DType dst_dtype, void* dst,
                                  size_t count);
}  // namespace cast_internal

namespace {

using cast_internal::CastBufferWithKernel;

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float F(uint32_t w) { return std::bit_cast<float>(w); }
uint64_t Bits(double d) { return std::bit_cast<uint64_t>(d); }

constexpr DType kFloatTypes[] = {DType::kF64,  DType::kF32,    DType::kF16,
                                 DType::kBF16, DType::kF8E4M3, DType::kF8E5M2};

// Kernel families this CPU can run, vector ones first.
std::vector<std::string> VectorKernels() {
  std::vector<std::string> out;
  for (const char* name : {"avx512", "avx2"}) {
    float in = 1.0f;
    uint16_t o;
    if (CastBufferWithKernel(name, DType::kF32, &in, DType::kF16, &o, 1).ok()) {
      out.push_back(name);
    }
  }
  return out;
}

// --- independent references (not ports of c10) ------------------------------

// Integer round-to-nearest-even F32 -> F16.
uint16_t RefFloatToHalf(float f) {
  const uint32_t w = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((w >> 16) & 0x8000);
  const uint32_t a = w & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7E00;
  if (a >= 0x477FF000) return sign | 0x7C00;  // >= 65520 rounds to Inf
  if (a < 0x38800000) {                       // below 2^-14: subnormal
    double scaled = std::fabs(static_cast<double>(f)) * 0x1p24;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7FFFFF) >> 13));
  const uint32_t rem = a & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

double RefHalfValue(uint16_t h) {
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31)
    return m ? std::numeric_limits<double>::quiet_NaN()
             : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}

double RefE4M3Value(uint8_t v) {
  const int e = (v >> 3) & 0xF;
  const int m = v & 7;
  const double s = (v & 0x80) ? -1.0 : 1.0;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return s * std::ldexp(m, -9);
  return s * std::ldexp(8 + m, e - 10);
}

// --- scalar element conversions --------------------------------------------

TEST(CastTest, HalfExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t h16 = static_cast<uint16_t>(h);
    const float f = HalfToFloat(h16);
    const double ref = RefHalfValue(h16);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      // c10 keeps the payload and sets the quiet bit.
      EXPECT_EQ(Bits(f),
                ((h & 0x8000u) << 16) | 0x7FC00000u | ((h & 0x3FFu) << 13))
          << h;
      EXPECT_EQ(FloatToHalf(f), (h & 0x8000) | 0x7E00) << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
      ASSERT_EQ(FloatToHalf(f), h16) << h;
    }
  }
}

TEST(CastTest, BFloat16ExhaustiveRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t b16 = static_cast<uint16_t>(b);
    const float f = BFloat16ToFloat(b16);
    ASSERT_EQ(Bits(f), b << 16);
    if (std::isnan(f)) {
      EXPECT_EQ(FloatToBFloat16(f), 0x7FC0) << b;  // c10 drops the sign
    } else {
      ASSERT_EQ(FloatToBFloat16(f), b16) << b;
    }
  }
}

TEST(CastTest, FloatToHalfSpecialValues) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x00000000, 0x0000},       // +0
      {0x80000000, 0x8000},       // -0
      {0x7F800000, 0x7C00},       // +Inf
      {0xFF800000, 0xFC00},       // -Inf
      {0x7FC00000, 0x7E00},       // qNaN
      {0xFFC00001, 0xFE00},       // -qNaN with payload
      {0x7F800001, 0x7E00},       // sNaN
      {0x7FFFFFFF, 0x7E00},       // NaN, all payload bits
      {Bits(65504.0f), 0x7BFF},   // max finite
      {Bits(65519.99f), 0x7BFF},  // just below the overflow boundary
      {Bits(65520.0f), 0x7C00},   // overflow boundary rounds to Inf
      {Bits(-65520.0f), 0xFC00},
      {Bits(1e10f), 0x7C00},
      {0x7F7FFFFF, 0x7C00},          // F32 max
      {Bits(0x1p-14f), 0x0400},      // min normal
      {Bits(0x1p-24f), 0x0001},      // min subnormal
      {Bits(0x1p-25f), 0x0000},      // tie between 0 and min subnormal -> 0
      {Bits(0x1p-25f) + 1, 0x0001},  // just above that tie
      {Bits(0x3p-25f), 0x0002},      // tie between 1 and 2 subnormal steps
      {Bits(0x5p-25f), 0x0002},      // tie between 2 and 3 -> 2
      {Bits(-0x1p-24f), 0x8001},
      {Bits(0x1.ffcp-15f),
       0x0400},  // largest subnormal + half step -> min normal
      {Bits(0x1.ff8p-15f), 0x03FF},  // largest subnormal
      {0x00000001, 0x0000},          // F32 subnormal
      {0x80000001, 0x8000},
      {Bits(1.0f), 0x3C00},
      {Bits(1.0f + 0x1p-11f), 0x3C00},      // tie -> even
      {Bits(1.0f + 0x3p-11f), 0x3C02},      // tie -> even (up)
      {Bits(1.0f + 0x1p-11f) + 1, 0x3C01},  // above the tie
      {Bits(65504.0f + 15.99f), 0x7BFF},
      {Bits(-2.0f), 0xC000},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToHalf(F(c.in)), c.out) << absl::StrFormat("0x%08x", c.in);
    EXPECT_EQ(RefFloatToHalf(F(c.in)), c.out)
        << absl::StrFormat("0x%08x", c.in);
  }
}

TEST(CastTest, FloatToBFloat16SpecialValues) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x00000000, 0x0000}, {0x80000000, 0x8000},
      {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},
      {0x7FC00000, 0x7FC0}, {0xFFC00001, 0x7FC0},
      {0x7F800001, 0x7FC0}, {0xFFFFFFFF, 0x7FC0},
      {0x3F800000, 0x3F80}, {0x3F808000, 0x3F80},  // tie -> even (down)
      {0x3F818000, 0x3F82},                        // tie -> even (up)
      {0x3F808001, 0x3F81},                        // above the tie
      {0x3F807FFF, 0x3F80},                        // below the tie
      {0x7F7FFFFF, 0x7F80},                        // F32 max rounds to Inf
      {0xFF7FFFFF, 0xFF80}, {0x7F7F7FFF, 0x7F7F},  // largest that stays finite
      {0x00000001, 0x0000},  // subnormals round like everything else
      {0x00008000, 0x0000},  // tie -> even
      {0x00018000, 0x0002}, {0x00008001, 0x0001},
      {0x807FFFFF, 0x8080},  // largest negative subnormal -> -min normal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToBFloat16(F(c.in)), c.out)
        << absl::StrFormat("0x%08x", c.in);
  }
}

TEST(CastTest, Fp8E4M3ExhaustiveDecodeAndRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t v = static_cast<uint8_t>(c);
    const float f = Fp8E4M3ToFloat(v);
    const double ref = RefE4M3Value(v);
    if (std::isnan(ref)) {
      EXPECT_EQ(Bits(f), ((c & 0x80u) << 24) | 0x7FF00000u) << c;
    } else {
      EXPECT_EQ(static_cast<double>(f), ref) << c;
      EXPECT_EQ(std::signbit(f), (c & 0x80) != 0) << c;
    }
    EXPECT_EQ(FloatToFp8E4M3(f), v) << c;
  }
}

TEST(CastTest, Fp8E4M3KnownValues) {
  struct Case {
    float in;
    uint8_t out;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {1.0f, 0x38},
      {-2.0f, 0xC0},
      {448.0f, 0x7E},
      {-448.0f, 0xFE},
      {416.0f, 0x7D},
      {464.0f, 0x7E},  // tie between 448 and 480(NaN) -> even mantissa 448
      {464.5f, 0x7F},  // past the tie: rounds into the NaN code
      {479.0f, 0x7F},
      {480.0f, 0x7F},
      {-480.0f, 0xFF},
      {1e6f, 0x7F},
      {inf, 0x7F},
      {-inf, 0xFF},
      {nan, 0x7F},
      {-nan, 0xFF},
      {0x1p-6f, 0x08},   // min normal
      {0x1p-9f, 0x01},   // min subnormal
      {0x1p-10f, 0x00},  // tie between 0 and min subnormal -> 0
      {0x1.000002p-10f, 0x01},
      {0x3p-10f, 0x02},  // tie between 1 and 2 -> 2
      {0x7p-9f, 0x07},
      {0xfp-10f, 0x08},  // tie between 7 and 8 -> 8
      {-0x1p-9f, 0x81},
      {0x1p-30f, 0x00},
      {-0x1p-30f, 0x80},
      {1.0625f, 0x38},  // tie -> even
      {1.1875f, 0x3A},  // tie -> even (up)
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToFp8E4M3(c.in), c.out) << c.in;
  }
}

TEST(CastTest, Fp8E5M2ExhaustiveDecodeAndRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t v = static_cast<uint8_t>(c);
    const float f = Fp8E5M2ToFloat(v);
    EXPECT_EQ(Bits(f), Bits(HalfToFloat(static_cast<uint16_t>(c << 8)))) << c;
    const bool is_nan = (c & 0x7C) == 0x7C && (c & 3) != 0;
    EXPECT_EQ(std::isnan(f), is_nan) << c;
    EXPECT_EQ(FloatToFp8E5M2(f), is_nan ? (c & 0x80) | 0x7F : c) << c;
  }
}

TEST(CastTest, Fp8E5M2KnownValues) {
  struct Case {
    float in;
    uint8_t out;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {0.0f, 0x00},     {-0.0f, 0x80},    {1.0f, 0x3C},
      {57344.0f, 0x7B},                    // max finite
      {61439.0f, 0x7B}, {61440.0f, 0x7C},  // tie -> even = Inf
      {65536.0f, 0x7C}, {-1e9f, 0xFC},    {inf, 0x7C},
      {-inf, 0xFC},     {nan, 0x7F},      {-nan, 0xFF},
      {0x1p-14f, 0x04},  // min normal
      {0x1p-16f, 0x01},  // min subnormal
      {0x1p-17f, 0x00},  // tie -> 0
      {0x3p-17f, 0x02},  // tie -> 2
      {1.125f, 0x3C},    // tie -> even
      {1.375f, 0x3E},    // tie -> even (up)
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToFp8E5M2(c.in), c.out) << c.in;
  }
}

// --- CastBuffer --------------------------------------------------------------

TEST(CastBufferTest, F64RoundsToF32First) {
  // PyTorch rounds F64 -> F32 -> F16: the 2^-40 is lost first, and the F32
  // value is then an exact tie that goes to even.
  const double in[] = {1.0 + 0x1p-11 + 0x1p-40,
                       1.0 + 0x1p-8 + 0x1p-40,
                       1.0 + 0x1p-24 + 0x1p-40,
                       1e300,
                       -1e300,
                       std::numeric_limits<double>::quiet_NaN(),
                       -0.0};
  uint16_t f16[7];
  uint16_t bf16[7];
  float f32[7];
  ASSERT_TRUE(CastBuffer(DType::kF64, in, DType::kF16, f16, 7).ok());
  ASSERT_TRUE(CastBuffer(DType::kF64, in, DType::kBF16, bf16, 7).ok());
  ASSERT_TRUE(CastBuffer(DType::kF64, in, DType::kF32, f32, 7).ok());
  EXPECT_EQ(f16[0], 0x3C00);   // not 0x3C01
  EXPECT_EQ(bf16[1], 0x3F80);  // not 0x3F81
  EXPECT_EQ(Bits(f32[2]), 0x3F800001u);
  EXPECT_EQ(f16[3], 0x7C00);
  EXPECT_EQ(f16[4], 0xFC00);
  EXPECT_EQ(Bits(f32[3]), 0x7F800000u);
  EXPECT_TRUE(std::isnan(f32[5]));
  EXPECT_EQ(f16[5], 0x7E00);
  EXPECT_EQ(bf16[5], 0x7FC0);
  EXPECT_EQ(f16[6], 0x8000);
  EXPECT_EQ(bf16[6], 0x8000);
}

TEST(CastBufferTest, F32ToF64IsExact) {
  const float in[] = {1.5f, -0x1p-149f, 3.4028235e38f, -0.0f};
  double out[4];
  ASSERT_TRUE(CastBuffer(DType::kF32, in, DType::kF64, out, 4).ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Bits(out[i]), Bits(static_cast<double>(in[i])));
  }
}

TEST(CastBufferTest, NonFloatPairsAreInvalid) {
  int32_t i32[3] = {1, 2, 3};
  float f32[3];
  int8_t i8[3];
  EXPECT_EQ(CastBuffer(DType::kI32, i32, DType::kF32, f32, 3).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CastBuffer(DType::kF32, f32, DType::kI8, i8, 3).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CastBuffer(DType::kI8, i8, DType::kU8, i8, 3).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CastBuffer(DType::kBool, i8, DType::kF16, f32, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CastBufferScalar(DType::kI64, i32, DType::kF64, f32, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CastBufferTest, IdentityIsCopy) {
  const int32_t in[3] = {-7, 0x7FFFFFFF, 42};
  int32_t out[3] = {};
  ASSERT_TRUE(CastBuffer(DType::kI32, in, DType::kI32, out, 3).ok());
  EXPECT_EQ(std::memcmp(in, out, sizeof(in)), 0);
  const uint16_t nan_in[2] = {0x7C01, 0xFFFF};  // payloads kept by identity
  uint16_t nan_out[2] = {};
  ASSERT_TRUE(CastBuffer(DType::kF16, nan_in, DType::kF16, nan_out, 2).ok());
  EXPECT_EQ(nan_out[0], 0x7C01);
  EXPECT_EQ(nan_out[1], 0xFFFF);
  EXPECT_TRUE(CastBuffer(DType::kF32, nullptr, DType::kF16, nullptr, 0).ok());
}

TEST(CastBufferTest, KernelNameAndUnknownKernel) {
  const absl::string_view name = CastKernelName();
  EXPECT_TRUE(name == "scalar" || name == "avx2" || name == "avx512") << name;
  const std::vector<std::string> vec = VectorKernels();
  const char* forced = std::getenv("WEIGHTD_CAST_KERNEL");
  if (forced == nullptr) {
    EXPECT_EQ(name, vec.empty() ? "scalar" : vec.front());
  } else if (std::string(forced) == "scalar" ||
             std::find(vec.begin(), vec.end(), forced) != vec.end()) {
    EXPECT_EQ(name, forced);  // run with WEIGHTD_CAST_KERNEL=avx2 etc.
  }
  float in = 1.0f;
  uint16_t out;
  EXPECT_EQ(CastBufferWithKernel("sse9", DType::kF32, &in, DType::kF16, &out, 1)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Casts `src` with the named family and with the scalar family and requires
// identical bytes.
void ExpectSameAsScalar(const std::string& kernel, DType from, const void* src,
                        DType to, size_t count, size_t dst_offset_bytes) {
  const size_t dst_bytes = count * DTypeSize(to);
  std::vector<uint8_t> want(dst_bytes);
  std::vector<uint8_t> got(dst_bytes + 64, 0xAB);
  uint8_t* got_ptr = got.data() + dst_offset_bytes;
  ASSERT_TRUE(CastBufferScalar(from, src, to, want.data(), count).ok());
  ASSERT_TRUE(CastBufferWithKernel(kernel, from, src, to, got_ptr, count).ok());
  for (size_t i = 0; i < dst_bytes; i += DTypeSize(to)) {
    if (std::memcmp(want.data() + i, got_ptr + i, DTypeSize(to)) != 0) {
      FAIL() << kernel << " " << DTypeName(from) << "->" << DTypeName(to)
             << " differs from scalar at element " << i / DTypeSize(to);
    }
  }
  // Nothing written past the end.
  for (size_t i = dst_offset_bytes + dst_bytes; i < got.size(); ++i) {
    ASSERT_EQ(got[i], 0xAB) << "overrun at byte " << i;
  }
  for (size_t i = 0; i < dst_offset_bytes; ++i) {
    ASSERT_EQ(got[i], 0xAB) << "underrun at byte " << i;
  }
}

TEST(CastBufferTest, VectorMatchesScalarOnAllF16AndBF16Patterns) {
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const std::string& kernel : VectorKernels()) {
    for (DType from : {DType::kF16, DType::kBF16}) {
      for (DType to : kFloatTypes) {
        if (to == from) continue;
        // Odd length, source misaligned by one element.
        ExpectSameAsScalar(kernel, from, all.data() + 1, to, 65536 + 1, 0);
        ExpectSameAsScalar(kernel, from, all.data(), to, 65536, DTypeSize(to));
      }
    }
  }
}

TEST(CastBufferTest, VectorMatchesScalarOnAllFp8Codes) {
  std::vector<uint8_t> all(256 * 9 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i * 7);
  for (const std::string& kernel : VectorKernels()) {
    for (DType from : {DType::kF8E4M3, DType::kF8E5M2}) {
      for (DType to : kFloatTypes) {
        if (to == from) continue;
        ExpectSameAsScalar(kernel, from, all.data() + 1, to, all.size() - 1, 1);
      }
    }
  }
}

TEST(CastBufferTest, ScalarFp8BuffersMatchElementFunctions) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t v = static_cast<uint8_t>(c);
    float f[2];
    ASSERT_TRUE(
        CastBufferScalar(DType::kF8E4M3, &v, DType::kF32, &f[0], 1).ok());
    ASSERT_TRUE(
        CastBufferScalar(DType::kF8E5M2, &v, DType::kF32, &f[1], 1).ok());
    EXPECT_EQ(Bits(f[0]), Bits(Fp8E4M3ToFloat(v)));
    EXPECT_EQ(Bits(f[1]), Bits(Fp8E5M2ToFloat(v)));
    // FP8 -> F16 goes through F32.
    uint16_t h;
    ASSERT_TRUE(CastBuffer(DType::kF8E4M3, &v, DType::kF16, &h, 1).ok());
    EXPECT_EQ(h, FloatToHalf(Fp8E4M3ToFloat(v)));
  }
}

// Outputs over the streaming-store threshold, from 16-bit and FP8 inputs.
TEST(CastBufferTest, VectorMatchesScalarOnLargeBuffers) {
  constexpr size_t kCount = 5'000'011;
  std::vector<uint16_t> u16(kCount + 1);
  std::vector<uint8_t> u8(kCount + 1);
  std::mt19937 rng(5);
  for (size_t i = 0; i < u16.size(); ++i) {
    u16[i] = static_cast<uint16_t>(i < 65536 ? i : rng());
    u8[i] = static_cast<uint8_t>(i);
  }
  for (const std::string& kernel : VectorKernels()) {
    for (DType from : {DType::kF16, DType::kBF16}) {
      for (DType to : kFloatTypes) {
        if (to == from) continue;
        ExpectSameAsScalar(kernel, from, u16.data() + 1, to, kCount, 2);
      }
    }
    for (DType to : {DType::kF32, DType::kF64}) {
      ExpectSameAsScalar(kernel, DType::kF8E4M3, u8.data() + 1, to, kCount, 4);
      ExpectSameAsScalar(kernel, DType::kF8E5M2, u8.data() + 1, to, kCount, 4);
    }
  }
}

// ~10M random F32 bit patterns, plus every special encoding, through every
// vector family. Large enough to take the streaming-store path.
TEST(CastBufferTest, VectorMatchesScalarOnRandomF32) {
  constexpr size_t kCount = 10'000'019;  // odd, prime
  std::vector<float> src(kCount + 1);
  std::mt19937 rng(20240601);
  for (float& f : src) f = F(rng());
  // Sprinkle specials and values near rounding boundaries.
  const uint32_t specials[] = {0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
                               0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF800001,
                               0x7FFFFFFF, 0x00000001, 0x477FF000, 0x477FEFFF,
                               0x43F00000, 0x43E80000, 0x47700000, 0x3F808000,
                               0x33000000, 0x33000001, 0x387FF000, 0x7F7FFFFF};
  for (size_t i = 0; i < std::size(specials); ++i) {
    src[i * 997 + 3] = F(specials[i]);
  }
  // A dense block of small values around F16/FP8 subnormal ranges.
  std::uniform_real_distribution<float> small(-1e-3f, 1e-3f);
  for (size_t i = 100000; i < 300000; ++i) src[i] = small(rng);
  std::uniform_real_distribution<float> medium(-70000.0f, 70000.0f);
  for (size_t i = 300000; i < 500000; ++i) src[i] = medium(rng);

  for (const std::string& kernel : VectorKernels()) {
    for (DType to : kFloatTypes) {
      if (to == DType::kF32) continue;
      // Misaligned by one element on the source and one element (or one
      // byte) on the destination.
      ExpectSameAsScalar(kernel, DType::kF32, src.data() + 1, to, kCount,
                         DTypeSize(to));
    }
    // Byte-misaligned source and destination (alignment is not required).
    const void* odd_src = reinterpret_cast<const char*>(src.data()) + 1;
    for (DType to : {DType::kBF16, DType::kF16, DType::kF64}) {
      ExpectSameAsScalar(kernel, DType::kF32, odd_src, to, kCount - 1, 1);
    }
    // A short odd length for the tails.
    for (size_t n : {1, 7, 15, 17, 31, 33, 63, 65}) {
      ExpectSameAsScalar(kernel, DType::kF32, src.data() + 3, DType::kBF16, n,
                         2);
      ExpectSameAsScalar(kernel, DType::kF32, src.data() + 3, DType::kF16, n,
                         2);
      ExpectSameAsScalar(kernel, DType::kF32, src.data() + 3, DType::kF8E4M3, n,
                         1);
    }
  }
}

TEST(CastBufferTest, ScalarMatchesIndependentHalfReference) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = F(rng());
    const uint16_t want = RefFloatToHalf(f);
    ASSERT_EQ(FloatToHalf(f), want) << absl::StrFormat("0x%08x", Bits(f));
  }
  // Every F32 in [2^-26, 2^17) with the low 12 mantissa bits stepped through
  // rounding-relevant values.
  for (uint32_t hi = 0x32800000 >> 12; hi < (0x48000000u >> 12); ++hi) {
    for (uint32_t lo : {0x000u, 0x001u, 0xFFFu, 0x800u, 0x7FFu}) {
      const float f = F((hi << 12) | lo);
      ASSERT_EQ(FloatToHalf(f), RefFloatToHalf(f))
          << absl::StrFormat("0x%08x", Bits(f));
    }
  }
}

TEST(CastBufferTest, VectorMatchesScalarOnRandomF64) {
  constexpr size_t kCount = 2'500'003;  // > 8 MiB of F32 out: streams
  std::vector<double> src(kCount);
  std::mt19937_64 rng(99);
  for (size_t i = 0; i < kCount; ++i) {
    // Half raw bit patterns, half values in the F16 range.
    src[i] = (i & 1) ? std::bit_cast<double>(rng())
                     : std::ldexp(static_cast<double>(rng() >> 11),
                                  static_cast<int>(rng() % 60) - 90);
  }
  for (const std::string& kernel : VectorKernels()) {
    for (DType to : kFloatTypes) {
      if (to == DType::kF64) continue;
      ExpectSameAsScalar(kernel, DType::kF64, src.data(), to, kCount, 0);
    }
  }
  // Scalar F64 -> F16 is F64 -> F32 -> F16.
  std::vector<uint16_t> out(kCount);
  ASSERT_TRUE(
      CastBufferScalar(DType::kF64, src.data(), DType::kF16, out.data(), kCount)
          .ok());
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(out[i], FloatToHalf(static_cast<float>(src[i]))) << i;
  }
}

}  // namespace
}  // namespace weightd
