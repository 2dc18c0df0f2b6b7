#include "server/profile/profile.h"

#include <re2/re2.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
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
#include "absl/strings/strip.h"
#include "common/json_depth.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "nlohmann/json.hpp"
#include "server/profile/name_summary.h"

namespace weightd {
namespace {

using json = nlohmann::json;

constexpr absl::string_view kExtraStateSuffix = "_extra_state";
constexpr absl::string_view kQuantizeScheme = "fp8_e4m3_per_tensor";
constexpr int64_t kMaxNumMerges = 65536;
constexpr size_t kMaxMeshDims = 8;
// RE2 rewrites use \0..\9.
constexpr int kMaxSubmatches = 10;

// Builds the DOM without throwing and keeps the parser's message (which
// carries line and column) for the error.
class ErrorRecordingSax : public nlohmann::detail::json_sax_dom_parser<json> {
 public:
  explicit ErrorRecordingSax(json& root)
      : nlohmann::detail::json_sax_dom_parser<json>(
            root, /*allow_exceptions_=*/false) {}

  template <class Exception>
  bool parse_error(std::size_t position, const std::string& last_token,
                   const Exception& ex) {
    // nlohmann quotes the last token read, which may be a whole string.
    error_ = TruncateMessage(ex.what(), 4 * kMaxQuotedBytes);
    return nlohmann::detail::json_sax_dom_parser<json>::parse_error(
        position, last_token, ex);
  }

  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

// Names and patterns come from users. Short printable text is quoted as is
// (patterns read best unescaped); anything long or with control characters
// is capped and escaped.
std::string Quote(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes &&
      FindControlCharacter(text) == absl::string_view::npos) {
    return absl::StrCat("\"", text, "\"");
  }
  return QuoteForMessage(text);
}

std::string Field(absl::string_view where, absl::string_view key) {
  if (where.empty()) return std::string(key);
  return absl::StrCat(where, ".", key);
}

std::string Index(absl::string_view where, size_t i) {
  return absl::StrCat(where, "[", i, "]");
}

const char* JsonTypeName(const json& j) { return j.type_name(); }

absl::Status WrongType(absl::string_view field, absl::string_view wanted,
                       const json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be ", wanted, ", not ", JsonTypeName(got)));
}

absl::Status CheckKeys(const json& object, absl::string_view where,
                       std::initializer_list<absl::string_view> allowed) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) {
      continue;
    }
    if (where.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown top-level key ", Quote(key), " (expected ",
                       absl::StrJoin(allowed, ", "), ")"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unknown key ", Quote(key), " (expected ",
                     absl::StrJoin(allowed, ", "), ")"));
  }
  return absl::OkStatus();
}

const json* FindKey(const json& object, absl::string_view key) {
  auto it = object.find(std::string(key));
  return it == object.end() ? nullptr : &*it;
}

absl::StatusOr<std::string> RequiredString(const json& object,
                                           absl::string_view where,
                                           absl::string_view key) {
  const json* value = FindKey(object, key);
  const std::string field = Field(where, key);
  if (value == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  }
  if (!value->is_string()) return WrongType(field, "a string", *value);
  return value->get<std::string>();
}

absl::StatusOr<int64_t> Integer(const json& value, absl::string_view field) {
  if (!value.is_number_integer()) return WrongType(field, "an integer", value);
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", value.dump(), " is too large"));
  }
  return value.get<int64_t>();
}

absl::StatusOr<bool> Boolean(const json& value, absl::string_view field) {
  if (!value.is_boolean()) return WrongType(field, "a boolean", value);
  return value.get<bool>();
}

absl::StatusOr<const json*> RequiredArray(const json& doc,
                                          absl::string_view key) {
  const json& value = *FindKey(doc, key);
  if (!value.is_array()) return WrongType(key, "an array", value);
  return &value;
}

