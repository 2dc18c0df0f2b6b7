// Digest throughput: XXH3-128 with every variant this CPU runs
// (common/digest_kernel.h) and with the system's libxxhash, over 256 MiB of
// resident memory (well past the LLC), against a memcpy of the same bytes
// in the same run. Bytes/s counts the bytes digested (memcpy: copied).
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/digest_kernel.h"

namespace weightd {
namespace {

constexpr size_t kBytes = size_t{256} << 20;

const std::vector<uint8_t>& Source() {
  static const std::vector<uint8_t> v = [] {
    std::vector<uint8_t> out(kBytes);
    std::mt19937_64 rng(1);
    for (size_t i = 0; i < kBytes; i += 8) {
      const uint64_t r = rng();
      std::memcpy(out.data() + i, &r, 8);
    }
    return out;
  }();
  return v;
}

void BM_Kernel(benchmark::State& state, const char* name) {
  const WdDigestKernel* kernel = nullptr;
  for (const WdDigestKernel* k : UsableDigestKernels()) {
    if (std::strcmp(k->name, name) == 0) kernel = k;
  }
  if (kernel == nullptr) {
    state.SkipWithError("this CPU does not run it");
    return;
  }
  const std::vector<uint8_t>& src = Source();
  for (auto _ : state) benchmark::DoNotOptimize(kernel->hash(src.data(), src.size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void BM_Libxxhash(benchmark::State& state) {
  const std::vector<uint8_t>& src = Source();
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_128bits(src.data(), src.size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void BM_Memcpy(benchmark::State& state) {
  const std::vector<uint8_t>& src = Source();
  std::vector<uint8_t> dst(kBytes, 1);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Libxxhash)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Kernel, baseline, "baseline")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Kernel, avx2, "avx2")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Kernel, avx512, "avx512")->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace weightd

BENCHMARK_MAIN();
