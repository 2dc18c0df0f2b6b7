// CPU/GPU parity of the element functions must not depend on -march: the
// same source built with -mavx2 -mfma (where GCC would contract a multiply
// and an add into an FMA, were it not for -ffp-contract=off) gives the same
// bits as the build's own flags (fp_contract_probe.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "server/kernels/fp_contract_probe.h"

namespace weightd {
namespace {

bool CpuRunsTheFmaBuild() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#define WD_NEED_FMA_BUILD()                                                              \
  do {                                                                                   \
    if (!CpuRunsTheFmaBuild()) {                                                         \
      GTEST_SKIP() << "this CPU lacks AVX2 and FMA (or is not x86): the -mavx2 -mfma "   \
                      "build of the element functions cannot run here";                 \
    }                                                                                    \
  } while (0)

uint32_t Bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// Merges of weights-like values (and a spread of magnitudes) by a rank-16
// LoRA term then an added dense term: the low-rank sum is explicit FMAs,
// acc + sum * s and acc + v * s are where contraction would creep in.
TEST(FpContractTest, MergeElementMatchesTheFmaBuildBitForBit) {
  WD_NEED_FMA_BUILD();
  constexpr int64_t kRows = 512, kCols = 1024, kRank = 16;
  constexpr size_t n = kRows * kCols;
  std::mt19937 rng(7);
  std::normal_distribution<float> weights(0.0f, 0.05f);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  std::vector<float> acc(n), v(n), x(kRows * kRank), y(kRank * kCols);
  for (size_t i = 0; i < n; ++i) {
    acc[i] = i % 4 == 3 ? std::ldexp(weights(rng), static_cast<int>(exponent(rng))) : weights(rng);
    v[i] = weights(rng);
  }
  for (float& f : x) f = weights(rng);
  for (float& f : y) f = weights(rng);
  MergeTerm low;
  low.kind = MergeTerm::kLowRank;
  low.s = 0.7f;
  low.rank = kRank;
  low.x = x.data();
  low.y = y.data();
  low.x_r = kRank;
  low.x_k = 1;
  low.y_k = kCols;
  low.y_c = 1;
  MergeTerm add;
  add.kind = MergeTerm::kAdd;
  add.s = 0.3f;
  add.v = v.data();
  const MergeTerm terms[] = {low, add};
  for (int n_terms : {1, 2}) {
    const MergeTerm* first = n_terms == 1 ? &add : terms;
    std::vector<float> base(n), fma(n);
    wd_probe_baseline_merge(acc.data(), first, n_terms, kCols, n, base.data());
    wd_probe_fma_merge(acc.data(), first, n_terms, kCols, n, fma.data());
    size_t differ = 0, first_differ = n;
    for (size_t i = 0; i < n; ++i) {
      if (Bits(base[i]) != Bits(fma[i])) {
        if (differ++ == 0) first_differ = i;
      }
    }
    EXPECT_EQ(differ, 0u) << n_terms << " term(s): " << differ << " of " << n
                          << " elements differ, first at " << first_differ << ": "
                          << (differ > 0 ? base[first_differ] : 0.0f) << " vs "
                          << (differ > 0 ? fma[first_differ] : 0.0f);
  }
}

// Every narrowing cast over a sweep of float bit patterns (one in 257,
// covering every exponent, both signs, NaN and infinity).
TEST(FpContractTest, CastElementsMatchTheFmaBuildBitForBit) {
  WD_NEED_FMA_BUILD();
  std::vector<float> in;
  for (uint64_t w = 0; w <= 0xFFFFFFFFu; w += 257) {
    const uint32_t bits = static_cast<uint32_t>(w);
    float f;
    std::memcpy(&f, &bits, 4);
    in.push_back(f);
  }
  const size_t n = in.size();
  std::vector<uint16_t> base(3 * n), fma(3 * n);
  wd_probe_baseline_cast(in.data(), n, base.data());
  wd_probe_fma_cast(in.data(), n, fma.data());
  size_t differ = 0;
  for (size_t i = 0; i < 3 * n; ++i) differ += base[i] != fma[i];
  EXPECT_EQ(differ, 0u);
}

}  // namespace
}  // namespace weightd
