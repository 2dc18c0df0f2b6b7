#include "server/service/fetch_plan.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/profile/name_summary.h"

namespace weightd {
namespace {

// Names from a request, for a message: one quoted, or several summarized by
// pattern (SummarizeNamesInline); bounded and escaped either way.
std::string SummarizeRequestedNames(absl::Span<const std::string> names) {
  constexpr size_t kMaxBytes = 1024;
  if (names.size() == 1) return QuoteForMessage(names[0]);
  return QuoteForMessage(SummarizeNamesInline(names), kMaxBytes);
}

}  // namespace

absl::StatusOr<std::vector<Placement>> ResolveDefaultPlacements(
    const MeshCoord& mesh, const std::optional<std::vector<Placement>>& requested,
    const std::optional<std::vector<Placement>>& profile_default) {
  const size_t mesh_dims = mesh.shape.size();
  if (requested.has_value()) {
    if (requested->size() != mesh_dims) {
      return absl::InvalidArgumentError(absl::StrCat(
          "placements \"", PlacementsToString(*requested), "\" name ", requested->size(),
          " mesh dims but the mesh has ", mesh_dims));
    }
    return *requested;
  }
  if (profile_default.has_value()) {
    if (profile_default->size() != mesh_dims) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the profile's default_placements \"", PlacementsToString(*profile_default),
          "\" name ", profile_default->size(), " mesh dims but the mesh has ", mesh_dims,
          "; pass --placements"));
    }
    return *profile_default;
  }
  return DefaultPlacements(mesh_dims);
}

absl::StatusOr<std::vector<size_t>> SelectByName(absl::Span<const std::string> served_names,
                                                absl::Span<const std::string> names,
                                                absl::string_view model) {
  std::vector<size_t> selected;
  if (names.empty()) {
    selected.resize(served_names.size());
    for (size_t i = 0; i < selected.size(); ++i) selected[i] = i;
    return selected;
  }
  absl::flat_hash_map<absl::string_view, size_t> by_name;
  for (size_t i = 0; i < served_names.size(); ++i) by_name[served_names[i]] = i;
  // A name given twice would be materialized and listed twice: refused, so
  // the table never holds a name twice (docs/limits.md).
  absl::flat_hash_set<absl::string_view> seen;
  std::vector<std::string> unknown, repeated;
  for (const std::string& n : names) {
    if (!seen.insert(n).second) {
      repeated.push_back(n);
      continue;
    }
    auto it = by_name.find(n);
    if (it == by_name.end()) {
      unknown.push_back(n);
    } else {
      selected.push_back(it->second);
    }
  }
  if (!repeated.empty()) {
    std::sort(repeated.begin(), repeated.end());
    repeated.erase(std::unique(repeated.begin(), repeated.end()), repeated.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "names: ", SummarizeRequestedNames(repeated), repeated.size() == 1 ? " is" : " are",
        " given more than once (name each tensor once)"));
  }
  if (!unknown.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "model \"", model, "\" has no tensor named ",
        unknown.size() == 1 ? "" : absl::StrCat("any of these ", unknown.size(), " names: "),
        SummarizeRequestedNames(unknown)));
  }
  return selected;
}

namespace {

// A merged tensor sharded as a whole: each part gives the rows of `box`
// that fall inside it (an empty shard: zero rows of the first part).
template <typename Patches>
void SlicesOfMergedBox(const std::vector<const StoredTensor*>& parts, const ShardBox& whole,
                       const Patches& patches, MaterializeItem* out) {
  const ShardBox* box = &whole;
  MaterializeItem& item = *out;
  int64_t begin = box->offset[0], end = begin + box->shape[0], part_start = 0;
  for (const StoredTensor* p : parts) {
    int64_t part_end = part_start + p->shape[0];
    int64_t lo = std::max(begin, part_start), hi = std::min(end, part_end);
    if (lo < hi) {
      ShardBox pb = *box;
      pb.offset[0] = lo - part_start;
      pb.shape[0] = std::max<int64_t>(0, hi - lo);
      item.slices.push_back(PartSlice{p, p->dtype, p->shape, std::move(pb), patches(p->name)});
    }
    part_start = part_end;
  }
  if (item.slices.empty()) {  // an empty shard: zero rows of the first part
    const StoredTensor* p = parts.front();
    ShardBox pb = *box;
    pb.offset[0] = 0;
    pb.shape[0] = 0;
    item.slices.push_back(PartSlice{p, p->dtype, p->shape, std::move(pb), {}});
  }
}

// The dtype `plan` is served as (an FP8 quantization records its scale in
// `item`).
absl::StatusOr<DType> OutDType(const ServedTensorPlan& plan, const FetchPlanOptions& options,
                               size_t index, MaterializeItem* item) {
  DType stored = plan.dtype;
  DType out = stored;
  if (plan.quantize_fp8) {
    out = DType::kF8E4M3;
    WD_ASSIGN_OR_RETURN(float scale, options.fp8_scale(index));
    item->fp8_scale = scale;
  } else if (plan.dtype_override.has_value()) {
    out = *plan.dtype_override;
  } else if (options.dtype.has_value() && IsFloating(stored)) {
    if (!IsFloating(*options.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot serve float tensors as ",
                                                     DTypeName(*options.dtype)));
    }
    out = *options.dtype;
  }
  return out;
}

}  // namespace

