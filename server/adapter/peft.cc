// The PEFT format: adapter_config.json parsed into a PeftConfig (refusing
// the variants that cannot be merged), and the builder that turns PEFT keys
// into LoRA, DoRA, embedding and bias patches with the config's rank, alpha
// and pattern rules (adapter.h has the whole contract).
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/json_depth.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "nlohmann/json.hpp"
#include "server/adapter/adapter_internal.h"

namespace weightd::adapter_internal {
namespace {

using OrderedJson = nlohmann::ordered_json;  // patterns: first match in file order

// ------------------------------------------------------------------ config

absl::Status ConfigError(const PeftConfig& c, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(c.path, ": ", what));
}

absl::StatusOr<bool> OptionalBool(const PeftConfig& c, const OrderedJson& j,
                                  absl::string_view field, bool dflt) {
  auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) return ConfigError(c, absl::StrCat("\"", field, "\" must be a boolean"));
  return it->get<bool>();
}

bool IsSet(const OrderedJson& j, absl::string_view field) {
  auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) return false;
  if (it->is_boolean()) return it->get<bool>();
  if (it->is_array() || it->is_object() || it->is_string()) return !it->empty();
  return true;
}

// PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", module).
absl::Status ParsePatterns(const PeftConfig& c, const OrderedJson& j, absl::string_view field,
                           bool integer, std::vector<Pattern>* out) {
  auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return ConfigError(c, absl::StrCat("\"", field, "\" must be an object"));
  for (auto p = it->begin(); p != it->end(); ++p) {
    const OrderedJson& v = p.value();
    if (integer ? !v.is_number_integer() : !v.is_number()) {
      return ConfigError(c, absl::StrCat("\"", field, "\" entry ", QuoteForMessage(p.key()), " must be ",
                                         integer ? "an integer" : "a number"));
    }
    Pattern pat;
    pat.key = p.key();
    pat.value = v.get<double>();
    if (integer && pat.value < 1) {
      return ConfigError(c, absl::StrCat("\"", field, "\" entry ", QuoteForMessage(p.key()), " must be >= 1"));
    }
    if (!std::isfinite(pat.value)) {
      return ConfigError(c, absl::StrCat("\"", field, "\" entry ", QuoteForMessage(p.key()), " is not finite"));
    }
    RE2::Options opts;
    opts.set_log_errors(false);
    pat.re = std::make_unique<RE2>(absl::StrCat("(?:.*\\.)?(?:", pat.key, ")"), opts);
    if (!pat.re->ok()) {
      return ConfigError(c, absl::StrCat("\"", field, "\" key ", QuoteForMessage(p.key()),
                                         " is not a valid pattern: ",
                                         TruncateMessage(pat.re->error(), kMaxQuotedBytes)));
    }
    out->push_back(std::move(pat));
  }
  return absl::OkStatus();
}

// A config value for a message, bounded: scalars as JSON, strings quoted
// and capped, arrays and objects by kind and size (never dumped whole).
std::string DescribeValue(const OrderedJson& v) {
  if (v.is_string()) return QuoteForMessage(v.get_ref<const std::string&>());
  if (v.is_array()) return absl::StrCat("an array of ", v.size(), " elements");
  if (v.is_object()) return absl::StrCat("an object of ", v.size(), " keys");
  return v.dump();  // number, boolean, null: a few bytes
}

