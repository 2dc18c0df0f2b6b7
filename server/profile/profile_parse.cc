// Profile::Parse: the profile document (see profile.h) read one top-level
// key at a time, each by its own method of profile_internal::Parser, in the
// order profile.h lists them (placements after name_mapping: per_part looks
// at the merges). Every problem is INVALID_ARGUMENT naming the rule and field
// ("name_mapping[2].match: bad regex ..."), so the messages already say
// where they rose; nothing is added to them on the way up.
#include <re2/re2.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/json_depth.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "nlohmann/json.hpp"
#include "server/profile/profile.h"
#include "server/profile/profile_internal.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using profile_internal::Quote;

constexpr absl::string_view kQuantizeScheme = "fp8_e4m3_per_tensor";
constexpr int64_t kMaxNumMerges = 65536;
constexpr size_t kMaxMeshDims = 8;

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

// object[key], which must be there: "<where>.<key>: required" otherwise.
absl::StatusOr<const json*> RequiredKey(const json& object,
                                        absl::string_view where,
                                        absl::string_view key) {
  const json* value = FindKey(object, key);
  if (value == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(Field(where, key), ": required"));
  }
  return value;
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
  if (!dtype.ok()) return Annotate(dtype.status(), field);
  if (!dtype->has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", Quote(text), " is not allowed here; name a dtype"));
  }
  return **dtype;
}

// The document as a JSON object: checked for depth before the parser (so
// nothing below walks a deep document), then parsed without exceptions.
absl::StatusOr<json> ParseDocument(absl::string_view text) {
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
  return doc;
}

// Calls `parse(rule, where)` on every element of the rule list doc[key]
// (absent: none), `where` being "<key>[i]", once the element is known to be
// an object with only `allowed` keys.
template <typename ParseRule>
absl::Status ForEachRule(const json& doc, absl::string_view key,
                         std::initializer_list<absl::string_view> allowed,
                         ParseRule parse) {
  if (FindKey(doc, key) == nullptr) return absl::OkStatus();
  WD_ASSIGN_OR_RETURN(const json* rules, RequiredArray(doc, key));
  for (size_t i = 0; i < rules->size(); ++i) {
    const json& rule = (*rules)[i];
    const std::string where = Index(key, i);
    if (!rule.is_object()) return WrongType(where, "an object", rule);
    WD_RETURN_IF_ERROR(CheckKeys(rule, where, allowed));
    WD_RETURN_IF_ERROR(parse(rule, where));
  }
  return absl::OkStatus();
}

}  // namespace

namespace profile_internal {

// Fills a Profile from a checked document, one method per top-level key;
// each leaves the profile as it is when its key is absent.
class Parser {
 public:
  static absl::StatusOr<Profile> Parse(const json& doc) {
    Parser parser;
    WD_RETURN_IF_ERROR(parser.NameMapping(doc));
    WD_RETURN_IF_ERROR(parser.Placements(doc));
    WD_RETURN_IF_ERROR(parser.DefaultPlacements(doc));
    WD_RETURN_IF_ERROR(parser.DTypeRules(doc));
    WD_RETURN_IF_ERROR(parser.Quantize(doc));
    WD_RETURN_IF_ERROR(parser.Expected(doc));
    WD_RETURN_IF_ERROR(parser.Strict(doc));
    WD_RETURN_IF_ERROR(parser.AllowNew(doc));
    return std::move(parser.profile_);
  }

 private:
  using NameRule = Profile::NameRule;
  using PlacementRule = Profile::PlacementRule;
  using ExpectedTensor = Profile::ExpectedTensor;

  absl::Status NameMapping(const json& doc);
  absl::Status Placements(const json& doc);
  absl::Status DefaultPlacements(const json& doc);
  absl::Status DTypeRules(const json& doc);
  absl::Status Quantize(const json& doc);
  absl::Status Expected(const json& doc);
  absl::Status Strict(const json& doc);
  absl::Status AllowNew(const json& doc);