absl::StatusOr<FetchPlan> PlanFetch(absl::Span<const PlannedTensor> tensors,
                                    const FetchPlanOptions& options) {
  const size_t mesh_dims = options.mesh.shape.size();
  auto patches = [&](const std::string& key) {
    return options.patches ? options.patches(key) : std::vector<AppliedPatch>();
  };
  FetchPlan plan_out;
  plan_out.items.reserve(tensors.size());
  plan_out.tensors.reserve(tensors.size());
  for (size_t index = 0; index < tensors.size(); ++index) {
    const PlannedTensor* s = &tensors[index];
    const ServedTensorPlan& plan = *s->plan;
    const std::vector<Placement>& placements = plan.placements.has_value() ? *plan.placements : options.defaults;
    if (placements.size() != mesh_dims) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", plan.name, "\": its profile placements \"", PlacementsToString(placements),
          "\" name ", placements.size(), " mesh dims but the mesh has ", mesh_dims));
    }
    MaterializeItem item;
    item.name = plan.name;
    FetchedTensor ft;
    ft.name = plan.name;
    ft.global_shape = plan.shape;
    auto context = [&](const absl::Status& st) {
      return Annotate(st, absl::StrCat("tensor \"", plan.name, "\" of shape ", ShapeString(plan.shape)));
    };
    if (plan.per_part && s->parts.size() > 1) {
      int64_t rows = 0;
      for (const StoredTensor* p : s->parts) {
        auto box = PlanShard(p->shape, options.mesh, placements);
        if (!box.ok()) return context(box.status());
        if (ft.shape.empty()) {
          ft.shape = box->shape;
          ft.global_offset = box->offset;
        }
        rows += box->shape[0];
        item.slices.push_back(PartSlice{p, p->dtype, p->shape, std::move(*box), patches(p->name)});
      }
      ft.shape[0] = rows;
    } else {
      auto box = PlanShard(plan.shape, options.mesh, placements);
      if (!box.ok()) return context(box.status());
      ft.shape = box->shape;
      ft.global_offset = box->offset;
      if (s->parts.empty()) {
        item.slices.push_back(PartSlice{nullptr, plan.dtype, plan.shape, *box, patches(plan.name)});
      } else if (s->parts.size() == 1 || plan.shape.empty()) {
        const StoredTensor* p = s->parts[0];
        item.slices.push_back(PartSlice{p, p->dtype, p->shape, *box, patches(p->name)});
      } else {
        SlicesOfMergedBox(s->parts, *box, patches, &item);
      }
    }
    WD_ASSIGN_OR_RETURN(const DType out, OutDType(plan, options, index, &item));
    item.out_dtype = out;
    ft.dtype = out;
    std::optional<float> scale = item.fp8_scale;
    plan_out.items.push_back(std::move(item));
    plan_out.tensors.push_back(std::move(ft));
    if (scale.has_value()) {
      MaterializeItem companion;
      companion.name = plan.name + "_scale";
      companion.out_dtype = DType::kF32;
      companion.scalar = *scale;
      FetchedTensor cft;
      cft.name = companion.name;
      cft.dtype = DType::kF32;
      plan_out.items.push_back(std::move(companion));
      plan_out.tensors.push_back(std::move(cft));
    }
  }
  return plan_out;
}

std::shared_ptr<const PushMerge> MergeOnPush(const MaterializeItem& item) {
  if (item.scalar.has_value() || item.fp8_scale.has_value() || item.slices.size() != 1) {
    return nullptr;
  }
  const PartSlice& s = item.slices[0];
  if (s.stored == nullptr || s.patches.empty() || s.shape.empty() ||
      !IsFloating(s.stored->dtype) || !IsFloating(item.out_dtype) ||
      s.box.offset.size() != s.shape.size() || s.box.shape.size() != s.shape.size()) {
    return nullptr;
  }
  int64_t cols = 1;
  for (size_t d = 1; d < s.shape.size(); ++d) {
    if (s.box.offset[d] != 0 || s.box.shape[d] != s.shape[d]) return nullptr;
    cols *= s.shape[d];
  }
  if (cols < 1 || s.box.shape[0] < 1) return nullptr;
  const uint64_t numel = static_cast<uint64_t>(s.shape[0]) * static_cast<uint64_t>(cols);
  auto merge = std::make_shared<PushMerge>();
  merge->cols = cols;
  merge->row_begin = s.box.offset[0];
  for (const AppliedPatch& p : s.patches) {
    MergeTerm t;
    if (p.patch == nullptr || !p.patch->ElementTerm(p.strength, &t)) return nullptr;
    // The patch's shape is the part's (as Apply's box check wants): a
    // low-rank term is 2-D, a dense one any rank.
    if (p.patch->shape() != s.shape || (t.kind == MergeTerm::kLowRank && s.shape.size() != 2)) {
      return nullptr;
    }
    if (t.kind != MergeTerm::kLowRank) {
      if (t.v_len != numel) return nullptr;
      t.v += s.box.offset[0] * cols;
      t.v_row0 = s.box.offset[0];
      t.v_len = static_cast<uint64_t>(s.box.shape[0]) * static_cast<uint64_t>(cols);
    }
    merge->terms.push_back(t);
    merge->hold.push_back(p.patch);
  }
  return merge;
}

}  // namespace weightd
