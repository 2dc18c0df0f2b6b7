// A TensorPatch is one adapter's contribution to one served parameter,
// evaluated on any box (shard) of it without materializing the rest:
//   acc[box] = fp32(W[box]) on entry; Apply() adds strength * ΔW[box]
//   (LoRA, dense .diff) or overwrites it (.set_weight, modules_to_save).
// The materializer stacks patches in order on one fp32 accumulator and
// rounds once to the output dtype (docs/DESIGN.md §2.5 "LoRA merge").
//
// Implementations are immutable and thread-safe.
#ifndef WEIGHTD_SERVER_ADAPTER_PATCH_H_
#define WEIGHTD_SERVER_ADAPTER_PATCH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/kernels/merge_elements.h"
#include "common/shard.h"

namespace weightd {

// Reads fp32 values of the base parameter: rows [row_begin, row_end) of the
// parameter viewed as 2-D [shape[0], numel/shape[0]], all columns, into
// `out` (dense, row-major). Used by patches that need more of the base than
// the box (DoRA's row norms over the whole input dim).
using BaseRowReader =
    std::function<absl::Status(int64_t row_begin, int64_t row_end, float* out)>;

class TensorPatch {
 public:
  virtual ~TensorPatch() = default;

  enum class Kind { kAdd, kReplace };
  virtual Kind kind() const = 0;

  // Identifies the patch's content (adapter digest, module, scale), so that
  // a materialization can be cached by (base, patches, strengths, box, dtype).
  virtual std::string CacheKey() const = 0;

  // The parameter shape this patch expects; checked against the served
  // tensor when an adapter stack is applied.
  virtual std::vector<int64_t> shape() const = 0;

  // The CPU fill backend's kernel (server/materialize/cpu_fill.h): host
  // memory, fp32. A fill backend of another memory kind computes ΔW[box]
  // with its own kernels; it never calls this.
  // acc holds box.NumElements() fp32 values in box order (row-major over the
  // box). kAdd: acc += strength * ΔW[box]. kReplace: acc = strength * V[box].
  // `global_shape` is the served tensor's shape; `base` reads the base.
  virtual absl::Status Apply(const ShardBox& box, absl::Span<const int64_t> global_shape,
                             float strength, const BaseRowReader& base,
                             float* acc) const = 0;

  // The patch at `strength` as a per-element term over the whole parameter
  // (server/kernels/merge_elements.h; its arrays are this patch's, valid while it
  // lives), for kernels that merge element by element (a push's merge on
  // the GPU). False for a patch that needs more than the element (DoRA's
  // row norms): such a parameter is merged by Apply.
  virtual bool ElementTerm(float strength, MergeTerm* term) const {
    (void)strength;
    (void)term;
    return false;
  }
};

using TensorPatchPtr = std::shared_ptr<const TensorPatch>;

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ADAPTER_PATCH_H_
