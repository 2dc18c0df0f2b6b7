// A model profile (docs/DESIGN.md §3): how a checkpoint's tensors map onto the
// tensors a model serves — renaming and dim-0 merging, per-tensor placements,
// dtype rules, FP8 quantization, the expected parameter set and strictness.
// Pure: no I/O, no knowledge of segments; the store and the materializer act
// on the ServedLayout that Map returns.
//
// Document (all keys optional; any other top-level key is an error):
//   name_mapping       [{match, target, merge_index?, num_merges?}]
//   placements         [{match, placements: ["R"|"S<d>", ...], per_part?}]
//   default_placements ["R"|"S<d>", ...]
//   dtype_rules        [{match, dtype}]          dtype: f32|bf16|... (not keep)
//   quantize           [{match, scheme}]         scheme: fp8_e4m3_per_tensor
//   expected           {served name: {shape: [..], dtype?}}
//   strict             bool (default true)
//   allow_new          [substring, ...]
// Every `match` is an RE2 pattern that must match the whole name; the first
// rule of a list that matches wins. name_mapping rules match checkpoint
// names; placements, dtype_rules and quantize rules match served names.
// Unknown keys inside rules are errors too.
//
// Thread safety: a Profile is immutable after Parse; Map may be called
// concurrently. Copies are cheap (compiled patterns are shared).
#ifndef WEIGHTD_SERVER_PROFILE_PROFILE_H_
#define WEIGHTD_SERVER_PROFILE_PROFILE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/shard.h"

namespace re2 {
class RE2;
}  // namespace re2

namespace weightd {

namespace profile_internal {
class Parser;  // Profile::Parse, one profile section at a time (profile_parse.cc)
class Mapper;  // Profile::Map, one phase at a time (profile_map.cc)
}  // namespace profile_internal

// A checkpoint tensor, as the store describes it.
struct SourceTensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// A checkpoint tensor feeding a served tensor.
struct ServedPart {
  std::string source;  // checkpoint name
};

// How one served tensor is made.
struct ServedTensorPlan {
  std::string name;            // served name
  DType dtype;                 // stored dtype (all parts have it)
  std::vector<int64_t> shape;  // merged shape: dim 0 = sum of part_rows
  // In merge_index order. 1 part = served as is; > 1 = concatenated along
  // dim 0; 0 parts = a zero-filled new parameter (allow_new).
  std::vector<ServedPart> parts;
  // Dim-0 size of each part (same length as parts; 1 for a 0-dim tensor).
  std::vector<int64_t> part_rows;
  // From the first placements rule matching the served name; nullopt = the
  // request's placements, else default_placements, else DefaultPlacements.
  // Its length is checked against the mesh at fetch time, not here.
  std::optional<std::vector<Placement>> placements;
  // True only when the matching placements rule says per_part and there are
  // >= 2 parts: shard each part separately and concatenate the local pieces.
  bool per_part = false;
  // From the first matching dtype rule; overrides the request's dtype.
  // Always castable from `dtype` (CanCast).
  std::optional<DType> dtype_override;
  // A quantize rule matched (scheme fp8_e4m3_per_tensor): serve F8_E4M3 data
  // plus an F32 companion "<name>_scale" (amax/448). Only floating tensors;
  // wins over dtype_override. The companion name is guaranteed not to be
  // another served tensor's name.
  bool quantize_fp8 = false;
};

// What load and info report. Names are served names except
// skipped_extra_state (checkpoint names). Each list is sorted.
struct ProfileReport {
  std::vector<std::string> skipped_extra_state;  // *_extra_state keys skipped
  std::vector<std::string> unexpected;   // not in `expected`, dropped (!strict)
  std::vector<std::string> zero_filled;  // absent, zero-filled (allow_new)

  // Human-readable lines, names summarized by pattern (SummarizeNames):
  // a header line per non-empty list, then its patterns indented by two
  // spaces. Empty report -> no lines.
  std::vector<std::string> Summary() const;
  bool empty() const {
    return skipped_extra_state.empty() && unexpected.empty() &&
           zero_filled.empty();
  }
};

struct ServedLayout {
  std::vector<ServedTensorPlan> tensors;  // sorted by served name, unique
  // Served name -> its parts' checkpoint names in merge order (empty for a
  // zero-filled tensor). One entry per element of `tensors`.
  absl::flat_hash_map<std::string, std::vector<std::string>> reverse;
  ProfileReport report;

  // nullptr when absent (binary search; tensors are sorted).
  const ServedTensorPlan* Find(absl::string_view name) const;
};

class Profile {
 public:
  // The empty profile: Map serves every tensor under its own name (like
  // Identity, but duplicate names are an error).
  Profile();

  // Parses and validates a profile document. INVALID_ARGUMENT naming the rule
  // and field for every problem: malformed JSON (with line/column), wrong
  // JSON types, unknown keys, bad regexes (`name_mapping[2].match: bad regex
  // "(": ...`), targets that use more groups than the pattern has, bad
  // dtypes, bad placements, empty placement lists, unknown quantize schemes,
  // merge_index out of range for num_merges, per_part when no name_mapping
  // rule merges (num_merges > 1), negative expected dims, expected shapes of
  // more than kMaxTensorRank dims or too large for int64 (CheckShapeFits at
  // kMaxDTypeSize: the count of the non-zero dims or the bytes in the widest
  // dtype overflows), expected names with control characters, empty
  // allow_new substrings, documents nesting deeper than kMaxJsonDepth.
  static absl::StatusOr<Profile> Parse(absl::string_view json);

  // Maps a checkpoint's tensors (any order, names unique) onto served tensors:
  //  1. Each checkpoint name goes through the first name_mapping rule whose
  //     match it fully matches (target with \0..\9 substituted); a name no
  //     rule matches is served as is. A target that rewrites to "" is
  //     INVALID_ARGUMENT.
  //  2. With `expected`: checkpoint tensors whose checkpoint or served name
  //     ends in "_extra_state" are skipped (report.skipped_extra_state), and
  //     expected keys ending in it are ignored.
  //  3. Tensors with the same served name form a group. Two sources of which
  //     one is not a merge part -> INVALID_ARGUMENT naming both. Merge parts
  //     (num_merges > 1) must agree on num_merges, have every merge_index
  //     0..num_merges-1 exactly once (duplicate -> INVALID_ARGUMENT naming both
  //     sources; missing -> FAILED_PRECONDITION naming the served tensor and
  //     the missing indices, plus a summary of other incomplete groups), have
  //     ndim >= 1 and the same dtype and dims after 0 (INVALID_ARGUMENT
  //     naming both parts with their shapes and dtypes).
  //  4. With `expected`: a served name not in it is unexpected — dropped and
  //     reported when !strict, else INVALID_ARGUMENT listing them summarized.
  //     A served shape different from the expected one is INVALID_ARGUMENT
  //     naming both shapes (the expected dtype is not checked for present
  //     tensors). An expected key that nothing serves is zero-filled (0 parts,
  //     the expected shape, the expected dtype or else the most common dtype
  //     among the checkpoint's floating tensors, F32 when there are none) if
  //     it contains an allow_new substring; otherwise FAILED_PRECONDITION
  //     listing the missing keys summarized.
  //     Every served name is checked for control characters, a merged dim 0
  //     for int64 overflow, and every served shape with CheckShapeFits at
  //     kMaxDTypeSize (INVALID_ARGUMENT naming the served tensor), so no
  //     size computed from a plan later can overflow.
  //  5. placements / dtype_rules / quantize: first match on the served name.
  //     A dtype rule naming a dtype the stored one cannot be cast to
  //     (CanCast), a quantize rule matching a non-floating tensor, or a
  //     quantize companion "<name>_scale" colliding with a served name is
  //     INVALID_ARGUMENT naming the rule.
  absl::StatusOr<ServedLayout> Map(
      absl::Span<const SourceTensorInfo> checkpoint) const;

  // No profile: every tensor served under its own name, one part, no rules.
  static ServedLayout Identity(absl::Span<const SourceTensorInfo> checkpoint);

  // The profile's "default_placements" (nullopt when absent).
  const std::optional<std::vector<Placement>>& default_placements() const {
    return default_placements_;
  }
  bool strict() const { return strict_; }
  bool has_expected() const { return expected_.has_value(); }

 private:
  friend class profile_internal::Parser;
  friend class profile_internal::Mapper;

  struct NameRule {
    std::shared_ptr<const re2::RE2> re;
    std::string target;
    int submatches = 1;  // 1 + the highest \N the target uses
    int64_t merge_index = 0;
    int64_t num_merges = 1;
  };
  struct PlacementRule {
    std::shared_ptr<const re2::RE2> re;
    std::vector<Placement> placements;
    bool per_part = false;
  };
  struct DTypeRule {
    std::shared_ptr<const re2::RE2> re;
    DType dtype;
  };
  struct QuantizeRule {
    std::shared_ptr<const re2::RE2> re;
  };
  struct ExpectedTensor {
    std::vector<int64_t> shape;
    std::optional<DType> dtype;
  };

  std::vector<NameRule> name_mapping_;
  std::vector<PlacementRule> placement_rules_;
  std::vector<DTypeRule> dtype_rules_;
  std::vector<QuantizeRule> quantize_rules_;
  std::optional<std::vector<Placement>> default_placements_;
  std::optional<std::map<std::string, ExpectedTensor>> expected_;
  bool strict_ = true;
  std::vector<std::string> allow_new_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PROFILE_PROFILE_H_