// peft_type, r, lora_alpha, use_rslora, fan_in_fan_out, use_dora, bias.
absl::Status ParseScalars(const OrderedJson& j, PeftConfig& c) {
  if (auto it = j.find("peft_type"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "LORA") {
      return ConfigError(c, absl::StrCat("peft_type ", DescribeValue(*it), " is not \"LORA\""));
    }
  }
  if (auto it = j.find("r"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 1) {
      return ConfigError(c, absl::StrCat("\"r\" must be an integer >= 1, got ", DescribeValue(*it)));
    }
    c.r = it->get<int64_t>();
  }
  if (auto it = j.find("lora_alpha"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      return ConfigError(c, absl::StrCat("\"lora_alpha\" must be a number, got ", DescribeValue(*it)));
    }
    c.lora_alpha = it->get<double>();
  }
  WD_ASSIGN_OR_RETURN(c.use_rslora, OptionalBool(c, j, "use_rslora", false));
  WD_ASSIGN_OR_RETURN(c.fan_in_fan_out, OptionalBool(c, j, "fan_in_fan_out", false));
  WD_ASSIGN_OR_RETURN(c.use_dora, OptionalBool(c, j, "use_dora", false));
  if (auto it = j.find("bias"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return ConfigError(c, "\"bias\" must be a string");
    c.bias = it->get<std::string>();
    if (c.bias != "none" && c.bias != "all" && c.bias != "lora_only") {
      return ConfigError(
          c, absl::StrCat("\"bias\" ", QuoteForMessage(c.bias), " is not one of none, all, lora_only"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseModulesToSave(const OrderedJson& j, PeftConfig& c) {
  auto it = j.find("modules_to_save");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    c.modules_to_save.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const OrderedJson& m : *it) {
      if (!m.is_string()) return ConfigError(c, "\"modules_to_save\" must list strings");
      c.modules_to_save.push_back(m.get<std::string>());
    }
  } else {
    return ConfigError(c, "\"modules_to_save\" must be a list of strings");
  }
  return absl::OkStatus();
}

// The variants and initializations a merge onto the original base cannot
// reproduce.
absl::Status CheckMergeable(const OrderedJson& j, const PeftConfig& c) {
  // Initializations that rewrite the base weight: the adapter only
  // reproduces the fine-tune on that mutated base (reference §1.2).
  if (auto it = j.find("init_lora_weights"); it != j.end() && it->is_string()) {
    std::string init = absl::AsciiStrToLower(it->get<std::string>());
    for (absl::string_view bad : {"pissa", "olora", "corda", "loftq", "lora_ga", "lora-ga"}) {
      if (absl::StartsWith(init, bad)) {
        return ConfigError(c, absl::StrCat("init_lora_weights ", QuoteForMessage(init),
                                           " mutates the base weight; the adapter cannot be "
                                           "merged onto the original base (convert it first)"));
      }
    }
  }
  for (absl::string_view field :
       {"alora_invocation_tokens", "layer_replication", "target_parameters", "use_qalora",
        "use_bdlora", "arrow_config", "kasa_config", "velora_config", "monteclora_config"}) {
    if (IsSet(j, field)) {
      return ConfigError(c, absl::StrCat("\"", field,
                                         "\" is set: this LoRA variant cannot be "
                                         "merged"));
    }
  }
  return absl::OkStatus();
}

// Value of the first pattern matching `module`, if any.
std::optional<double> MatchPattern(const std::vector<Pattern>& patterns, absl::string_view module) {
  for (const Pattern& p : patterns) {
    if (RE2::FullMatch(re2::StringPiece(module.data(), module.size()), *p.re)) return p.value;
  }
  return std::nullopt;
}

// ------------------------------------------------------------------ building

struct PeftModule {
  const KeyInfo* a = nullptr;
  const KeyInfo* b = nullptr;
  const KeyInfo* bias = nullptr;
  const KeyInfo* emb_a = nullptr;
  const KeyInfo* emb_b = nullptr;
  const KeyInfo* magnitude = nullptr;
  const KeyInfo* alpha = nullptr;

  bool linear() const { return a != nullptr || b != nullptr; }
  bool embedding() const { return emb_a != nullptr || emb_b != nullptr; }

  // Where a key of `role` goes; nullptr for roles PEFT does not group.
  const KeyInfo** Slot(Role role) {
    switch (role) {
      case Role::kPeftA: return &a;
      case Role::kPeftB: return &b;
      case Role::kPeftBias: return &bias;
      case Role::kEmbA: return &emb_a;
      case Role::kEmbB: return &emb_b;
      case Role::kMagnitude: return &magnitude;
      case Role::kAlpha: return &alpha;
      default: return nullptr;
    }
  }
};

// The keys grouped by module, each in its slot; two keys for one slot are
// INVALID_ARGUMENT.
absl::StatusOr<std::map<std::string, PeftModule>> GroupModules(const Builder& bld,
                                                               const std::vector<KeyInfo>& keys) {
  std::map<std::string, PeftModule> modules;
  for (const KeyInfo& k : keys) {
    PeftModule& m = modules[k.module];
    if (const KeyInfo** slot = m.Slot(k.role)) WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, slot));
  }
  return modules;
}

// Whether module `m` has a complete factor pair of one kind: true to build
// it; false for a stray alpha (now an ignored key); INVALID_ARGUMENT for a
// factor, bias or magnitude without its partners.
absl::StatusOr<bool> CheckPartners(Builder& bld, const PeftModule& m) {
  const bool linear = m.linear();
  const bool embedding = m.embedding();
  if (!linear && !embedding) {
    const KeyInfo* k = m.bias ? m.bias : m.magnitude ? m.magnitude : m.alpha;
    if (k == m.alpha && k != nullptr) {  // a stray alpha: not understood
      bld.adapter->ignored_keys.push_back(k->key);
      return false;
    }
    return MissingPartner(bld.file, k, k == m.bias ? "lora_B.bias" : "lora_magnitude_vector",
                          "lora_A/lora_B");
  }
  if (linear && embedding) {
    return KeyError(bld.file, (m.a ? m.a : m.b)->key,
                    "module has both lora_A/lora_B and lora_embedding_A/lora_embedding_B");
  }
  if (linear && m.a == nullptr) return MissingPartner(bld.file, m.b, "lora_B", "lora_A");
  if (linear && m.b == nullptr) return MissingPartner(bld.file, m.a, "lora_A", "lora_B");
  if (embedding && m.emb_a == nullptr) {
    return MissingPartner(bld.file, m.emb_b, "lora_embedding_B", "lora_embedding_A");
  }
  if (embedding && m.emb_b == nullptr) {
    return MissingPartner(bld.file, m.emb_a, "lora_embedding_A", "lora_embedding_B");
  }
  if (embedding && m.bias != nullptr) {
    return KeyError(bld.file, m.bias->key, "lora_B.bias on an embedding");
  }
  return true;
}

// alpha / r (alpha / √r with use_rslora): r and alpha from the config's
// patterns and defaults (the configured r must be the factors' rank), or
// without a config from the module's alpha tensor.
absl::StatusOr<double> Scale(Builder& bld, const std::string& name, const PeftModule& m,
                             const KeyInfo* ka, int64_t rank, const PeftConfig& cfg) {
  double alpha;
  if (cfg.present) {
    const double r_cfg =
        MatchPattern(cfg.rank_pattern, name).value_or(static_cast<double>(cfg.r));
    if (r_cfg != static_cast<double>(rank)) {
      return KeyError(bld.file, ka->key,
                      absl::StrCat("rank ", rank, " does not match r=", r_cfg, " that ", cfg.path,
                                   " gives module \"", name, "\""));
    }
    alpha = MatchPattern(cfg.alpha_pattern, name).value_or(cfg.lora_alpha);
  } else {
    WD_ASSIGN_OR_RETURN(alpha, bld.ScalarAlpha(m.alpha, rank));
  }
  const double r = static_cast<double>(rank);
  return cfg.use_rslora ? alpha / std::sqrt(r) : alpha / r;
}

// The module's DoRA patch on "<name>.weight"; its magnitude must be [out].
absl::Status AddDora(Builder& bld, const std::string& target, const PeftModule& m,
                     const PeftConfig& cfg, const KeyInfo* ka, LowRankFactors f, double scale,
                     bool transposed) {
  if (m.magnitude == nullptr) {
    return KeyError(bld.file, ka->key, "use_dora is set but lora_magnitude_vector is missing");
  }
  if (cfg.present && !cfg.use_dora) {
    return KeyError(bld.file, m.magnitude->key,
                    "lora_magnitude_vector present but use_dora is not set");
  }
  if (m.embedding())
    return KeyError(bld.file, m.magnitude->key, "DoRA on embeddings is not supported");
  if (transposed) {
    return KeyError(bld.file, m.magnitude->key, "DoRA with fan_in_fan_out is not supported");
  }
  const int64_t out = f.out;
  const LoadedTensor& mag = bld.T(m.magnitude);
  if (mag.shape != std::vector<int64_t>{out}) {
    return KeyError(bld.file, m.magnitude->key,
                    absl::StrCat("magnitude shape ", ShapeString(mag.shape),
                                 " does not match lora_B's ", out, " output rows"));
  }
  auto patch = DoraPatch::Create(bld.Source(target), std::move(f), scale, mag.values);
  if (!patch.ok()) return AnnotateKey(patch.status(), bld.file, ka->key);
  return bld.Add(target, false, *patch, true, ka->key, (*patch)->bytes());
}

// `lora_B.bias` [out]: scale · bias added to "<name>.bias".
absl::Status AddBias(Builder& bld, const std::string& name, const KeyInfo& key, int64_t out,
                     double scale) {
  const LoadedTensor& bias = bld.T(&key);
  if (bias.shape != std::vector<int64_t>{out}) {
    return KeyError(bld.file, key.key,
                    absl::StrCat("lora_B.bias shape ", ShapeString(bias.shape),
                                 " does not match lora_B's ", out, " output rows"));
  }
  const std::string bias_target = absl::StrCat(name, ".bias");
  auto patch = DensePatch::Create(bld.Source(bias_target), bias.shape, bias.values,
                                  DensePatch::Mode::kAdd, scale);
  if (!patch.ok()) return AnnotateKey(patch.status(), bld.file, key.key);
  return bld.Add(bias_target, false, *patch, false, key.key, (*patch)->bytes());
}

// One module with a complete factor pair: its weight patch (DoRA when the
// module has a magnitude or the config says use_dora, else LoRA), then its
// bias patch.
absl::Status BuildModule(Builder& bld, const std::string& name, const PeftModule& m,
                         const PeftConfig& cfg) {
  const bool linear = m.linear();
  const KeyInfo* ka = linear ? m.a : m.emb_a;
  const KeyInfo* kb = linear ? m.b : m.emb_b;
  WD_ASSIGN_OR_RETURN(LowRankFactors f,
                      bld.Factors(ka, kb, linear ? "lora_A" : "lora_embedding_A",
                                  linear ? "lora_B" : "lora_embedding_B"));
  WD_ASSIGN_OR_RETURN(const double scale, Scale(bld, name, m, ka, f.rank, cfg));
  const bool transposed = !linear || cfg.fan_in_fan_out;
  const std::string target = absl::StrCat(name, ".weight");
  const int64_t out = f.out;
  if (m.magnitude != nullptr || (cfg.present && cfg.use_dora)) {
    WD_RETURN_IF_ERROR(AddDora(bld, target, m, cfg, ka, std::move(f), scale, transposed));
  } else {
    auto patch = LoraPatch::Create(bld.Source(target), std::move(f), scale, transposed);
    if (!patch.ok()) return AnnotateKey(patch.status(), bld.file, ka->key);
    WD_RETURN_IF_ERROR(bld.Add(target, false, *patch, true, ka->key, (*patch)->bytes()));
  }
  if (m.bias != nullptr) WD_RETURN_IF_ERROR(AddBias(bld, name, *m.bias, out, scale));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PeftConfig> ParsePeftConfig(absl::string_view text, const std::string& path) {
  PeftConfig c;
  c.present = true;
  c.path = path;
  // Before the parser: nothing below walks a deep document.
  if (absl::Status depth = CheckJsonDepth(text, "config"); !depth.ok()) {
    return Annotate(depth, c.path);
  }
  OrderedJson j = OrderedJson::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return ConfigError(c, "not valid JSON");
  if (!j.is_object()) return ConfigError(c, "not a JSON object");
  WD_RETURN_IF_ERROR(ParseScalars(j, c));
  WD_RETURN_IF_ERROR(ParsePatterns(c, j, "rank_pattern", /*integer=*/true, &c.rank_pattern));
  WD_RETURN_IF_ERROR(ParsePatterns(c, j, "alpha_pattern", /*integer=*/false, &c.alpha_pattern));
  WD_RETURN_IF_ERROR(ParseModulesToSave(j, c));
  WD_RETURN_IF_ERROR(CheckMergeable(j, c));
  return c;
}

std::optional<std::string> PeftReplacementTarget(const PeftConfig& cfg, absl::string_view name) {
  std::vector<absl::string_view> t = absl::StrSplit(name, '.');
  if (std::find(t.begin(), t.end(), "original_module") != t.end()) return std::nullopt;
  for (size_t i = 0; i + 2 < t.size(); ++i) {
    if (t[i] == "modules_to_save") {
      t.erase(t.begin() + i, t.begin() + i + 2);
      break;
    }
  }
  if (t.size() < 2) return std::nullopt;
  const std::string target = absl::StrJoin(t, ".");
  for (size_t len = 1; len < t.size(); ++len) {
    const std::string module = Join(t, 0, len);
    for (const std::string& m : cfg.modules_to_save) {
      if (module == m || absl::EndsWith(module, absl::StrCat(".", m))) return target;
    }
  }
  if (cfg.bias != "none" && t.back() == "bias") {
    t.erase(std::remove(t.begin(), t.end(), "base_layer"), t.end());
    return absl::StrJoin(t, ".");
  }
  return std::nullopt;
}

absl::Status BuildPeft(Builder& bld, const std::vector<KeyInfo>& keys, const PeftConfig& cfg) {
  WD_ASSIGN_OR_RETURN(const auto modules, GroupModules(bld, keys));
  for (const auto& [name, m] : modules) {
    WD_ASSIGN_OR_RETURN(const bool complete, CheckPartners(bld, m));
    if (complete) WD_RETURN_IF_ERROR(BuildModule(bld, name, m, cfg));
  }
  return absl::OkStatus();
}

}  // namespace weightd::adapter_internal
