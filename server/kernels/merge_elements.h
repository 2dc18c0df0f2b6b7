// Adapter merges computed element by element, written once for the CPU and
// the GPU (like cast_elements.h): a push that merges as it writes
// (FetchRequest.defer_merges) runs MergeElement in a CUDA kernel
// (server/kernels/cuda/cuda_cast.h MergeBufferCuda) or, in its host twin, in
// MergeBufferHost below — the same arithmetic, tested here.
//
// The numerics are docs/DESIGN.md §2.5's, in the order of the CPU's fused LoRA kernel
// (server/adapter/lora_patch.cc): acc = fp32(W); per term, in order,
//   low rank  acc = fl(acc + fl(fl(Σ_k X[r][k]·Y[k][c]) · s)), the sum k
//             ascending from 0 with one FMA per term;
//   add       acc = fl(acc + fl(V[r][c] · s));
//   set       acc = fl(V[r][c] · s);
//   copy      acc = V[r][c];
// then one rounding to the output dtype. `r` and `c` index the parameter
// viewed as 2-D [rows, cols] (cols = numel / shape[0]). Only the low-rank
// sum's FMAs are fused (elements::Fma, explicitly); every other multiply and
// add is rounded on its own, which holds on the CPU only because our
// targets build with -ffp-contract=off (see cast_elements.h).
#ifndef WEIGHTD_SERVER_KERNELS_MERGE_ELEMENTS_H_
#define WEIGHTD_SERVER_KERNELS_MERGE_ELEMENTS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "server/kernels/cast_elements.h"

namespace weightd {

// One patch of a parameter as a per-element term. The arrays are fp32,
// host or device memory (whoever runs the kernel), and outlive its use.
struct MergeTerm {
  enum Kind : int32_t { kLowRank = 0, kAdd = 1, kSet = 2, kCopy = 3 };
  int32_t kind = kAdd;
  float s = 1.0f;  // the effective scale, fp32(strength · scale)
  // kLowRank: ΔW[r][c] = Σ_k x[r·x_r + k·x_k] · y[k·y_k + c·y_c].
  int64_t rank = 0;
  const float* x = nullptr;
  const float* y = nullptr;
  int64_t x_r = 0, x_k = 0, y_k = 0, y_c = 0;
  uint64_t x_len = 0, y_len = 0;  // floats, for a copy to another memory
  // kAdd, kSet, kCopy: V[r][c] = v[(r - v_row0)·cols + c].
  const float* v = nullptr;
  int64_t v_row0 = 0;
  uint64_t v_len = 0;
};

namespace elements {

WD_HOST_DEVICE inline float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

}  // namespace elements

// acc (fp32 of the base element [r][c]) with `terms` applied in order.
WD_HOST_DEVICE inline float MergeElement(float acc, const MergeTerm* terms, int n_terms,
                                         int64_t r, int64_t c, int64_t cols) {
  for (int t = 0; t < n_terms; ++t) {
    const MergeTerm& m = terms[t];
    if (m.kind == MergeTerm::kLowRank) {
      float sum = 0.0f;
      for (int64_t k = 0; k < m.rank; ++k) {
        sum = elements::Fma(m.x[r * m.x_r + k * m.x_k], m.y[k * m.y_k + c * m.y_c], sum);
      }
      acc = elements::Add(acc, elements::Mul(sum, m.s));
      continue;
    }
    const float v = m.v[(r - m.v_row0) * cols + c];
    switch (m.kind) {
      case MergeTerm::kAdd: acc = elements::Add(acc, elements::Mul(v, m.s)); break;
      case MergeTerm::kSet: acc = elements::Mul(v, m.s); break;
      default: acc = v; break;
    }
  }
  return acc;
}

}  // namespace weightd

#endif  // WEIGHTD_SERVER_KERNELS_MERGE_ELEMENTS_H_
