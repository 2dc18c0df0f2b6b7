// The element functions (cast_elements.h, merge_elements.h) compiled into
// two shared libraries from one source, fp_contract_probe.cc: one with the
// build's flags, one with -mavx2 -mfma added (an ISA where GCC contracts a
// multiply and an add into an FMA unless -ffp-contract=off says not to).
// fp_contract_test runs both over the same inputs and compares bit for bit:
// CPU/GPU parity must not depend on -march. Each library keeps its inline
// functions to itself (hidden visibility), so neither calls the other's.
#ifndef WEIGHTD_SERVER_KERNELS_FP_CONTRACT_PROBE_H_
#define WEIGHTD_SERVER_KERNELS_FP_CONTRACT_PROBE_H_

#include <cstddef>
#include <cstdint>

#include "server/kernels/merge_elements.h"

extern "C" {
// out[i] = MergeElement(acc[i], terms, n_terms, i / cols, i % cols, cols).
void wd_probe_baseline_merge(const float* acc, const weightd::MergeTerm* terms, int n_terms,
                             int64_t cols, size_t n, float* out);
void wd_probe_fma_merge(const float* acc, const weightd::MergeTerm* terms, int n_terms,
                        int64_t cols, size_t n, float* out);
// out[i] = FloatToHalf(in[i]), out[n + i] = FloatToBFloat16(in[i]),
// out[2n + i] = FloatToFp8E4M3 / FloatToFp8E5M2 (low and high byte).
void wd_probe_baseline_cast(const float* in, size_t n, uint16_t* out);
void wd_probe_fma_cast(const float* in, size_t n, uint16_t* out);
}

#endif  // WEIGHTD_SERVER_KERNELS_FP_CONTRACT_PROBE_H_
