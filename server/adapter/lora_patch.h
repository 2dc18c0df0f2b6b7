// The TensorPatch implementations behind adapters (docs/DESIGN.md §2.5 "LoRA merge"):
//
//   LoraPatch   kAdd      ΔW = s · (B @ A)      (transposed: s · (B @ A)ᵀ)
//   DoraPatch   kAdd*     W' = (m / ‖W + ΔW‖_row) ⊙ (W + ΔW)
//   DensePatch  kAdd      ΔW = s · V            (.diff, .diff_b, lora_B.bias)
//               kReplace  W' = strength · V     (.set_weight, .set_param)
//                         W' = V                (PEFT modules_to_save, bias)
//
// Numerics follow PEFT's default merge on CPU (reference doc §1.5, §4.2):
// the product B @ A is accumulated in fp32 (cblas_sgemm, k ascending), then
// multiplied by the effective scale s = fp32(strength · scale) — the
// multiplication comes after the matmul, as in `(B @ A) * scaling` — and
// then added to the fp32 accumulator, so each element sees the roundings
// fl(fl(fl(Σ_k B·A) · s) + acc) and nothing is pre-rounded to a narrower
// type. `strength` enters the scale exactly as PEFT's set_scale() does
// (scaling = strength · lora_alpha / r), computed in double and rounded to
// fp32 once.
//
// Everything is computed only on the requested box: a row shard uses the
// matching rows of B, a column shard the matching columns of A (the
// transposed layout swaps the roles). No patch ever materializes the full
// ΔW except DoraPatch, which needs whole rows for its norms.
//
// Patches are immutable after Create() and safe to Apply() concurrently.
#ifndef WEIGHTD_SERVER_ADAPTER_LORA_PATCH_H_
#define WEIGHTD_SERVER_ADAPTER_LORA_PATCH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/shard.h"
#include "server/adapter/patch.h"

namespace weightd {

// Low-rank factors in fp32, row-major: A = lora_A / lora_down [rank, in],
// B = lora_B / lora_up [out, rank].
struct LowRankFactors {
  int64_t rank = 0;
  int64_t in = 0;
  int64_t out = 0;
  std::vector<float> a;  // rank * in
  std::vector<float> b;  // out * rank
};

// Where a patch comes from; becomes its CacheKey (with kind and scale).
struct PatchSource {
  Digest adapter_digest;  // of the adapter's files
  std::string target;     // the parameter, as the adapter names it
};

// A plain LoRA term. shape() is [out, in], or [in, out] when `transposed`:
// PEFT fan_in_fan_out (GPT-2 Conv1D stores [in, out]) and PEFT embeddings
// (lora_embedding_A [r, num_embeddings], lora_embedding_B [dim, r] give
// ΔW = (B @ A)ᵀ of shape [num_embeddings, dim]).
//
// Apply() on a box [r0, r0+nr) × [c0, c0+nc) of the 2-D weight computes
//   acc[i][j] += fl(fl(Σ_k B[r0+i][k] · A[k][c0+j]) · s)
// (transposed: Σ_k A[k][r0+i] · B[c0+j][k]) with s = fp32(strength · scale),
// in row blocks through a small fp32 scratch buffer.
class LoraPatch final : public TensorPatch {
 public:
  // INVALID_ARGUMENT when the factor sizes do not match rank/in/out, rank
  // < 1, or `scale` is not finite.
  static absl::StatusOr<std::shared_ptr<const LoraPatch>> Create(PatchSource source,
                                                                 LowRankFactors factors,
                                                                 double scale, bool transposed);

  Kind kind() const override { return Kind::kAdd; }
  std::string CacheKey() const override;
  std::vector<int64_t> shape() const override;
  absl::Status Apply(const ShardBox& box, absl::Span<const int64_t> global_shape, float strength,
                     const BaseRowReader& base, float* acc) const override;
  bool ElementTerm(float strength, MergeTerm* term) const override;

  const LowRankFactors& factors() const { return f_; }
  double scale() const { return scale_; }
  bool transposed() const { return transposed_; }
  uint64_t bytes() const;

 private:
  LoraPatch(PatchSource source, LowRankFactors factors, double scale, bool transposed)
      : source_(std::move(source)),
        f_(std::move(factors)),
        scale_(scale),
        transposed_(transposed) {}

