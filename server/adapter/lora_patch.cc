#include "server/adapter/lora_patch.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// Floats of scratch per GEMM block (1 MiB): large enough that OpenBLAS's
// per-call packing of the narrow factor is amortized, small enough to stay
// near the cache.
constexpr int64_t kScratchFloats = int64_t{1} << 18;

// The served tensor must be the shape the patch expects, and the box must
// lie inside it.
absl::Status CheckBox(const ShardBox& box, absl::Span<const int64_t> global_shape,
                      absl::Span<const int64_t> shape) {
  if (!std::equal(global_shape.begin(), global_shape.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("patch expects a tensor of shape ",
                                                   ShapeString(shape), ", got ",
                                                   ShapeString(global_shape)));
  }
  if (box.offset.size() != shape.size() || box.shape.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("box of rank ", box.shape.size(), " for a tensor of rank ", shape.size()));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (box.offset[d] < 0 || box.shape[d] < 0 || box.offset[d] > shape[d] ||
        box.shape[d] > shape[d] - box.offset[d]) {
      return absl::InvalidArgumentError(absl::StrCat("box offset ", ShapeString(box.offset),
                                                     " shape ", ShapeString(box.shape),
                                                     " is outside tensor ", ShapeString(shape)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFactors(const LowRankFactors& f) {
  if (f.rank < 1 || f.in < 0 || f.out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad LoRA dims rank=", f.rank, " in=", f.in, " out=", f.out));
  }
  if (static_cast<int64_t>(f.a.size()) != f.rank * f.in ||
      static_cast<int64_t>(f.b.size()) != f.out * f.rank) {
    return absl::InvalidArgumentError(absl::StrCat("LoRA factor sizes ", f.a.size(), "/",
                                                   f.b.size(), " do not match rank=", f.rank,
                                                   " in=", f.in, " out=", f.out));
  }
  return absl::OkStatus();
}

std::string ScaleString(double scale) { return absl::StrFormat("%a", scale); }

// C[m, n] (row-major, ldc = n) = op(X) @ op(Y), alpha 1, beta 0.
void Gemm(bool trans_x, bool trans_y, int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx,
          const float* y, int64_t ldy, float* c) {
  cblas_sgemm(CblasRowMajor, trans_x ? CblasTrans : CblasNoTrans,
              trans_y ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(ldx), y,
              static_cast<blasint>(ldy), 0.0f, c, static_cast<blasint>(n));
}

// dst[j] += src[j] * s for j < n: the product rounded, then the sum
// rounded (PEFT's order: (B @ A) * scaling, then the add; never an FMA).
void AddScaledScalar(float* __restrict dst, const float* __restrict src, float s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float delta = src[j] * s;
    dst[j] += delta;
  }
}

__attribute__((target("avx512f"))) void AddScaledAvx512(float* __restrict dst,
                                                        const float* __restrict src, float s,
                                                        int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 delta = _mm512_mul_ps(_mm512_loadu_ps(src + j), vs);
    _mm512_storeu_ps(dst + j, _mm512_add_ps(_mm512_loadu_ps(dst + j), delta));
  }
  AddScaledScalar(dst + j, src + j, s, n - j);
}

__attribute__((target("avx2"))) void AddScaledAvx2(float* __restrict dst,
                                                   const float* __restrict src, float s,
                                                   int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 delta = _mm256_mul_ps(_mm256_loadu_ps(src + j), vs);
    _mm256_storeu_ps(dst + j, _mm256_add_ps(_mm256_loadu_ps(dst + j), delta));
  }
  AddScaledScalar(dst + j, src + j, s, n - j);
}

void AddScaled(float* dst, const float* src, float s, int64_t n) {
  static const auto kernel = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &AddScaledAvx512;
    if (__builtin_cpu_supports("avx2")) return &AddScaledAvx2;
    return &AddScaledScalar;
  }();
  kernel(dst, src, s, n);
}

// acc[i][j] += fl(fl(Σ_k B[i][k] · A[k][j]) · s) for i < m, j < n, with
// B rows of `k` floats and A rows `lda` floats apart: the LoRA update of a
// row-major box fused into one pass over the accumulator. The sum runs k
// ascending with one FMA per term — the order most of OpenBLAS's sgemm
// kernels use, though which kernel runs is OpenBLAS's choice, so the tests
// pin this kernel to a scalar reference of that order and the sgemm path to
// it within the fp32 accumulation bound — but no product matrix is
// written and no scratch zeroed. A block of kRows rows x kVecs vectors of
// columns stays in registers across the k loop (each load of A serves
// kRows rows); the column tail is masked.
template <int kRows, int kVecs>
__attribute__((target("avx512f"))) inline void LowRankRowsAvx512(
    float* acc, int64_t ld_acc, const float* b, int64_t k, const float* a, int64_t lda,
    int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t j = 0; j < n; j += 16 * kVecs) {
    __mmask16 mask[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      const int64_t left = n - j - 16 * v;
      mask[v] = left >= 16 ? __mmask16(0xFFFF)
                           : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    __m512 sum[kRows][kVecs];  // registers once the loops unroll
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) sum[r][v] = _mm512_setzero_ps();
    }
    for (int64_t q = 0; q < k; ++q) {
      __m512 av[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) av[v] = _mm512_maskz_loadu_ps(mask[v], a + q * lda + j + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512 bb = _mm512_set1_ps(b[r * k + q]);
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) sum[r][v] = _mm512_fmadd_ps(bb, av[v], sum[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        float* p = acc + r * ld_acc + j + 16 * v;
        const __m512 delta = _mm512_mul_ps(sum[r][v], vs);
        _mm512_mask_storeu_ps(p, mask[v], _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], p), delta));
      }
    }
  }
}

__attribute__((target("avx512f"))) void LowRankAddAvx512(float* acc, int64_t m, int64_t n,
                                                         const float* b, int64_t k,
                                                         const float* a, int64_t lda, float s) {
  constexpr int kRows = 4, kVecs = 4;  // 16 accumulators: the best of 2..8 x 2..8 here
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    LowRankRowsAvx512<kRows, kVecs>(acc + i * n, n, b + i * k, k, a, lda, n, s);
  }
  for (; i < m; ++i) LowRankRowsAvx512<1, kVecs>(acc + i * n, n, b + i * k, k, a, lda, n, s);
}

bool HaveAvx512() {
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return have;
}

// Per-thread GEMM output scratch, reused across calls: a fresh 1 MiB
// vector per call costs an mmap, page faults and a memset each time.
float* GemmScratch(size_t floats) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < floats) scratch.resize(floats);
  return scratch.data();
}

}  // namespace

float EffectiveScale(float strength, double scale) {
  return static_cast<float>(static_cast<double>(strength) * scale);
}

void SetGemmThreads(int threads) { openblas_set_num_threads(std::max(1, threads)); }

// ---------------------------------------------------------------- LoraPatch

absl::StatusOr<std::shared_ptr<const LoraPatch>> LoraPatch::Create(PatchSource source,
                                                                   LowRankFactors factors,
                                                                   double scale, bool transposed) {
  WD_RETURN_IF_ERROR(CheckFactors(factors));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("LoRA scale ", scale, " is not finite"));
  }
  return std::shared_ptr<const LoraPatch>(
      new LoraPatch(std::move(source), std::move(factors), scale, transposed));
}

std::string LoraPatch::CacheKey() const {
  return absl::StrCat("lora", transposed_ ? "T" : "", "|", source_.adapter_digest.Hex(), "|",
                      source_.target, "|", ScaleString(scale_));
}

std::vector<int64_t> LoraPatch::shape() const {
  if (transposed_) return {f_.in, f_.out};
  return {f_.out, f_.in};
}

uint64_t LoraPatch::bytes() const { return (f_.a.size() + f_.b.size()) * sizeof(float); }

absl::Status LoraPatch::Apply(const ShardBox& box, absl::Span<const int64_t> global_shape,
                              float strength, const BaseRowReader& base, float* acc) const {
  const std::vector<int64_t> want = shape();
  WD_RETURN_IF_ERROR(CheckBox(box, global_shape, want));
  const int64_t r0 = box.offset[0], nr = box.shape[0];
  const int64_t c0 = box.offset[1], nc = box.shape[1];
  if (nr == 0 || nc == 0) return absl::OkStatus();
  const float s = EffectiveScale(strength, scale_);
  const int64_t k = f_.rank;
  if (!transposed_ && HaveAvx512()) {
    // Fused: no product matrix, one pass over the accumulator.
    LowRankAddAvx512(acc, nr, nc, f_.b.data() + r0 * k, k, f_.a.data() + c0, f_.in, s);
    return absl::OkStatus();
  }
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(nr, kScratchFloats / nc));
  float* tmp = GemmScratch(static_cast<size_t>(block * nc));
  for (int64_t i = 0; i < nr; i += block) {
    const int64_t m = std::min(block, nr - i);
    if (!transposed_) {
      // ΔW[r][c] = Σ_k B[r][k] A[k][c]: rows of B, columns of A, no copies.
      Gemm(false, false, m, nc, k, f_.b.data() + (r0 + i) * k, k, f_.a.data() + c0, f_.in,
           tmp);
    } else {
      // ΔW[r][c] = Σ_k A[k][r] B[c][k]: columns of A (rows of ΔW), rows of B.
      Gemm(true, true, m, nc, k, f_.a.data() + (r0 + i), f_.in, f_.b.data() + c0 * k, k,
           tmp);
    }
    AddScaled(acc + i * nc, tmp, s, m * nc);
  }
  return absl::OkStatus();
}

bool LoraPatch::ElementTerm(float strength, MergeTerm* term) const {
  MergeTerm t;
  t.kind = MergeTerm::kLowRank;
  t.s = EffectiveScale(strength, scale_);
  t.rank = f_.rank;
  t.x_len = f_.b.size();
  t.y_len = f_.a.size();
  if (!transposed_) {
    // ΔW[r][c] = Σ_k B[r][k] A[k][c]
    t.x = f_.b.data();
    t.x_r = f_.rank;
    t.x_k = 1;
    t.y = f_.a.data();
    t.y_k = f_.in;
    t.y_c = 1;
  } else {
    // ΔW[r][c] = Σ_k A[k][r] B[c][k]
    t.x = f_.a.data();
    t.x_r = 1;
    t.x_k = f_.in;
    t.y = f_.b.data();
    t.y_k = 1;
    t.y_c = f_.rank;
    t.x_len = f_.a.size();
    t.y_len = f_.b.size();
  }
  *term = t;
  return true;
}

// ---------------------------------------------------------------- DoraPatch

absl::StatusOr<std::shared_ptr<const DoraPatch>> DoraPatch::Create(PatchSource source,
                                                                   LowRankFactors factors,
                                                                   double scale,
                                                                   std::vector<float> magnitude) {
  WD_RETURN_IF_ERROR(CheckFactors(factors));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("DoRA scale ", scale, " is not finite"));
  }
  if (static_cast<int64_t>(magnitude.size()) != factors.out) {
    return absl::InvalidArgumentError(absl::StrCat("DoRA magnitude has ", magnitude.size(),
                                                   " values, the weight has ", factors.out,
                                                   " output rows"));
  }
  return std::shared_ptr<const DoraPatch>(
      new DoraPatch(std::move(source), std::move(factors), scale, std::move(magnitude)));
}

std::string DoraPatch::CacheKey() const {
  return absl::StrCat("dora|", source_.adapter_digest.Hex(), "|", source_.target, "|",
                      ScaleString(scale_));
}

uint64_t DoraPatch::bytes() const {
  return (f_.a.size() + f_.b.size() + magnitude_.size()) * sizeof(float);
}