absl::StatusOr<std::shared_ptr<const re2::RE2>> CompileMatch(
    const json& rule, absl::string_view where) {
  WD_ASSIGN_OR_RETURN(std::string pattern,
                      RequiredString(rule, where, "match"));
  re2::RE2::Options options;
  options.set_log_errors(false);
  auto re = std::make_shared<const re2::RE2>(
      re2::StringPiece(pattern.data(), pattern.size()), options);
  if (!re->ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Field(where, "match"), ": bad regex ", Quote(pattern),
                     ": ", re->error()));
  }
  return re;
}

bool FullMatch(const re2::RE2& re, absl::string_view name) {
  return re2::RE2::FullMatch(re2::StringPiece(name.data(), name.size()), re);
}

absl::StatusOr<std::vector<Placement>> PlacementList(const json& value,
                                                     absl::string_view field) {
  if (!value.is_array()) return WrongType(field, "an array", value);
  if (value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must not be empty (one entry per mesh dim)"));
  }
  if (value.size() > kMaxMeshDims) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", value.size(),
                                                   " entries; at most ",
                                                   kMaxMeshDims, " mesh dims"));
  }
  std::vector<Placement> out;
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string entry = Index(field, i);
    if (!value[i].is_string()) return WrongType(entry, "a string", value[i]);
    absl::StatusOr<Placement> p = ParsePlacement(value[i].get<std::string>());
    if (!p.ok()) {
      absl::string_view message = p.status().message();
      std::string text(message);
      if (absl::ConsumePrefix(&message, "invalid placement ")) {
        text = absl::StrCat("bad placement ", message);
      }
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", text));
    }
    out.push_back(*p);
  }
  return out;
}

// A dtype named in a rule or an expected entry: "keep" means nothing there.
absl::StatusOr<DType> RuleDType(const json& value, absl::string_view field) {
  if (!value.is_string()) return WrongType(field, "a string", value);
  const std::string text = value.get<std::string>();
  absl::StatusOr<std::optional<DType>> dtype = ParseRequestDType(text);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", dtype.status().message()));
  }
  if (!dtype->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", Quote(text), " is not allowed here; name a dtype"));
  }
  return **dtype;
}

bool EndsWithExtraState(absl::string_view name) {
  return absl::EndsWith(name, kExtraStateSuffix);
}

}  // namespace

// --- ProfileReport / ServedLayout ------------------------------------------

std::vector<std::string> ProfileReport::Summary() const {
  std::vector<std::string> lines;
  auto section = [&lines](const std::vector<std::string>& names,
                          absl::string_view what) {
    if (names.empty()) return;
    lines.push_back(absl::StrCat(names.size(), " ", what, ":"));
    for (std::string& line : SummarizeNames(names)) {
      lines.push_back(absl::StrCat("  ", line));
    }
  };
  section(skipped_extra_state, "*_extra_state checkpoint key(s) skipped");
  section(unexpected, "unexpected tensor(s) skipped (not in expected)");
  section(zero_filled, "missing tensor(s) zero-filled (allow_new)");
  return lines;
}

