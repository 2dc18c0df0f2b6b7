// CastBufferCuda against the CPU's CastBufferScalar, and MergeBufferCuda
// against its host twin, bit for bit. Casts: NaN
// payloads included: every 16-bit pattern of F16 and
// BF16, every FP8 pattern, and F32/F64 specials plus a million random
// patterns, to every floating dtype. Needs a device: GTEST_SKIP otherwise
// (CTest label "gpu").
#include "server/kernels/cuda/cuda_cast.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "server/kernels/cast.h"
#include "server/kernels/merge.h"

namespace weightd {
namespace {

constexpr DType kFloats[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16,
                             DType::kF8E4M3, DType::kF8E5M2};

std::string NoDeviceReason() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(err);
  if (n == 0) return "no CUDA device";
  return "";
}

// Inputs of dtype `t`: every pattern of 8- and 16-bit types; specials and
// random bit patterns of F32 and F64.
std::vector<uint8_t> Inputs(DType t) {
  const size_t size = DTypeSize(t);
  std::vector<uint8_t> out;
  if (size <= 2) {
    const uint32_t n = 1u << (8 * size);
    out.resize(n * size);
    for (uint32_t i = 0; i < n; ++i) std::memcpy(out.data() + i * size, &i, size);
    return out;
  }
  std::mt19937_64 rng(42);
  constexpr size_t kRandom = 1 << 20;
  if (t == DType::kF32) {
    std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f,
                            65504.0f, 65520.0f, 3.4e38f, 448.0f, 480.0f, 57344.0f, 1.0f + 0x1p-11f};
    for (size_t i = 0; i < kRandom; ++i) {
      uint32_t w = static_cast<uint32_t>(rng());
      float f;
      std::memcpy(&f, &w, 4);
      v.push_back(f);
    }
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  std::vector<double> v = {0.0, -0.0, INFINITY, -INFINITY, NAN, 1.0 + 0x1p-11 + 0x1p-40, 1e-320,
                           3.5e38, 65519.99};
  for (size_t i = 0; i < kRandom; ++i) {
    uint64_t w = rng();
    double d;
    std::memcpy(&d, &w, 8);
    v.push_back(d);
  }
  out.resize(v.size() * 8);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST(CudaCastTest, EveryFloatPairMatchesTheCpuBitForBit) {
  if (std::string why = NoDeviceReason(); !why.empty()) GTEST_SKIP() << why;
  for (DType src : kFloats) {
    std::vector<uint8_t> in = Inputs(src);
    const size_t count = in.size() / DTypeSize(src);
    void* d_in = nullptr;
    ASSERT_EQ(cudaMalloc(&d_in, in.size()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_in, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
    for (DType dst : kFloats) {
      const size_t out_bytes = count * DTypeSize(dst);
      std::vector<uint8_t> want(out_bytes), got(out_bytes);
      ASSERT_TRUE(CastBufferScalar(src, in.data(), dst, want.data(), count).ok());
      void* d_out = nullptr;
      ASSERT_EQ(cudaMalloc(&d_out, out_bytes), cudaSuccess);
      absl::Status s = CastBufferCuda(src, d_in, dst, d_out, count, nullptr);
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_EQ(cudaMemcpy(got.data(), d_out, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      cudaFree(d_out);
      size_t diffs = 0;
      const size_t e = DTypeSize(dst);
      for (size_t i = 0; i < count; ++i) {
        const uint8_t* w = want.data() + i * e;
        const uint8_t* g = got.data() + i * e;
        // Bits, NaN payloads included: the same tensor must have the same
        // digest whichever path cast it (cast_elements.h builds NaNs as
        // x86 does on both).
        if (std::memcmp(w, g, e) == 0) continue;
        if (++diffs <= 3) {
          ADD_FAILURE() << DTypeName(src) << " -> " << DTypeName(dst) << " element " << i;
        }
      }
      EXPECT_EQ(diffs, 0u) << DTypeName(src) << " -> " << DTypeName(dst);
    }
    cudaFree(d_in);
  }
}

// MergeBufferCuda against MergeBufferHost (the host twin), bit for bit:
// a low-rank term (plain and transposed strides), a dense add, set and
// copy, on a row range of a [rows, cols] parameter, BF16 and F32 in, BF16,
// F16 and F32 out, from an element offset mid-row.
TEST(CudaCastTest, MergeMatchesTheHostTwinBitForBit) {
  if (std::string why = NoDeviceReason(); !why.empty()) GTEST_SKIP() << why;
  constexpr int64_t kRows = 37, kCols = 300, kRank = 16, kRow0 = 5, kFirst = 123;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.2f);
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  };
  std::vector<float> a = random(kRank * kCols), b = random(kRows * kRank);
  std::vector<float> at = random(kRank * kRows), bt = random(kCols * kRank);
  std::vector<float> v = random(kRows * kCols);
  std::vector<MergeTerm> host(5);
  host[0].kind = MergeTerm::kLowRank;  // B [rows, r] @ A [r, cols]
  host[0].s = 0.37f;
  host[0].rank = kRank;
  host[0].x = b.data(), host[0].x_r = kRank, host[0].x_k = 1, host[0].x_len = b.size();
  host[0].y = a.data(), host[0].y_k = kCols, host[0].y_c = 1, host[0].y_len = a.size();
  host[1].kind = MergeTerm::kLowRank;  // transposed: A [r, rows] and B [cols, r]
  host[1].s = -1.5f;
  host[1].rank = kRank;
  host[1].x = at.data(), host[1].x_r = 1, host[1].x_k = kRows, host[1].x_len = at.size();
  host[1].y = bt.data(), host[1].y_k = 1, host[1].y_c = kRank, host[1].y_len = bt.size();
  for (int i = 2; i < 5; ++i) {
    host[i].kind = i == 2 ? MergeTerm::kAdd : i == 3 ? MergeTerm::kSet : MergeTerm::kCopy;
    host[i].s = 0.5f;
    host[i].v = v.data() + kRow0 * kCols;  // narrowed to the row range
    host[i].v_row0 = kRow0;
    host[i].v_len = (kRows - kRow0) * kCols;
  }
  // The same terms with device copies of their arrays.
  std::vector<void*> owned;
  auto upload = [&](const float* p, uint64_t n) -> const float* {
    if (p == nullptr) return nullptr;
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, n * 4), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, p, n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    owned.push_back(d);
    return static_cast<const float*>(d);
  };
  std::vector<MergeTerm> dev = host;
  for (MergeTerm& t : dev) {
    t.x = upload(t.x, t.x_len);
    t.y = upload(t.y, t.y_len);
    t.v = upload(t.v, t.v_len);
  }
  const size_t count = (kRows - kRow0) * kCols - kFirst;
  std::vector<float> w = random(kRows * kCols);
  for (size_t terms : {size_t{1}, size_t{2}, size_t{3}, size_t{5}}) {
    void* d_terms = nullptr;
    ASSERT_EQ(cudaMalloc(&d_terms, terms * sizeof(MergeTerm)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_terms, dev.data(), terms * sizeof(MergeTerm), cudaMemcpyHostToDevice),
              cudaSuccess);
    for (DType src : {DType::kBF16, DType::kF32}) {
      std::vector<uint8_t> in(count * DTypeSize(src));
      ASSERT_TRUE(CastBuffer(DType::kF32, w.data() + kRow0 * kCols + kFirst, src, in.data(),
                             count)
                      .ok());
      void* d_in = nullptr;
      ASSERT_EQ(cudaMalloc(&d_in, in.size()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_in, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
      for (DType dst : {DType::kBF16, DType::kF16, DType::kF32}) {
        std::vector<uint8_t> want(count * DTypeSize(dst)), got(want.size());
        ASSERT_TRUE(MergeBufferHost(src, in.data(), dst, want.data(), count, kFirst, kRow0, kCols,
                                    absl::MakeConstSpan(host.data(), terms))
                        .ok());
        void* d_out = nullptr;
        ASSERT_EQ(cudaMalloc(&d_out, want.size()), cudaSuccess);
        absl::Status s = MergeBufferCuda(src, d_in, dst, d_out, count, kFirst, kRow0, kCols,
                                         static_cast<const MergeTerm*>(d_terms),
                                         static_cast<int>(terms), nullptr);
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(cudaMemcpy(got.data(), d_out, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(d_out);
        EXPECT_TRUE(got == want) << terms << " terms, " << DTypeName(src) << " -> "
                                 << DTypeName(dst);
      }
      cudaFree(d_in);
    }
    cudaFree(d_terms);
  }
  for (void* p : owned) cudaFree(p);
}

TEST(CudaCastTest, RefusesIntegerConversionsWithoutADevice) {
  // Checked before any CUDA call: runs on every machine.
  absl::Status s = CastBufferCuda(DType::kI64, nullptr, DType::kF32, nullptr, 4, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CastBufferCuda(DType::kF32, nullptr, DType::kF16, nullptr, 0, nullptr).ok());
  s = MergeBufferCuda(DType::kI32, nullptr, DType::kF32, nullptr, 4, 0, 0, 1, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = MergeBufferCuda(DType::kF32, nullptr, DType::kF32, nullptr, 4, 0, 0, 0, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightd
