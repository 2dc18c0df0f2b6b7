// Profile::Map: a checkpoint's tensors onto served tensors, by the rules
// profile.h numbers 1-5. profile_internal::Mapper runs them as phases, one
// method each: route every checkpoint name (1-2), plan every served name
// (3-4), account for the expected set (4), apply the per-tensor rules (5),
// then index the result. Every message names the rule, the served tensor or
// the checkpoint tensors it is about, so nothing is added to them as they
// rise.
#include <re2/re2.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/profile/name_summary.h"
#include "server/profile/profile.h"
#include "server/profile/profile_internal.h"

namespace weightd {
namespace {

using profile_internal::Quote;

constexpr absl::string_view kExtraStateSuffix = "_extra_state";
// RE2 rewrites use \0..\9.
constexpr int kMaxSubmatches = 10;

bool FullMatch(const re2::RE2& re, absl::string_view name) {
  return re2::RE2::FullMatch(re2::StringPiece(name.data(), name.size()), re);
}

bool EndsWithExtraState(absl::string_view name) {
  return absl::EndsWith(name, kExtraStateSuffix);
}

// A checkpoint tensor on its way to a served name.
struct Routed {
  size_t index;   // into the checkpoint
  int rule = -1;  // name_mapping index; -1 = no rule matched
  int64_t merge_index = 0;
  int64_t num_merges = 1;
};

std::string Describe(const Routed& r,
                     absl::Span<const SourceTensorInfo> checkpoint) {
  const std::string& name = checkpoint[r.index].name;
  if (r.rule < 0) return absl::StrCat(Quote(name), " (no rule)");
  if (r.num_merges > 1) {
    return absl::StrCat(Quote(name), " (name_mapping[", r.rule,
                        "], merge_index ", r.merge_index, " of ", r.num_merges,
                        ")");
  }
  return absl::StrCat(Quote(name), " (name_mapping[", r.rule, "])");
}

std::string DescribeTensor(const SourceTensorInfo& t) {
  return absl::StrCat(Quote(t.name), " ", DTypeName(t.dtype), " ",
                      ShapeString(t.shape));
}

struct IncompleteGroup {
  std::string served;
  std::vector<int64_t> missing;
  int64_t num_merges;
  std::vector<std::string> present;  // "name" (merge_index k)
};

// The dtype of a zero-filled tensor whose expected entry names none: the
// most common among the checkpoint's floating tensors (the first in DType
// order on a tie), F32 when there are none.
DType MostCommonFloatingDType(absl::Span<const SourceTensorInfo> checkpoint) {
  std::array<size_t, kNumDTypes> counts{};
  for (const SourceTensorInfo& t : checkpoint) {
    if (IsFloating(t.dtype)) ++counts[static_cast<size_t>(t.dtype)];
  }
  DType dtype = DType::kF32;
  size_t best = 0;
  for (int d = 0; d < kNumDTypes; ++d) {
    if (counts[d] > best) {
      best = counts[d];
      dtype = static_cast<DType>(d);
    }
  }
  return dtype;
}

}  // namespace

namespace profile_internal {

// One Map call: the profile, the checkpoint, and what the phases build.
class Mapper {
 public:
  Mapper(const Profile& profile, absl::Span<const SourceTensorInfo> checkpoint)
      : profile_(profile),
        checkpoint_(checkpoint),
        with_expected_(profile.expected_.has_value()) {}

  absl::StatusOr<ServedLayout> Map() && {
    WD_RETURN_IF_ERROR(RouteAll());
    WD_RETURN_IF_ERROR(PlanAll());
    if (with_expected_) WD_RETURN_IF_ERROR(AccountForExpected());
    for (ServedTensorPlan& plan : layout_.tensors) {
      WD_RETURN_IF_ERROR(ApplyRules(plan));
    }
    WD_RETURN_IF_ERROR(CheckScaleCompanions());
    Finish();
    return std::move(layout_);
  }

 private:
  using ExpectedTensor = Profile::ExpectedTensor;