const ServedTensorPlan* ServedLayout::Find(absl::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const ServedTensorPlan& t,
                                absl::string_view n) { return t.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

// --- Parse -------------------------------------------------------------------

Profile::Profile() = default;

absl::StatusOr<Profile> Profile::Parse(absl::string_view text) {
  // Before the parser: nothing below walks a deep document.
  WD_RETURN_IF_ERROR(CheckJsonDepth(text, "profile"));
  json doc;
  ErrorRecordingSax sax(doc);
  if (!json::sax_parse(text.begin(), text.end(), &sax)) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile is not valid JSON: ", sax.error()));
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile: must be a JSON object, not ", JsonTypeName(doc)));
  }
  WD_RETURN_IF_ERROR(CheckKeys(
      doc, "",
      {"name_mapping", "placements", "default_placements", "dtype_rules",
       "quantize", "expected", "strict", "allow_new"}));

  Profile profile;

  if (FindKey(doc, "name_mapping") != nullptr) {
    WD_ASSIGN_OR_RETURN(const json* rules, RequiredArray(doc, "name_mapping"));
    for (size_t i = 0; i < rules->size(); ++i) {
      const json& rule = (*rules)[i];
      const std::string where = Index("name_mapping", i);
      if (!rule.is_object()) return WrongType(where, "an object", rule);
      WD_RETURN_IF_ERROR(CheckKeys(
          rule, where, {"match", "target", "merge_index", "num_merges"}));
      NameRule out;
      WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
      WD_ASSIGN_OR_RETURN(out.target, RequiredString(rule, where, "target"));
      if (out.target.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Field(where, "target"), ": must not be empty"));
      }
      std::string rewrite_error;
      if (!out.re->CheckRewriteString(
              re2::StringPiece(out.target.data(), out.target.size()),
              &rewrite_error)) {
        return absl::InvalidArgumentError(
            absl::StrCat(Field(where, "target"), ": bad target ",
                         Quote(out.target), ": ", rewrite_error));
      }
      out.submatches = 1 + re2::RE2::MaxSubmatch(re2::StringPiece(
                               out.target.data(), out.target.size()));
      if (const json* v = FindKey(rule, "num_merges")) {
        WD_ASSIGN_OR_RETURN(out.num_merges,
                            Integer(*v, Field(where, "num_merges")));
        if (out.num_merges < 1 || out.num_merges > kMaxNumMerges) {
          return absl::InvalidArgumentError(
              absl::StrCat(Field(where, "num_merges"), ": ", out.num_merges,
                           " is out of range 1..", kMaxNumMerges));
        }
      }
      if (const json* v = FindKey(rule, "merge_index")) {
        WD_ASSIGN_OR_RETURN(out.merge_index,
                            Integer(*v, Field(where, "merge_index")));
        if (out.merge_index < 0 || out.merge_index >= out.num_merges) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": merge_index ", out.merge_index,
                           " is out of range for num_merges ", out.num_merges));
        }
      } else if (out.num_merges > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": merge_index is required when num_merges > 1"));
      }
      profile.name_mapping_.push_back(std::move(out));
    }
  }

  if (FindKey(doc, "placements") != nullptr) {
    WD_ASSIGN_OR_RETURN(const json* rules, RequiredArray(doc, "placements"));
    for (size_t i = 0; i < rules->size(); ++i) {
      const json& rule = (*rules)[i];
      const std::string where = Index("placements", i);
      if (!rule.is_object()) return WrongType(where, "an object", rule);
      WD_RETURN_IF_ERROR(
          CheckKeys(rule, where, {"match", "placements", "per_part"}));
      PlacementRule out;
      WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
      const json* list = FindKey(rule, "placements");
      if (list == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(Field(where, "placements"), ": required"));
      }
      WD_ASSIGN_OR_RETURN(out.placements,
                          PlacementList(*list, Field(where, "placements")));
      if (const json* v = FindKey(rule, "per_part")) {
        WD_ASSIGN_OR_RETURN(out.per_part,
                            Boolean(*v, Field(where, "per_part")));
      }
      profile.placement_rules_.push_back(std::move(out));
    }
    const bool any_merge =
        std::any_of(profile.name_mapping_.begin(), profile.name_mapping_.end(),
                    [](const NameRule& r) { return r.num_merges > 1; });
    for (size_t i = 0; i < profile.placement_rules_.size(); ++i) {
      if (profile.placement_rules_[i].per_part && !any_merge) {
        return absl::InvalidArgumentError(absl::StrCat(
            Index("placements", i),
            ": per_part needs a target made by a merge rule (no name_mapping "
            "rule has num_merges > 1)"));
      }
    }
  }

  if (const json* v = FindKey(doc, "default_placements")) {
    WD_ASSIGN_OR_RETURN(profile.default_placements_,
                        PlacementList(*v, "default_placements"));
  }

  if (FindKey(doc, "dtype_rules") != nullptr) {
    WD_ASSIGN_OR_RETURN(const json* rules, RequiredArray(doc, "dtype_rules"));
    for (size_t i = 0; i < rules->size(); ++i) {
      const json& rule = (*rules)[i];
      const std::string where = Index("dtype_rules", i);
      if (!rule.is_object()) return WrongType(where, "an object", rule);
      WD_RETURN_IF_ERROR(CheckKeys(rule, where, {"match", "dtype"}));
      DTypeRule out;
      WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
      const json* dtype = FindKey(rule, "dtype");
      if (dtype == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(Field(where, "dtype"), ": required"));
      }
      WD_ASSIGN_OR_RETURN(out.dtype, RuleDType(*dtype, Field(where, "dtype")));
      profile.dtype_rules_.push_back(std::move(out));
    }
  }

  if (FindKey(doc, "quantize") != nullptr) {
    WD_ASSIGN_OR_RETURN(const json* rules, RequiredArray(doc, "quantize"));
    for (size_t i = 0; i < rules->size(); ++i) {
      const json& rule = (*rules)[i];
      const std::string where = Index("quantize", i);
      if (!rule.is_object()) return WrongType(where, "an object", rule);
      WD_RETURN_IF_ERROR(CheckKeys(rule, where, {"match", "scheme"}));
      QuantizeRule out;
      WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
      WD_ASSIGN_OR_RETURN(std::string scheme,
                          RequiredString(rule, where, "scheme"));
      if (scheme != kQuantizeScheme) {
        return absl::InvalidArgumentError(
            absl::StrCat(Field(where, "scheme"), ": unknown scheme ",
                         Quote(scheme), " (expected ", kQuantizeScheme, ")"));
      }
      profile.quantize_rules_.push_back(std::move(out));
    }
  }

  if (const json* expected = FindKey(doc, "expected")) {
    if (!expected->is_object()) {
      return WrongType("expected", "an object", *expected);
    }
    profile.expected_.emplace();
    for (auto it = expected->begin(); it != expected->end(); ++it) {
      const std::string where = absl::StrCat("expected[", Quote(it.key()), "]");
      WD_RETURN_IF_ERROR(CheckNoControlCharacters(it.key(), "expected tensor"));
      const json& entry = it.value();
      if (!entry.is_object()) return WrongType(where, "an object", entry);
      WD_RETURN_IF_ERROR(CheckKeys(entry, where, {"shape", "dtype"}));
      ExpectedTensor out;
      const json* shape = FindKey(entry, "shape");
      const std::string shape_field = Field(where, "shape");
      if (shape == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(shape_field, ": required"));
      }
      if (!shape->is_array()) return WrongType(shape_field, "an array", *shape);
      if (shape->size() > static_cast<size_t>(kMaxTensorRank)) {
        return absl::InvalidArgumentError(
            absl::StrCat(shape_field, ": has ", shape->size(),
                         " dims (more than ", kMaxTensorRank, " dims)"));
      }
      for (size_t d = 0; d < shape->size(); ++d) {
        const std::string dim_field = Index(shape_field, d);
        WD_ASSIGN_OR_RETURN(int64_t dim, Integer((*shape)[d], dim_field));
        if (dim < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(dim_field, ": ", dim, " must be >= 0"));
        }
        out.shape.push_back(dim);
      }
      // In the widest dtype: the tensor may be served cast to any. Checked
      // here, before anything sizes a table or a budget request from it.
      if (absl::Status fits = CheckShapeFits(out.shape, kMaxDTypeSize);
          !fits.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(shape_field, ": ",
                         absl::StripPrefix(fits.message(), "shape ")));
      }
      if (const json* dtype = FindKey(entry, "dtype")) {
        WD_ASSIGN_OR_RETURN(out.dtype,
                            RuleDType(*dtype, Field(where, "dtype")));
      }
      profile.expected_->emplace(it.key(), std::move(out));
    }
  }

  if (const json* v = FindKey(doc, "strict")) {
    WD_ASSIGN_OR_RETURN(profile.strict_, Boolean(*v, "strict"));
  }

  if (FindKey(doc, "allow_new") != nullptr) {
    WD_ASSIGN_OR_RETURN(const json* list, RequiredArray(doc, "allow_new"));
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string field = Index("allow_new", i);
      const json& v = (*list)[i];
      if (!v.is_string()) return WrongType(field, "a string", v);
      std::string s = v.get<std::string>();
      if (s.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": must not be empty (it would allow every name)"));
      }
      profile.allow_new_.push_back(std::move(s));
    }
  }

  return profile;
}

