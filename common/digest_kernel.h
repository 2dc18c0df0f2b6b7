// XXH3-128 compiled once per instruction set (digest_baseline.c,
// digest_avx2.c, digest_avx512.c), chosen at run time by digest.cc. Every
// variant computes the same XXH3-128 (the algorithm does not depend on the
// vector width); only the speed differs. C, so the -mavx2 / -mavx512f
// units share no inline C++ function with the rest of the program.
#ifndef WEIGHTD_COMMON_DIGEST_KERNEL_H_
#define WEIGHTD_COMMON_DIGEST_KERNEL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  uint64_t low64;
  uint64_t high64;
} WdHash128;

typedef struct WdDigestKernel {
  const char* name;
  WdHash128 (*hash)(const void* data, size_t size);
  void* (*new_state)(void);  // reset, ready for updates; null when out of memory
  void (*update)(void* state, const void* data, size_t size);
  WdHash128 (*finish)(const void* state);  // the state may take more updates
  void (*free_state)(void* state);
} WdDigestKernel;

const WdDigestKernel* wd_digest_kernel_baseline(void);
const WdDigestKernel* wd_digest_kernel_avx2(void);
const WdDigestKernel* wd_digest_kernel_avx512(void);

#ifdef __cplusplus
}

#include <vector>

#include "common/digest.h"

namespace weightd {
// A kernel's hash as a Digest (XXH3-128's canonical, big-endian bytes).
Digest DigestFromHash(WdHash128 hash);
// The variants this CPU runs, narrowest first (baseline is always there).
std::vector<const WdDigestKernel*> UsableDigestKernels();
// The one DigestBytes and DigestBuilder use: AVX2 where the CPU has it,
// else the baseline, or the usable one WEIGHTD_DIGEST_KERNEL=
// baseline|avx2|avx512 names (AVX-512 only then: slower on the machines
// measured).
const WdDigestKernel& ActiveDigestKernel();
}  // namespace weightd
#endif

#endif  // WEIGHTD_COMMON_DIGEST_KERNEL_H_