absl::Status DoraPatch::Apply(const ShardBox& box, absl::Span<const int64_t> global_shape,
                              float strength, const BaseRowReader& base, float* acc) const {
  const std::vector<int64_t> want = shape();
  WD_RETURN_IF_ERROR(CheckBox(box, global_shape, want));
  const int64_t r0 = box.offset[0], nr = box.shape[0];
  const int64_t c0 = box.offset[1], nc = box.shape[1];
  if (nr == 0 || nc == 0) return absl::OkStatus();
  if (!base) {
    return absl::InvalidArgumentError("DoRA patch needs a reader for the base weight");
  }
  const float s = EffectiveScale(strength, scale_);
  const int64_t k = f_.rank, in = f_.in;
  const int64_t block =
      std::max<int64_t>(1, std::min<int64_t>(nr, kScratchFloats / std::max<int64_t>(in, 1)));
  std::vector<float> w(static_cast<size_t>(block * in));
  std::vector<float> d(static_cast<size_t>(block * in));
  for (int64_t i = 0; i < nr; i += block) {
    const int64_t m = std::min(block, nr - i);
    WD_RETURN_IF_ERROR_CTX(base(r0 + i, r0 + i + m, w.data()), "reading base rows ", r0 + i, "..",
                           r0 + i + m, " for DoRA norms");
    // Full rows of B @ A: the norm spans the whole input dim.
    Gemm(false, false, m, in, k, f_.b.data() + (r0 + i) * k, k, f_.a.data(), in, d.data());
    for (int64_t q = 0; q < m; ++q) {
      float* drow = d.data() + q * in;
      const float* wrow = w.data() + q * in;
      double sum_sq = 0.0;
      for (int64_t c = 0; c < in; ++c) {
        const float delta = drow[c] * s;
        drow[c] = delta;
        const float v = wrow[c] + delta;
        sum_sq += static_cast<double>(v) * static_cast<double>(v);
      }
      const float norm = static_cast<float>(std::sqrt(sum_sq));
      const float factor = magnitude_[r0 + i + q] / norm;
      float* dst = acc + (i + q) * nc;
      for (int64_t j = 0; j < nc; ++j) {
        const float v = dst[j] + drow[c0 + j];
        dst[j] = factor * v;
      }
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- DensePatch

absl::StatusOr<std::shared_ptr<const DensePatch>> DensePatch::Create(PatchSource source,
                                                                     std::vector<int64_t> shape,
                                                                     std::vector<float> values,
                                                                     Mode mode, double scale) {
  for (int64_t dim : shape) {
    if (dim < 0)
      return absl::InvalidArgumentError(absl::StrCat("negative dim in ", ShapeString(shape)));
  }
  if (static_cast<int64_t>(values.size()) != NumElements(shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense patch has ", values.size(), " values for shape ", ShapeString(shape)));
  }
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("dense patch scale ", scale, " is not finite"));
  }
  return std::shared_ptr<const DensePatch>(
      new DensePatch(std::move(source), std::move(shape), std::move(values), mode, scale));
}

std::string DensePatch::CacheKey() const {
  const char* kind = mode_ == Mode::kAdd ? "add" : mode_ == Mode::kSet ? "set" : "keep";
  return absl::StrCat("dense-", kind, "|", source_.adapter_digest.Hex(), "|", source_.target, "|",
                      ScaleString(scale_));
}

bool DensePatch::ElementTerm(float strength, MergeTerm* term) const {
  MergeTerm t;
  t.kind = mode_ == Mode::kAdd   ? MergeTerm::kAdd
           : mode_ == Mode::kSet ? MergeTerm::kSet
                                 : MergeTerm::kCopy;
  t.s = EffectiveScale(strength, scale_);
  t.v = values_.data();
  t.v_len = values_.size();
  *term = t;
  return true;
}

absl::Status DensePatch::Apply(const ShardBox& box, absl::Span<const int64_t> global_shape,
                               float strength, const BaseRowReader& base, float* acc) const {
  WD_RETURN_IF_ERROR(CheckBox(box, global_shape, shape_));
  const size_t rank = shape_.size();
  const float s = EffectiveScale(strength, scale_);
  auto apply_run = [&](const float* src, float* dst, int64_t n) {
    switch (mode_) {
      case Mode::kAdd:
        for (int64_t j = 0; j < n; ++j) {
          const float delta = src[j] * s;
          dst[j] += delta;
        }
        break;
      case Mode::kSet:
        for (int64_t j = 0; j < n; ++j) dst[j] = src[j] * s;
        break;
      case Mode::kSetIgnoringStrength:
        std::copy(src, src + n, dst);
        break;
    }
  };
  if (rank == 0) {
    apply_run(values_.data(), acc, 1);
    return absl::OkStatus();
  }
  for (int64_t dim : box.shape) {
    if (dim == 0) return absl::OkStatus();
  }
  // Row-major strides of the full tensor; walk the box one innermost run at
  // a time.
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * shape_[d];
  const int64_t inner = box.shape[rank - 1];
  std::vector<int64_t> idx(rank, 0);  // over dims [0, rank-1)
  float* dst = acc;
  while (true) {
    int64_t src_off = box.offset[rank - 1];
    for (size_t d = 0; d + 1 < rank; ++d) src_off += (box.offset[d] + idx[d]) * stride[d];
    apply_run(values_.data() + src_off, dst, inner);
    dst += inner;
    size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
      if (d == 0) return absl::OkStatus();
    }
    if (rank == 1) return absl::OkStatus();
  }
}

}  // namespace weightd