// --- Map ---------------------------------------------------------------------

namespace {

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

}  // namespace

absl::StatusOr<ServedLayout> Profile::Map(
    absl::Span<const SourceTensorInfo> checkpoint) const {
  ServedLayout layout;
  ProfileReport& report = layout.report;
  const bool with_expected = expected_.has_value();

  // 1-2. Route every checkpoint tensor to its served name.
  std::map<std::string, std::vector<Routed>> groups;
  std::array<re2::StringPiece, kMaxSubmatches> submatch;
  for (size_t i = 0; i < checkpoint.size(); ++i) {
    const std::string& source = checkpoint[i].name;
    if (with_expected && EndsWithExtraState(source)) {
      report.skipped_extra_state.push_back(source);
      continue;
    }
    Routed routed{i};
    std::string served = source;
    const re2::StringPiece text(source.data(), source.size());
    for (size_t r = 0; r < name_mapping_.size(); ++r) {
      const NameRule& rule = name_mapping_[r];
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
      served = std::move(target);
      routed.rule = static_cast<int>(r);
      routed.merge_index = rule.merge_index;
      routed.num_merges = rule.num_merges;
      break;
    }
    if (with_expected && EndsWithExtraState(served)) {
      report.skipped_extra_state.push_back(source);
      continue;
    }
    groups[std::move(served)].push_back(routed);
  }

  // 3-4. Build a plan per served name.
  std::vector<IncompleteGroup> incomplete;
  for (auto& [served, sources] : groups) {
    // A target may put into a name what the checkpoint parser refuses.
    WD_RETURN_IF_ERROR(CheckNoControlCharacters(served, "served tensor"));
    const ExpectedTensor* expected = nullptr;
    if (with_expected) {
      auto it = expected_->find(served);
      if (it == expected_->end()) {
        report.unexpected.push_back(served);
        continue;
      }
      expected = &it->second;
    }

    const bool merged = sources.front().num_merges > 1;
    for (size_t k = 1; k < sources.size(); ++k) {
      const Routed& a = sources.front();
      const Routed& b = sources[k];
      if (!merged || b.num_merges <= 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint tensors ", Describe(a, checkpoint), " and ",
            Describe(b, checkpoint), " both map to served tensor ",
            Quote(served), " and are not parts of one merge"));
      }
      if (a.num_merges != b.num_merges) {
        return absl::InvalidArgumentError(
            absl::StrCat("served tensor ", Quote(served), ": merge parts ",
                         Describe(a, checkpoint), " and ",
                         Describe(b, checkpoint), " disagree on num_merges"));
      }
    }

    std::sort(sources.begin(), sources.end(),
              [](const Routed& a, const Routed& b) {
                if (a.merge_index != b.merge_index) {
                  return a.merge_index < b.merge_index;
                }
                return a.index < b.index;
              });
    if (merged) {
      for (size_t k = 1; k < sources.size(); ++k) {
        if (sources[k].merge_index == sources[k - 1].merge_index) {
          return absl::InvalidArgumentError(absl::StrCat(
              "served tensor ", Quote(served), ": ",
              Describe(sources[k - 1], checkpoint), " and ",
              Describe(sources[k], checkpoint), " have the same merge_index ",
              sources[k].merge_index));
        }
      }
      const int64_t num_merges = sources.front().num_merges;
      if (static_cast<int64_t>(sources.size()) != num_merges) {
        IncompleteGroup group{served, {}, num_merges, {}};
        size_t next = 0;
        for (int64_t m = 0; m < num_merges; ++m) {
          if (next < sources.size() && sources[next].merge_index == m) {
            group.present.push_back(
                absl::StrCat(Quote(checkpoint[sources[next].index].name),
                             " (merge_index ", m, ")"));
            ++next;
          } else {
            group.missing.push_back(m);
          }
        }
        incomplete.push_back(std::move(group));
        continue;
      }
    }

    ServedTensorPlan plan;
    plan.name = served;
    const SourceTensorInfo& first = checkpoint[sources.front().index];
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
      const SourceTensorInfo& part = checkpoint[r.index];
      if (merged) {
        const bool same_dims =
            part.shape.size() == first.shape.size() &&
            std::equal(
                part.shape.begin() + std::min<size_t>(1, part.shape.size()),
                part.shape.end(), first.shape.begin() + 1);
        if (part.dtype != first.dtype || !same_dims) {
          return absl::InvalidArgumentError(absl::StrCat(
              "served tensor ", Quote(served), ": merge parts ",
              DescribeTensor(first), " and ", DescribeTensor(part),
              " must have the same dtype and the same dims after dim 0"));
        }
        if (part.shape[0] >
            std::numeric_limits<int64_t>::max() - plan.shape[0]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "served tensor ", Quote(served), ": merged dim 0 overflows int64 (",
              plan.shape[0], " rows, then ", DescribeTensor(part), ")"));
        }
        plan.shape[0] += part.shape[0];
      }
      plan.parts.push_back(ServedPart{part.name});
      plan.part_rows.push_back(part.shape.empty() ? 1 : part.shape[0]);
    }
    if (absl::Status fits = CheckShapeFits(plan.shape, kMaxDTypeSize);
        !fits.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "served tensor ", Quote(served), ": ", fits.message()));
    }
    if (expected != nullptr && expected->shape != plan.shape) {
      std::vector<std::string> names;
      for (const ServedPart& p : plan.parts) names.push_back(Quote(p.source));
      return absl::InvalidArgumentError(absl::StrCat(
          "served tensor ", Quote(served), " (from ",
          absl::StrJoin(names, ", "), ") has shape ", ShapeString(plan.shape),
          " but expected shape is ", ShapeString(expected->shape)));
    }
    layout.tensors.push_back(std::move(plan));
  }

  if (!incomplete.empty()) {
    const IncompleteGroup& g = incomplete.front();
    std::string message = absl::StrCat(
        "merge group ", Quote(g.served), " is incomplete: missing merge_index ",
        FormatIntegerSet(g.missing), " of num_merges ", g.num_merges, " (have ",
        absl::StrJoin(g.present, ", "), ")");
    if (incomplete.size() > 1) {
      std::vector<std::string> others;
      for (size_t i = 1; i < incomplete.size(); ++i) {
        others.push_back(incomplete[i].served);
      }
      absl::StrAppend(
          &message, "; ", others.size(),
          " more incomplete merge group(s): ", SummarizeNamesInline(others));
    }
    return absl::FailedPreconditionError(message);
  }

  if (with_expected) {
    std::vector<std::string> missing;
    std::vector<ServedTensorPlan> zero_filled;
    std::optional<DType> default_dtype;
    for (const auto& [name, expected] : *expected_) {
      if (EndsWithExtraState(name) || groups.contains(name)) continue;
      const bool allowed = std::any_of(allow_new_.begin(), allow_new_.end(),
                                       [&name = name](const std::string& s) {
                                         return absl::StrContains(name, s);
                                       });
      if (!allowed) {
        missing.push_back(name);
        continue;
      }
      if (!default_dtype.has_value()) {
        std::array<size_t, kNumDTypes> counts{};
        for (const SourceTensorInfo& t : checkpoint) {
          if (IsFloating(t.dtype)) ++counts[static_cast<size_t>(t.dtype)];
        }
        default_dtype = DType::kF32;
        size_t best = 0;
        for (int d = 0; d < kNumDTypes; ++d) {
          if (counts[d] > best) {
            best = counts[d];
            default_dtype = static_cast<DType>(d);
          }
        }
      }
      ServedTensorPlan plan;
      plan.name = name;
      plan.dtype = expected.dtype.value_or(*default_dtype);
      plan.shape = expected.shape;
      zero_filled.push_back(std::move(plan));
      report.zero_filled.push_back(name);
    }
    if (strict_ && !report.unexpected.empty()) {
      std::string message =
          absl::StrCat(report.unexpected.size(),
                       " served tensor(s) not in expected (strict): ",
                       SummarizeNamesInline(report.unexpected));
      if (!missing.empty()) {
        absl::StrAppend(
            &message, "; also ", missing.size(),
            " expected tensor(s) missing: ", SummarizeNamesInline(missing));
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
    for (ServedTensorPlan& plan : zero_filled) {
      layout.tensors.push_back(std::move(plan));
    }
    std::sort(layout.tensors.begin(), layout.tensors.end(),
              [](const ServedTensorPlan& a, const ServedTensorPlan& b) {
                return a.name < b.name;
              });
  }

  // 5. Per-served-tensor rules.
  for (ServedTensorPlan& plan : layout.tensors) {
    for (const PlacementRule& rule : placement_rules_) {
      if (!FullMatch(*rule.re, plan.name)) continue;
      plan.placements = rule.placements;
      plan.per_part = rule.per_part && plan.parts.size() > 1;
      break;
    }
    for (size_t r = 0; r < dtype_rules_.size(); ++r) {
      const DTypeRule& rule = dtype_rules_[r];
      if (!FullMatch(*rule.re, plan.name)) continue;
      if (!CanCast(plan.dtype, rule.dtype)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dtype_rules[", r, "]: cannot cast ", Quote(plan.name), " from ",
            DTypeName(plan.dtype), " to ", DTypeName(rule.dtype)));
      }
      plan.dtype_override = rule.dtype;
      break;
    }
    for (size_t r = 0; r < quantize_rules_.size(); ++r) {
      if (!FullMatch(*quantize_rules_[r].re, plan.name)) continue;
      if (!IsFloating(plan.dtype)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "quantize[", r, "]: ", Quote(plan.name), " is ",
            DTypeName(plan.dtype), "; only floating tensors can be quantized"));
      }
      plan.quantize_fp8 = true;
      break;
    }
  }
  for (const ServedTensorPlan& plan : layout.tensors) {
    if (!plan.quantize_fp8) continue;
    const std::string scale = absl::StrCat(plan.name, "_scale");
    if (layout.Find(scale) != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize: the scale companion of ", Quote(plan.name),
          " would be named ", Quote(scale), ", which is already served"));
    }
  }

  for (const ServedTensorPlan& plan : layout.tensors) {
    std::vector<std::string>& sources = layout.reverse[plan.name];
    for (const ServedPart& p : plan.parts) sources.push_back(p.source);
  }
  std::sort(report.skipped_extra_state.begin(),
            report.skipped_extra_state.end());
  return layout;
}

ServedLayout Profile::Identity(absl::Span<const SourceTensorInfo> checkpoint) {
  ServedLayout layout;
  layout.tensors.reserve(checkpoint.size());
  for (const SourceTensorInfo& t : checkpoint) {
    ServedTensorPlan plan;
    plan.name = t.name;
    plan.dtype = t.dtype;
    plan.shape = t.shape;
    plan.parts.push_back(ServedPart{t.name});
    plan.part_rows.push_back(t.shape.empty() ? 1 : t.shape[0]);
    layout.reverse[t.name] = {t.name};
    layout.tensors.push_back(std::move(plan));
  }
  std::sort(layout.tensors.begin(), layout.tensors.end(),
            [](const ServedTensorPlan& a, const ServedTensorPlan& b) {
              return a.name < b.name;
            });
  return layout;
}

}  // namespace weightd
