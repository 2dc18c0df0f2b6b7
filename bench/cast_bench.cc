// CastBuffer throughput on 64 MiB source buffers (well past the LLC), against
// a memcpy of the same source size. Bytes/s counts bytes read + written.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "server/kernels/cast.h"
#include "common/dtype.h"
#include "server/kernels/merge.h"

namespace weightd {
namespace cast_internal {
// Defined in cast.cc: runs one named kernel family.
absl::Status CastBufferWithKernel(absl::string_view kernel, DType src_dtype,
                                  const void* src, DType dst_dtype, void* dst,
                                  size_t count);
}  // namespace cast_internal

namespace {

constexpr size_t kSrcBytes = size_t{64} << 20;

// A source buffer of `dtype` holding values typical of weights.
std::vector<uint8_t> MakeSource(DType dtype) {
  const size_t count = kSrcBytes / DTypeSize(dtype);
  std::vector<float> f(count);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (float& v : f) v = dist(rng);
  std::vector<uint8_t> out(kSrcBytes);
  if (!CastBufferScalar(DType::kF32, f.data(), dtype, out.data(), count).ok()) {
    std::abort();
  }
  return out;
}

void BM_Cast(benchmark::State& state, DType from, DType to,
             const char* kernel) {
  const size_t count = kSrcBytes / DTypeSize(from);
  const std::vector<uint8_t> src = MakeSource(from);
  std::vector<uint8_t> dst(count * DTypeSize(to), 1);  // pre-faulted
  for (auto _ : state) {
    absl::Status s = kernel == nullptr
                         ? CastBuffer(from, src.data(), to, dst.data(), count)
                         : cast_internal::CastBufferWithKernel(
                               kernel, from, src.data(), to, dst.data(), count);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(src.size() + dst.size()));
  state.SetLabel(std::string(kernel == nullptr ? CastKernelName() : kernel));
}

void BM_Memcpy(benchmark::State& state) {
  std::vector<uint8_t> src(kSrcBytes, 3);
  std::vector<uint8_t> dst(kSrcBytes, 1);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kSrcBytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(2 * kSrcBytes));
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

#define WD_CAST_BENCH(name, from, to, kernel)                      \
  BENCHMARK_CAPTURE(BM_Cast, name, DType::from, DType::to, kernel) \
      ->Unit(benchmark::kMillisecond)                              \
      ->UseRealTime()

WD_CAST_BENCH(F32_to_BF16, kF32, kBF16, nullptr);
WD_CAST_BENCH(BF16_to_F32, kBF16, kF32, nullptr);
WD_CAST_BENCH(F32_to_F16, kF32, kF16, nullptr);
WD_CAST_BENCH(F16_to_F32, kF16, kF32, nullptr);
WD_CAST_BENCH(BF16_to_F16, kBF16, kF16, nullptr);
WD_CAST_BENCH(F32_to_F8_E4M3, kF32, kF8E4M3, nullptr);
// The portable kernels, for scale.
WD_CAST_BENCH(F32_to_BF16_scalar, kF32, kBF16, "scalar");
WD_CAST_BENCH(F32_to_F16_scalar, kF32, kF16, "scalar");

#undef WD_CAST_BENCH

// MergeBufferHost (the host twin of a push's merge, merge_elements.h): a
// BF16 parameter of 4096 columns with a rank-16 LoRA term and an added
// dense term, written as BF16. Bytes/s counts bytes read + written.
void BM_MergeBf16LowRank16(benchmark::State& state) {
  constexpr int64_t kCols = 4096, kRank = 16;
  const size_t count = kSrcBytes / 2;
  const int64_t rows = static_cast<int64_t>(count) / kCols;
  const std::vector<uint8_t> src = MakeSource(DType::kBF16);
  std::vector<uint8_t> dst(src.size(), 1);
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> x(static_cast<size_t>(rows * kRank)), y(static_cast<size_t>(kRank * kCols));
  std::vector<float> v(count);
  for (float& f : x) f = dist(rng);
  for (float& f : y) f = dist(rng);
  for (float& f : v) f = dist(rng);
  MergeTerm low;
  low.kind = MergeTerm::kLowRank;
  low.s = 0.5f;
  low.rank = kRank;
  low.x = x.data();
  low.y = y.data();
  low.x_r = kRank;
  low.x_k = 1;
  low.y_k = kCols;
  low.y_c = 1;
  MergeTerm add;
  add.kind = MergeTerm::kAdd;
  add.s = 0.25f;
  add.v = v.data();
  const MergeTerm terms[] = {low, add};
  for (auto _ : state) {
    absl::Status s = MergeBufferHost(DType::kBF16, src.data(), DType::kBF16, dst.data(), count,
                                     0, 0, kCols, terms);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(src.size() + dst.size()));
}

BENCHMARK(BM_MergeBf16LowRank16)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace weightd

BENCHMARK_MAIN();