  // 1-2. Every checkpoint tensor into groups_ under its served name, or
  // into report.skipped_extra_state.
  absl::Status RouteAll();
  // The served name of `source` by the first name_mapping rule it matches
  // (itself when none does), recording the rule in `routed`.
  absl::StatusOr<std::string> Rename(const std::string& source,
                                     Routed& routed) const;

  // 3-4. A plan per served name into layout_.tensors; an incomplete merge
  // group is FAILED_PRECONDITION once every group has been looked at.
  absl::Status PlanAll();
  absl::Status PlanGroup(const std::string& served,
                         std::vector<Routed>& sources);
  // Several sources must be parts of one merge that agree on num_merges.
  absl::Status CheckOneMerge(const std::string& served,
                             const std::vector<Routed>& sources,
                             bool merged) const;
  // REQUIRES: sources sorted by merge_index.
  absl::Status CheckNoDuplicateIndex(const std::string& served,
                                     const std::vector<Routed>& sources) const;
  // False, with the group recorded in incomplete_, when indices are missing.
  bool RecordIfIncomplete(const std::string& served,
                          const std::vector<Routed>& sources);
  absl::StatusOr<ServedTensorPlan> BuildPlan(
      const std::string& served, const std::vector<Routed>& sources,
      bool merged) const;
  // Adds a merge part's rows to plan.shape[0] after checking it fits.
  absl::Status AddMergeRows(const std::string& served,
                            const SourceTensorInfo& first,
                            const SourceTensorInfo& part,
                            ServedTensorPlan& plan) const;
  absl::Status IncompleteGroupsError() const;

  // 4. Unexpected and missing names; zero-filled tensors for allow_new.
  absl::Status AccountForExpected();
  absl::Status UnexpectedOrMissingError(
      const std::vector<std::string>& missing) const;

  // 5. The first placements, dtype and quantize rule matching plan.name.
  absl::Status ApplyRules(ServedTensorPlan& plan) const;
  absl::Status CheckScaleCompanions() const;

  // layout_.reverse, and the report's lists sorted.
  void Finish();

  const Profile& profile_;
  const absl::Span<const SourceTensorInfo> checkpoint_;
  const bool with_expected_;
  ServedLayout layout_;
  std::map<std::string, std::vector<Routed>> groups_;  // by served name
  std::vector<IncompleteGroup> incomplete_;
};

absl::Status Mapper::RouteAll() {
  ProfileReport& report = layout_.report;
  for (size_t i = 0; i < checkpoint_.size(); ++i) {
    const std::string& source = checkpoint_[i].name;
    if (with_expected_ && EndsWithExtraState(source)) {
      report.skipped_extra_state.push_back(source);
      continue;
    }
    Routed routed{i};
    WD_ASSIGN_OR_RETURN(std::string served, Rename(source, routed));
    if (with_expected_ && EndsWithExtraState(served)) {
      report.skipped_extra_state.push_back(source);
      continue;
    }
    groups_[std::move(served)].push_back(routed);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Mapper::Rename(const std::string& source,
                                           Routed& routed) const {
  std::array<re2::StringPiece, kMaxSubmatches> submatch;
  const re2::StringPiece text(source.data(), source.size());
  for (size_t r = 0; r < profile_.name_mapping_.size(); ++r) {
    const Profile::NameRule& rule = profile_.name_mapping_[r];
    if (!rule.re->Match(text, 0, text.size(), re2::RE2::ANCHOR_BOTH,
                        submatch.data(), rule.submatches)) {
      continue;
    }
    std::string target;
    if (!rule.re->Rewrite(
            &target, re2::StringPiece(rule.target.data(), rule.target.size()),
            submatch.data(), rule.submatches)) {
      return absl::InternalError(absl::StrCat(
          "name_mapping[", r, "]: rewriting ", Quote(source), " failed"));
    }
    if (target.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("name_mapping[", r, "]: maps ", Quote(source),
                       " to an empty name"));
    }
    routed.rule = static_cast<int>(r);
    routed.merge_index = rule.merge_index;
    routed.num_merges = rule.num_merges;
    return target;
  }
  return source;
}

absl::Status Mapper::PlanAll() {
  for (auto& [served, sources] : groups_) {
    WD_RETURN_IF_ERROR(PlanGroup(served, sources));
  }
  if (!incomplete_.empty()) return IncompleteGroupsError();
  return absl::OkStatus();
}

absl::Status Mapper::PlanGroup(const std::string& served,
                               std::vector<Routed>& sources) {
  // A target may put into a name what the checkpoint parser refuses.
  WD_RETURN_IF_ERROR(CheckNoControlCharacters(served, "served tensor"));
  const ExpectedTensor* expected = nullptr;
  if (with_expected_) {
    auto it = profile_.expected_->find(served);
    if (it == profile_.expected_->end()) {
      layout_.report.unexpected.push_back(served);
      return absl::OkStatus();
    }
    expected = &it->second;
  }

  const bool merged = sources.front().num_merges > 1;
  WD_RETURN_IF_ERROR(CheckOneMerge(served, sources, merged));
  std::sort(sources.begin(), sources.end(),
            [](const Routed& a, const Routed& b) {
              if (a.merge_index != b.merge_index) {
                return a.merge_index < b.merge_index;
              }
              return a.index < b.index;
            });
  if (merged) {
    WD_RETURN_IF_ERROR(CheckNoDuplicateIndex(served, sources));
    if (!RecordIfIncomplete(served, sources)) return absl::OkStatus();
  }

  WD_ASSIGN_OR_RETURN(ServedTensorPlan plan,
                      BuildPlan(served, sources, merged));
  if (expected != nullptr && expected->shape != plan.shape) {
    std::vector<std::string> names;
    for (const ServedPart& p : plan.parts) names.push_back(Quote(p.source));
    return absl::InvalidArgumentError(absl::StrCat(
        "served tensor ", Quote(served), " (from ", absl::StrJoin(names, ", "),
        ") has shape ", ShapeString(plan.shape), " but expected shape is ",
        ShapeString(expected->shape)));
  }
  layout_.tensors.push_back(std::move(plan));
  return absl::OkStatus();
}

absl::Status Mapper::CheckOneMerge(const std::string& served,
                                   const std::vector<Routed>& sources,
                                   bool merged) const {
  for (size_t k = 1; k < sources.size(); ++k) {
    const Routed& a = sources.front();
    const Routed& b = sources[k];
    if (!merged || b.num_merges <= 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint tensors ", Describe(a, checkpoint_), " and ",
          Describe(b, checkpoint_), " both map to served tensor ",
          Quote(served), " and are not parts of one merge"));
    }
    if (a.num_merges != b.num_merges) {
      return absl::InvalidArgumentError(
          absl::StrCat("served tensor ", Quote(served), ": merge parts ",
                       Describe(a, checkpoint_), " and ",
                       Describe(b, checkpoint_), " disagree on num_merges"));
    }
  }
  return absl::OkStatus();
}

absl::Status Mapper::CheckNoDuplicateIndex(
    const std::string& served, const std::vector<Routed>& sources) const {
  for (size_t k = 1; k < sources.size(); ++k) {
    if (sources[k].merge_index == sources[k - 1].merge_index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "served tensor ", Quote(served), ": ",
          Describe(sources[k - 1], checkpoint_), " and ",
          Describe(sources[k], checkpoint_), " have the same merge_index ",
          sources[k].merge_index));
    }
  }
  return absl::OkStatus();
}

bool Mapper::RecordIfIncomplete(const std::string& served,
                                const std::vector<Routed>& sources) {
  const int64_t num_merges = sources.front().num_merges;
  if (static_cast<int64_t>(sources.size()) == num_merges) return true;
  IncompleteGroup group{served, {}, num_merges, {}};
  size_t next = 0;
  for (int64_t m = 0; m < num_merges; ++m) {
    if (next < sources.size() && sources[next].merge_index == m) {
      group.present.push_back(
          absl::StrCat(Quote(checkpoint_[sources[next].index].name),
                       " (merge_index ", m, ")"));
      ++next;
    } else {
      group.missing.push_back(m);
    }
  }
  incomplete_.push_back(std::move(group));
  return false;
}