  PatchSource source_;
  LowRankFactors f_;
  double scale_;
  bool transposed_;
};

// A DoRA term (PEFT use_dora; kohya/LyCORIS dora_scale on the output axis),
// for a 2-D [out, in] weight. With ΔW = fl(fl(B @ A) · s),
// s = fp32(strength · scale) (PEFT set_scale semantics: strength scales ΔW
// *inside* the norm, so strength 0 gives m/‖W‖ ⊙ W, not W):
//   V = W + ΔW;  factor[r] = fl(m[r] / ‖V[r, :]‖₂);  W'[box] = factor ⊙ (acc + ΔW[box])
// which is PEFT's merge (variants.py: dora_factor * (W + delta_weight)).
// The norms run over the whole input dim of the *base* W, read through
// `base` (all columns of the box's rows, in blocks), plus full-row ΔW; the
// sum of squares is accumulated in double and rounded to fp32. `acc` may
// already hold earlier patches of the stack; they are scaled by the DoRA
// factor too (the norm still comes from the pristine base).
// fan_in_fan_out DoRA is not supported (rejected when the adapter loads).
class DoraPatch final : public TensorPatch {
 public:
  // INVALID_ARGUMENT on size mismatches (magnitude must have `out` values).
  static absl::StatusOr<std::shared_ptr<const DoraPatch>> Create(PatchSource source,
                                                                 LowRankFactors factors,
                                                                 double scale,
                                                                 std::vector<float> magnitude);

  Kind kind() const override { return Kind::kAdd; }
  std::string CacheKey() const override;
  std::vector<int64_t> shape() const override { return {f_.out, f_.in}; }
  // Fails with `base`'s error, or INVALID_ARGUMENT when `base` is empty.
  absl::Status Apply(const ShardBox& box, absl::Span<const int64_t> global_shape, float strength,
                     const BaseRowReader& base, float* acc) const override;

  const LowRankFactors& factors() const { return f_; }
  double scale() const { return scale_; }
  const std::vector<float>& magnitude() const { return magnitude_; }
  uint64_t bytes() const;

 private:
  DoraPatch(PatchSource source, LowRankFactors factors, double scale, std::vector<float> magnitude)
      : source_(std::move(source)),
        f_(std::move(factors)),
        scale_(scale),
        magnitude_(std::move(magnitude)) {}

  PatchSource source_;
  LowRankFactors f_;
  double scale_;
  std::vector<float> magnitude_;
};

// A whole-parameter payload of any rank (0-d included), stored in full and
// sliced by the box.
//   kAdd:                acc += V[box] · fp32(strength · scale)
//                        (.diff / .diff_b / .diff_param: scale 1, as
//                        FastVideo's `t + delta * strength`; PEFT
//                        lora_B.bias: scale = the module's LoRA scaling)
//   kSet:                acc = V[box] · strength   (.set_weight / .set_param:
//                        FastVideo's `value * strength`; docs/DESIGN.md §2.5)
//   kSetIgnoringStrength acc = V[box]              (PEFT modules_to_save and
//                        bias="all"/"lora_only" tensors: trained values that
//                        replace the base; PEFT has no strength for them)
class DensePatch final : public TensorPatch {
 public:
  enum class Mode { kAdd, kSet, kSetIgnoringStrength };

  // INVALID_ARGUMENT when values.size() != numel(shape) or scale is not
  // finite.
  static absl::StatusOr<std::shared_ptr<const DensePatch>> Create(PatchSource source,
                                                                  std::vector<int64_t> shape,
                                                                  std::vector<float> values,
                                                                  Mode mode, double scale = 1.0);

  Kind kind() const override { return mode_ == Mode::kAdd ? Kind::kAdd : Kind::kReplace; }
  std::string CacheKey() const override;
  std::vector<int64_t> shape() const override { return shape_; }
  absl::Status Apply(const ShardBox& box, absl::Span<const int64_t> global_shape, float strength,
                     const BaseRowReader& base, float* acc) const override;
  bool ElementTerm(float strength, MergeTerm* term) const override;

  Mode mode() const { return mode_; }
  double scale() const { return scale_; }
  const std::vector<float>& values() const { return values_; }
  uint64_t bytes() const { return values_.size() * sizeof(float); }

 private:
  DensePatch(PatchSource source, std::vector<int64_t> shape, std::vector<float> values, Mode mode,
             double scale)
      : source_(std::move(source)),
        shape_(std::move(shape)),
        values_(std::move(values)),
        mode_(mode),
        scale_(scale) {}

  PatchSource source_;
  std::vector<int64_t> shape_;
  std::vector<float> values_;
  Mode mode_;
  double scale_;
};

// The effective fp32 multiplier: fp32(double(strength) · scale).
float EffectiveScale(float strength, double scale);

// Threads OpenBLAS may use inside one GEMM (process-wide;
// openblas_set_num_threads). The materializer already runs patches on
// several workers, so a daemon may want 1 to avoid oversubscription.
void SetGemmThreads(int threads);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ADAPTER_LORA_PATCH_H_
