// Every XXH3 variant this CPU runs (digest_kernel.h) against the system's
// libxxhash, the independent reference: one-shot and incremental, over every
// length up to 2 KiB (XXH3's short-input paths, its stripes and its 1 KiB
// blocks), lengths around block and buffer boundaries, unaligned starts, and
// a few MiB of random bytes cut into random pieces.
#include "common/digest.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/digest_kernel.h"

namespace weightd {
namespace {

Digest Reference(const void* data, size_t size) {
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, XXH3_128bits(data, size));
  Digest d;
  std::memcpy(d.bytes.data(), canon.digest, 16);
  return d;
}

Digest Of(WdHash128 h) { return DigestFromHash(h); }

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST(DigestTest, BaselineIsAlwaysUsableAndTheActiveKernelIsOneOfThem) {
  const std::vector<const WdDigestKernel*> usable = UsableDigestKernels();
  ASSERT_FALSE(usable.empty());
  EXPECT_STREQ(usable.front()->name, "baseline");
  bool found = false;
  for (const WdDigestKernel* k : usable) found |= k == &ActiveDigestKernel();
  EXPECT_TRUE(found) << ActiveDigestKernel().name;
  std::string names;
  for (const WdDigestKernel* k : usable) names += std::string(k->name) + " ";
  RecordProperty("digest_kernels", names);
}

TEST(DigestTest, EveryKernelEqualsLibxxhashOnEveryShortLengthAndAlignment) {
  const std::vector<uint8_t> bytes = RandomBytes(2048 + 64, 1);
  for (const WdDigestKernel* k : UsableDigestKernels()) {
    SCOPED_TRACE(k->name);
    for (size_t align : {0, 1, 7, 33}) {
      for (size_t n = 0; n <= 2048; ++n) {
        const uint8_t* p = bytes.data() + align;
        ASSERT_EQ(Of(k->hash(p, n)), Reference(p, n)) << "length " << n << " at +" << align;
      }
    }
  }
}

TEST(DigestTest, EveryKernelEqualsLibxxhashOnLongInputsAndIncrementally) {
  const std::vector<uint8_t> bytes = RandomBytes((3 << 20) + 100, 2);
  // Around XXH3's 1 KiB blocks and its 256-byte incremental buffer.
  std::vector<size_t> lengths = {1023, 1024, 1025, 4095, 4096, 4097, 65536 + 17, 1 << 20,
                                 (3 << 20) + 99};
  std::mt19937_64 rng(3);
  for (const WdDigestKernel* k : UsableDigestKernels()) {
    SCOPED_TRACE(k->name);
    for (size_t n : lengths) {
      const Digest want = Reference(bytes.data() + 1, n);
      ASSERT_EQ(Of(k->hash(bytes.data() + 1, n)), want) << "length " << n;
      // Incremental, cut into random pieces (1 byte to 70 KiB).
      void* state = k->new_state();
      ASSERT_NE(state, nullptr);
      size_t at = 0;
      while (at < n) {
        size_t piece = std::min<size_t>(n - at, 1 + rng() % (rng() % 2 ? 300 : 70000));
        k->update(state, bytes.data() + 1 + at, piece);
        at += piece;
      }
      EXPECT_EQ(Of(k->finish(state)), want) << "incremental, length " << n;
      k->free_state(state);
    }
  }
}

TEST(DigestTest, DigestBytesAndDigestBuilderUseTheActiveKernelAndAgree) {
  const std::vector<uint8_t> bytes = RandomBytes(100000, 4);
  const Digest want = Reference(bytes.data(), bytes.size());
  EXPECT_EQ(DigestBytes(bytes.data(), bytes.size()), want);
  DigestBuilder b;
  b.Update(bytes.data(), 12345);
  b.Update(bytes.data() + 12345, bytes.size() - 12345);
  EXPECT_EQ(b.Finish(), want);
  EXPECT_EQ(DigestBytes(nullptr, 0), Reference(nullptr, 0));
}

#if defined(__x86_64__)
// XINUSE (XGETBV with ECX=1): which register state components are not in
// their initial state. Bit 2: the upper halves of YMM0-15; bit 6: the upper
// halves of ZMM0-15. nullopt where the CPU cannot say.
std::optional<uint64_t> RegisterStateInUse() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(0xd, 1, &a, &b, &c, &d) == 0 || (a & (1u << 2)) == 0) {
    return std::nullopt;
  }
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return (uint64_t{hi} << 32) | lo;
}

TEST(DigestTest, EveryKernelLeavesTheUpperRegisterHalvesClean) {
  // Left dirty, they make every later legacy-SSE instruction of the process
  // pay a transition penalty (libxxhash's SSE2 XXH3 ran 4x slower after one
  // AVX2 digest before the kernels ended with VZEROUPPER).
  if (!RegisterStateInUse().has_value()) GTEST_SKIP() << "no XGETBV(1) on this CPU";
  const std::vector<uint8_t> bytes = RandomBytes(1 << 20, 5);
  for (const WdDigestKernel* k : UsableDigestKernels()) {
    SCOPED_TRACE(k->name);
    (void)k->hash(bytes.data(), bytes.size());
    uint64_t in_use = *RegisterStateInUse();
    EXPECT_EQ(in_use & 0x44, 0u) << "after hash: XINUSE " << std::hex << in_use;
    void* state = k->new_state();
    in_use = *RegisterStateInUse();
    EXPECT_EQ(in_use & 0x44, 0u) << "after new_state: XINUSE " << std::hex << in_use;
    k->update(state, bytes.data(), bytes.size());
    in_use = *RegisterStateInUse();
    EXPECT_EQ(in_use & 0x44, 0u) << "after update: XINUSE " << std::hex << in_use;
    (void)k->finish(state);
    in_use = *RegisterStateInUse();
    EXPECT_EQ(in_use & 0x44, 0u) << "after finish: XINUSE " << std::hex << in_use;
    k->free_state(state);
  }
}
#endif

}  // namespace
}  // namespace weightd