  // Parts of one rule or entry; `where` names it ("name_mapping[2]").
  static absl::Status ParseTarget(const json& rule, const std::string& where,
                                  NameRule& out);
  static absl::Status ParseMerge(const json& rule, const std::string& where,
                                 NameRule& out);
  static absl::StatusOr<PlacementRule> ParsePlacementRule(
      const json& rule, const std::string& where);
  static absl::StatusOr<ExpectedTensor> ParseExpectedTensor(
      const json& entry, const std::string& where);
  static absl::StatusOr<std::vector<int64_t>> ParseExpectedShape(
      const json& entry, const std::string& where);

  Profile profile_;
};

absl::Status Parser::NameMapping(const json& doc) {
  return ForEachRule(
      doc, "name_mapping", {"match", "target", "merge_index", "num_merges"},
      [this](const json& rule, const std::string& where) -> absl::Status {
        NameRule out;
        WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
        WD_RETURN_IF_ERROR(ParseTarget(rule, where, out));
        WD_RETURN_IF_ERROR(ParseMerge(rule, where, out));
        profile_.name_mapping_.push_back(std::move(out));
        return absl::OkStatus();
      });
}

// The rewrite target: not empty, valid for the pattern, and how many
// submatches it uses.
absl::Status Parser::ParseTarget(const json& rule, const std::string& where,
                                 NameRule& out) {
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
  return absl::OkStatus();
}

// num_merges (1..kMaxNumMerges) and merge_index (required when > 1).
absl::Status Parser::ParseMerge(const json& rule, const std::string& where,
                                NameRule& out) {
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
  return absl::OkStatus();
}

absl::Status Parser::Placements(const json& doc) {
  WD_RETURN_IF_ERROR(ForEachRule(
      doc, "placements", {"match", "placements", "per_part"},
      [this](const json& rule, const std::string& where) -> absl::Status {
        WD_ASSIGN_OR_RETURN(PlacementRule out, ParsePlacementRule(rule, where));
        profile_.placement_rules_.push_back(std::move(out));
        return absl::OkStatus();
      }));
  const bool any_merge =
      std::any_of(profile_.name_mapping_.begin(), profile_.name_mapping_.end(),
                  [](const NameRule& r) { return r.num_merges > 1; });
  for (size_t i = 0; i < profile_.placement_rules_.size(); ++i) {
    if (profile_.placement_rules_[i].per_part && !any_merge) {
      return absl::InvalidArgumentError(absl::StrCat(
          Index("placements", i),
          ": per_part needs a target made by a merge rule (no name_mapping "
          "rule has num_merges > 1)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Profile::PlacementRule> Parser::ParsePlacementRule(
    const json& rule, const std::string& where) {
  PlacementRule out;
  WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
  WD_ASSIGN_OR_RETURN(const json* list, RequiredKey(rule, where, "placements"));
  WD_ASSIGN_OR_RETURN(out.placements,
                      PlacementList(*list, Field(where, "placements")));
  if (const json* v = FindKey(rule, "per_part")) {
    WD_ASSIGN_OR_RETURN(out.per_part, Boolean(*v, Field(where, "per_part")));
  }
  return out;
}

absl::Status Parser::DefaultPlacements(const json& doc) {
  if (const json* v = FindKey(doc, "default_placements")) {
    WD_ASSIGN_OR_RETURN(profile_.default_placements_,
                        PlacementList(*v, "default_placements"));
  }
  return absl::OkStatus();
}

absl::Status Parser::DTypeRules(const json& doc) {
  return ForEachRule(
      doc, "dtype_rules", {"match", "dtype"},
      [this](const json& rule, const std::string& where) -> absl::Status {
        Profile::DTypeRule out;
        WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
        WD_ASSIGN_OR_RETURN(const json* dtype, RequiredKey(rule, where, "dtype"));
        WD_ASSIGN_OR_RETURN(out.dtype,
                            RuleDType(*dtype, Field(where, "dtype")));
        profile_.dtype_rules_.push_back(std::move(out));
        return absl::OkStatus();
      });
}

absl::Status Parser::Quantize(const json& doc) {
  return ForEachRule(
      doc, "quantize", {"match", "scheme"},
      [this](const json& rule, const std::string& where) -> absl::Status {
        Profile::QuantizeRule out;
        WD_ASSIGN_OR_RETURN(out.re, CompileMatch(rule, where));
        WD_ASSIGN_OR_RETURN(std::string scheme,
                            RequiredString(rule, where, "scheme"));
        if (scheme != kQuantizeScheme) {
          return absl::InvalidArgumentError(absl::StrCat(
              Field(where, "scheme"), ": unknown scheme ", Quote(scheme),
              " (expected ", kQuantizeScheme, ")"));
        }
        profile_.quantize_rules_.push_back(std::move(out));
        return absl::OkStatus();
      });
}

absl::Status Parser::Expected(const json& doc) {
  const json* expected = FindKey(doc, "expected");
  if (expected == nullptr) return absl::OkStatus();
  if (!expected->is_object()) {
    return WrongType("expected", "an object", *expected);
  }
  profile_.expected_.emplace();
  for (auto it = expected->begin(); it != expected->end(); ++it) {
    const std::string where = absl::StrCat("expected[", Quote(it.key()), "]");
    WD_RETURN_IF_ERROR(CheckNoControlCharacters(it.key(), "expected tensor"));
    WD_ASSIGN_OR_RETURN(ExpectedTensor out,
                        ParseExpectedTensor(it.value(), where));
    profile_.expected_->emplace(it.key(), std::move(out));
  }
  return absl::OkStatus();
}

absl::StatusOr<Profile::ExpectedTensor> Parser::ParseExpectedTensor(
    const json& entry, const std::string& where) {
  if (!entry.is_object()) return WrongType(where, "an object", entry);
  WD_RETURN_IF_ERROR(CheckKeys(entry, where, {"shape", "dtype"}));
  ExpectedTensor out;
  WD_ASSIGN_OR_RETURN(out.shape, ParseExpectedShape(entry, where));
  if (const json* dtype = FindKey(entry, "dtype")) {
    WD_ASSIGN_OR_RETURN(out.dtype, RuleDType(*dtype, Field(where, "dtype")));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> Parser::ParseExpectedShape(
    const json& entry, const std::string& where) {
  WD_ASSIGN_OR_RETURN(const json* shape, RequiredKey(entry, where, "shape"));
  const std::string shape_field = Field(where, "shape");
  if (!shape->is_array()) return WrongType(shape_field, "an array", *shape);
  if (shape->size() > static_cast<size_t>(kMaxTensorRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat(shape_field, ": has ", shape->size(), " dims (more than ",
                     kMaxTensorRank, " dims)"));
  }
  std::vector<int64_t> out;
  for (size_t d = 0; d < shape->size(); ++d) {
    const std::string dim_field = Index(shape_field, d);
    WD_ASSIGN_OR_RETURN(int64_t dim, Integer((*shape)[d], dim_field));
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(dim_field, ": ", dim, " must be >= 0"));
    }
    out.push_back(dim);
  }
  // In the widest dtype: the tensor may be served cast to any. Checked
  // here, before anything sizes a table or a budget request from it.
  if (absl::Status fits = CheckShapeFits(out, kMaxDTypeSize); !fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        shape_field, ": ", absl::StripPrefix(fits.message(), "shape ")));
  }
  return out;
}

absl::Status Parser::Strict(const json& doc) {
  if (const json* v = FindKey(doc, "strict")) {
    WD_ASSIGN_OR_RETURN(profile_.strict_, Boolean(*v, "strict"));
  }
  return absl::OkStatus();
}

absl::Status Parser::AllowNew(const json& doc) {
  if (FindKey(doc, "allow_new") == nullptr) return absl::OkStatus();
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
    profile_.allow_new_.push_back(std::move(s));
  }
  return absl::OkStatus();
}

}  // namespace profile_internal

absl::StatusOr<Profile> Profile::Parse(absl::string_view text) {
  WD_ASSIGN_OR_RETURN(json doc, ParseDocument(text));
  return profile_internal::Parser::Parse(doc);
}

}  // namespace weightd