absl::StatusOr<ServedTensorPlan> Mapper::BuildPlan(
    const std::string& served, const std::vector<Routed>& sources,
    bool merged) const {
  ServedTensorPlan plan;
  plan.name = served;
  const SourceTensorInfo& first = checkpoint_[sources.front().index];
  plan.dtype = first.dtype;
  plan.shape = first.shape;
  if (merged) {
    if (first.shape.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "served tensor ", Quote(served), ": merge part ",
          DescribeTensor(first), " is 0-dim; merge parts need ndim >= 1"));
    }
    plan.shape[0] = 0;
  }
  for (const Routed& r : sources) {
    const SourceTensorInfo& part = checkpoint_[r.index];
    if (merged) WD_RETURN_IF_ERROR(AddMergeRows(served, first, part, plan));
    plan.parts.push_back(ServedPart{part.name});
    plan.part_rows.push_back(part.shape.empty() ? 1 : part.shape[0]);
  }
  WD_RETURN_IF_ERROR_CTX(CheckShapeFits(plan.shape, kMaxDTypeSize),
                         "served tensor ", Quote(served));
  return plan;
}

absl::Status Mapper::AddMergeRows(const std::string& served,
                                  const SourceTensorInfo& first,
                                  const SourceTensorInfo& part,
                                  ServedTensorPlan& plan) const {
  const bool same_dims =
      part.shape.size() == first.shape.size() &&
      std::equal(part.shape.begin() + std::min<size_t>(1, part.shape.size()),
                 part.shape.end(), first.shape.begin() + 1);
  if (part.dtype != first.dtype || !same_dims) {
    return absl::InvalidArgumentError(absl::StrCat(
        "served tensor ", Quote(served), ": merge parts ",
        DescribeTensor(first), " and ", DescribeTensor(part),
        " must have the same dtype and the same dims after dim 0"));
  }
  if (part.shape[0] > std::numeric_limits<int64_t>::max() - plan.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "served tensor ", Quote(served), ": merged dim 0 overflows int64 (",
        plan.shape[0], " rows, then ", DescribeTensor(part), ")"));
  }
  plan.shape[0] += part.shape[0];
  return absl::OkStatus();
}

absl::Status Mapper::IncompleteGroupsError() const {
  const IncompleteGroup& g = incomplete_.front();
  std::string message = absl::StrCat(
      "merge group ", Quote(g.served), " is incomplete: missing merge_index ",
      FormatIntegerSet(g.missing), " of num_merges ", g.num_merges, " (have ",
      absl::StrJoin(g.present, ", "), ")");
  if (incomplete_.size() > 1) {
    std::vector<std::string> others;
    for (size_t i = 1; i < incomplete_.size(); ++i) {
      others.push_back(incomplete_[i].served);
    }
    absl::StrAppend(&message, "; ", others.size(),
                    " more incomplete merge group(s): ",
                    SummarizeNamesInline(others));
  }
  return absl::FailedPreconditionError(message);
}

