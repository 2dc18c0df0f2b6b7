// Fetch planning: what one rank's fetch serves, as a pure function of the
// selected served tensors and the request — per tensor the box of each part
// it needs (docs/DESIGN.md §2.1, §2.2 sharding: torch.chunk per placement; per-part
// tensor-parallel pieces; merged tensors sharded whole), the output dtype
// (quantization, then profile dtype rules, then the request's dtype for
// floating tensors), the adapter patches on each part, FP8 scale
// companions — as MaterializeItems and the table rows that will describe
// them. No locks, no I/O, no materialization: WeightService resolves the
// model, generation and access, plans, then materializes the plan.
#ifndef WEIGHTD_SERVER_SERVICE_FETCH_PLAN_H_
#define WEIGHTD_SERVER_SERVICE_FETCH_PLAN_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/lease/lease_table.h"
#include "server/materialize/materializer.h"
#include "server/profile/profile.h"
#include "server/store/checkpoint.h"

namespace weightd {

// One row of a fetch's table: a served tensor's local shard.
struct FetchedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
  uint32_t segment = 0;  // filled once materialized
  uint64_t offset = 0;   // filled once materialized
  uint64_t length = 0;   // filled once materialized
  Digest digest;         // filled once materialized
  // Leased as its stored bytes, converted to `dtype` by the push
  // (FetchParams::defer_casts); `digest` is then unset.
  bool cast_on_push = false;
};

// What a fetch serves, the same for every fetch of the same request on the
// same generation: built once and shared (WeightService caches it while its
// segments live), so a repeated fetch costs a lookup and a lease.
struct FetchTable {
  uint64_t generation = 0;
  std::vector<uint64_t> segment_sizes;
  std::vector<FetchedTensor> tensors;
  std::string data_socket;
  std::string data_socket_name;  // see FetchResponse.data_socket_name
  std::string weights_id;        // the generation's identity (hex)
  uint64_t bytes = 0;  // sum of the tensors' lengths
  // Where each of `tensors` lies, as leases carry it.
  std::shared_ptr<const std::vector<LeaseTensor>> ranges;
  // The control plane's encoding of this table, made once by whoever sends
  // it (the gRPC layer: a serialized FetchResponse without lease and token).
  mutable std::once_flag wire_once;
  mutable std::string wire;
};

// A served tensor to plan: its plan and its parts in the store (borrowed;
// empty for a zero-filled new parameter).
struct PlannedTensor {
  const ServedTensorPlan* plan = nullptr;
  std::vector<const StoredTensor*> parts;
};

struct FetchPlanOptions {
  MeshCoord mesh;                   // validated
  std::vector<Placement> defaults;  // ResolveDefaultPlacements
  std::optional<DType> dtype;       // the request's; nullopt = keep
  // The patches of the generation on a part (by checkpoint name; by served
  // name for a tensor without parts), applied in order.
  std::function<std::vector<AppliedPatch>(const std::string& key)> patches;
  // The FP8 scale of tensors[index] (quantize_fp8 only).
  std::function<absl::StatusOr<float>(size_t index)> fp8_scale;
};

// items[i] is described by tensors[i]; a quantized tensor is followed by
// its "<name>_scale" companion (an F32 scalar).
struct FetchPlan {
  std::vector<MaterializeItem> items;
  std::vector<FetchedTensor> tensors;
};

// The placements every tensor without its own profile placements gets: the
// request's, else the profile's default_placements, else DefaultPlacements
// (docs/DESIGN.md §2.1). INVALID_ARGUMENT when they do not name one per mesh dim.
absl::StatusOr<std::vector<Placement>> ResolveDefaultPlacements(
    const MeshCoord& mesh, const std::optional<std::vector<Placement>>& requested,
    const std::optional<std::vector<Placement>>& profile_default);

// Indexes into `served_names` of the tensors `names` asks for, in request
// order (all of them, in order, when `names` is empty). INVALID_ARGUMENT
// when a name is given twice, NOT_FOUND naming the unknown ones (`model`
// names the model); both bounded however many names there are.
absl::StatusOr<std::vector<size_t>> SelectByName(absl::Span<const std::string> served_names,
                                                absl::Span<const std::string> names,
                                                absl::string_view model);

// INVALID_ARGUMENT for profile placements that do not fit the mesh, a
// float tensor asked for in a non-float dtype; shard-planning errors
// naming the tensor; the fp8_scale callback's errors.
absl::StatusOr<FetchPlan> PlanFetch(absl::Span<const PlannedTensor> tensors,
                                    const FetchPlanOptions& options);

// The merge a push can make as it writes `item` (FetchParams::defer_merges):
// one stored floating part, patched, on a range of whole rows (every dim but
// the first whole), to a floating dtype, no FP8 scale, every patch with an
// ElementTerm. Null otherwise. Dense terms are narrowed to the box's rows.
std::shared_ptr<const PushMerge> MergeOnPush(const MaterializeItem& item);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_FETCH_PLAN_H_
