// What the materializer is asked for and what it hands back: one rank's
// local shard of a served tensor, in the dtype it asked for, with its
// adapter patches merged (materializer.h).
//
// A served tensor is one or more checkpoint tensors ("parts", concatenated
// along dim 0 by a profile's merge rules) or none (a zero-filled new
// parameter). A request names, per part, the box of that part it needs; the
// output is those boxes concatenated along dim 0.
#ifndef WEIGHTD_SERVER_MATERIALIZE_ITEM_H_
#define WEIGHTD_SERVER_MATERIALIZE_ITEM_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/digest.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/adapter/patch.h"
#include "server/memory/buffer.h"
#include "server/store/checkpoint.h"

namespace weightd {

struct AppliedPatch {
  TensorPatchPtr patch;
  float strength = 1.0f;
};

// The box of one part that a request needs.
struct PartSlice {
  const StoredTensor* stored = nullptr;  // borrowed; nullptr = zeros
  DType dtype = DType::kF32;             // stored dtype (zero-fill dtype when no stored)
  std::vector<int64_t> shape;            // the part's shape
  ShardBox box;                          // in the part's coordinates
  std::vector<AppliedPatch> patches;     // applied in order, fp32
};

struct MaterializeItem {
  std::string name;  // for messages
  std::vector<PartSlice> slices;  // concatenated along dim 0
  DType out_dtype = DType::kF32;
  // FP8 quantization: out = e4m3(clamp(x / scale, ±448)); out_dtype must be
  // F8_E4M3.
  std::optional<float> fp8_scale;
  // Instead of slices: one F32 scalar (an FP8 scale companion tensor).
  std::optional<float> scalar;
};

// Where a result's bytes are: `length` bytes at `offset` of a sealed
// buffer, whatever its memory kind.
struct MaterializedTensor {
  BufferPtr buffer;
  uint64_t offset = 0;
  uint64_t length = 0;
  Digest digest;      // of the served bytes
  bool view = false;  // true when the bytes are the base buffer's own
};

// Elements of the item's output (sum over its slices).
int64_t OutputElements(const MaterializeItem& item);

// True when the item is its one stored part's bytes as they are: a single
// unpatched, unquantized, contiguous box in the stored dtype.
bool IsPlainView(const MaterializeItem& item);

// True when the item would be a plain view but for its output dtype, to
// which its stored dtype converts (CanCast): what a push can cast as it
// writes (FetchParams::defer_casts).
bool IsCastOfView(const MaterializeItem& item);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_ITEM_H_