absl::Status Mapper::AccountForExpected() {
  std::vector<std::string> missing;
  std::vector<ServedTensorPlan> zero_filled;
  std::optional<DType> default_dtype;
  for (const auto& [name, expected] : *profile_.expected_) {
    if (EndsWithExtraState(name) || groups_.contains(name)) continue;
    const bool allowed =
        std::any_of(profile_.allow_new_.begin(), profile_.allow_new_.end(),
                    [&name = name](const std::string& s) {
                      return absl::StrContains(name, s);
                    });
    if (!allowed) {
      missing.push_back(name);
      continue;
    }
    if (!default_dtype.has_value()) {
      default_dtype = MostCommonFloatingDType(checkpoint_);
    }
    ServedTensorPlan plan;
    plan.name = name;
    plan.dtype = expected.dtype.value_or(*default_dtype);
    plan.shape = expected.shape;
    zero_filled.push_back(std::move(plan));
    layout_.report.zero_filled.push_back(name);
  }
  WD_RETURN_IF_ERROR(UnexpectedOrMissingError(missing));
  for (ServedTensorPlan& plan : zero_filled) {
    layout_.tensors.push_back(std::move(plan));
  }
  std::sort(layout_.tensors.begin(), layout_.tensors.end(),
            [](const ServedTensorPlan& a, const ServedTensorPlan& b) {
              return a.name < b.name;
            });
  return absl::OkStatus();
}

absl::Status Mapper::UnexpectedOrMissingError(
    const std::vector<std::string>& missing) const {
  const std::vector<std::string>& unexpected = layout_.report.unexpected;
  if (profile_.strict_ && !unexpected.empty()) {
    std::string message = absl::StrCat(
        unexpected.size(), " served tensor(s) not in expected (strict): ",
        SummarizeNamesInline(unexpected));
    if (!missing.empty()) {
      absl::StrAppend(&message, "; also ", missing.size(),
                      " expected tensor(s) missing: ",
                      SummarizeNamesInline(missing));
    }
    return absl::InvalidArgumentError(message);
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        missing.size(),
        " expected tensor(s) missing from the checkpoint and not allowed "
        "new (allow_new): ",
        SummarizeNamesInline(missing)));
  }
  return absl::OkStatus();
}

absl::Status Mapper::ApplyRules(ServedTensorPlan& plan) const {
  for (const Profile::PlacementRule& rule : profile_.placement_rules_) {
    if (!FullMatch(*rule.re, plan.name)) continue;
    plan.placements = rule.placements;
    plan.per_part = rule.per_part && plan.parts.size() > 1;
    break;
  }
  for (size_t r = 0; r < profile_.dtype_rules_.size(); ++r) {
    const Profile::DTypeRule& rule = profile_.dtype_rules_[r];
    if (!FullMatch(*rule.re, plan.name)) continue;
    if (!CanCast(plan.dtype, rule.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype_rules[", r, "]: cannot cast ", Quote(plan.name), " from ",
          DTypeName(plan.dtype), " to ", DTypeName(rule.dtype)));
    }
    plan.dtype_override = rule.dtype;
    break;
  }
  for (size_t r = 0; r < profile_.quantize_rules_.size(); ++r) {
    if (!FullMatch(*profile_.quantize_rules_[r].re, plan.name)) continue;
    if (!IsFloating(plan.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize[", r, "]: ", Quote(plan.name), " is ",
          DTypeName(plan.dtype), "; only floating tensors can be quantized"));
    }
    plan.quantize_fp8 = true;
    break;
  }
  return absl::OkStatus();
}

absl::Status Mapper::CheckScaleCompanions() const {
  for (const ServedTensorPlan& plan : layout_.tensors) {
    if (!plan.quantize_fp8) continue;
    const std::string scale = absl::StrCat(plan.name, "_scale");
    if (layout_.Find(scale) != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize: the scale companion of ", Quote(plan.name),
          " would be named ", Quote(scale), ", which is already served"));
    }
  }
  return absl::OkStatus();
}

void Mapper::Finish() {
  for (const ServedTensorPlan& plan : layout_.tensors) {
    std::vector<std::string>& sources = layout_.reverse[plan.name];
    for (const ServedPart& p : plan.parts) sources.push_back(p.source);
  }
  std::sort(layout_.report.skipped_extra_state.begin(),
            layout_.report.skipped_extra_state.end());
}

}  // namespace profile_internal

absl::StatusOr<ServedLayout> Profile::Map(
    absl::Span<const SourceTensorInfo> checkpoint) const {
  return profile_internal::Mapper(*this, checkpoint).Map();
}

}  // namespace weightd
