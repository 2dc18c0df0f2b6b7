#include "server/adapter/adapter.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cast.h"
#include "common/dtype.h"
#include "common/fd.h"
#include "common/json_depth.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "nlohmann/json.hpp"
#include "re2/re2.h"
#include "server/adapter/lora_patch.h"

namespace weightd {
namespace {

using OrderedJson = nlohmann::ordered_json;  // patterns: first match in file order

constexpr char kConfigName[] = "adapter_config.json";
constexpr char kWeightsName[] = "adapter_model.safetensors";
constexpr uint64_t kMaxConfigBytes = 16ull << 20;

// Longest first where one is a prefix of another.
constexpr absl::string_view kKohyaPrefixes[] = {"lora_transformer_", "lora_unet_", "lora_te1_",
                                                "lora_te2_",         "lora_te3_",  "lora_te_"};

bool HasKohyaPrefix(absl::string_view name) {
  for (absl::string_view p : kKohyaPrefixes) {
    if (absl::StartsWith(name, p)) return true;
  }
  return false;
}

absl::Status KeyError(absl::string_view file, absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor \"", key, "\": ", what));
}

// ------------------------------------------------------------------ files

struct TensorFile {
  std::string path;
  OpenedFile file;  // read through file.fd
  uint64_t size = 0;
  std::string prefix;  // the 8-byte length and the header JSON, for the digest
  SafetensorsHeader header;
};

absl::StatusOr<TensorFile> OpenTensorFile(OpenedFile file) {
  TensorFile f;
  f.path = file.path;
  f.file = std::move(file);
  const std::string& path = f.path;
  const struct stat& st = f.file.st;
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  f.size = static_cast<uint64_t>(st.st_size);
  if (f.size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", f.size, " bytes, too short for a safetensors header"));
  }
  char len8[8];
  WD_RETURN_IF_ERROR_CTX(PreadFull(f.file.fd.get(), len8, 8, 0), path);
  auto header_len = ParseSafetensorsPrefix(absl::string_view(len8, 8), f.size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  f.prefix.resize(8 + *header_len);
  WD_RETURN_IF_ERROR_CTX(PreadFull(f.file.fd.get(), f.prefix.data(), f.prefix.size(), 0), path);
  auto header = ParseSafetensorsHeader(absl::string_view(f.prefix).substr(8), f.size);
  if (!header.ok()) return Annotate(header.status(), path);
  f.header = std::move(*header);
  return f;
}

struct LoadedTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
using TensorMap = absl::flat_hash_map<std::string, LoadedTensor>;

// Reads the whole file in order (the parser guarantees the tensors tile the
// data section), feeding every byte to `digest`, and converts the `wanted`
// tensors to fp32.
// `fetched`: the data section in memory (AdapterLoadOptions::fetch), or
// null to read it through the fd.
absl::StatusOr<TensorMap> ReadTensors(const TensorFile& f,
                                      const absl::flat_hash_set<std::string>& wanted,
                                      DigestBuilder* digest, const uint8_t* fetched = nullptr) {
  digest->Update(f.prefix.data(), f.prefix.size());
  TensorMap out;
  std::vector<uint8_t> buf;
  for (const SafetensorsEntry& e : f.header.tensors) {
    const uint64_t length = e.end - e.begin;
    const bool want = wanted.contains(e.name);
    if (want && !IsFloating(e.dtype)) {
      return KeyError(f.path, e.name,
                      absl::StrCat("dtype ", DTypeName(e.dtype), " is not a floating type"));
    }
    buf.resize(static_cast<size_t>(length));
    if (fetched != nullptr) {
      if (length > 0) std::memcpy(buf.data(), fetched + e.begin, buf.size());
    } else {
      WD_RETURN_IF_ERROR_CTX(
          PreadFull(f.file.fd.get(), buf.data(), buf.size(), f.header.data_offset + e.begin),
          f.path, ": tensor \"", e.name, "\"");
    }
    digest->Update(buf.data(), buf.size());
    if (!want) continue;
    LoadedTensor t;
    t.shape = e.shape;
    const int64_t n = NumElements(e.shape);
    t.values.resize(static_cast<size_t>(n));
    if (n > 0) {
      WD_RETURN_IF_ERROR_CTX(
          CastBuffer(e.dtype, buf.data(), DType::kF32, t.values.data(), static_cast<size_t>(n)),
          f.path, ": tensor \"", e.name, "\"");
    }
    out.emplace(e.name, std::move(t));
  }
  return out;
}

// ------------------------------------------------------------------ config

struct Pattern {
  std::string key;
  std::unique_ptr<RE2> re;
  double value = 0;
};

struct PeftConfig {
  bool present = false;
  std::string path;
  int64_t r = 8;
  double lora_alpha = 8;
  bool use_rslora = false;
  bool fan_in_fan_out = false;
  bool use_dora = false;
  std::string bias = "none";
  std::vector<Pattern> rank_pattern;   // in file order
  std::vector<Pattern> alpha_pattern;  // in file order
  std::vector<std::string> modules_to_save;
};

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

absl::StatusOr<PeftConfig> ParsePeftConfig(absl::string_view text, const std::string& path) {
  PeftConfig c;
  c.present = true;
  c.path = path;
  // Before the parser: nothing below walks a deep document.
  if (absl::Status depth = CheckJsonDepth(text, "config"); !depth.ok()) {
    return ConfigError(c, depth.message());
  }
  OrderedJson j = OrderedJson::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return ConfigError(c, "not valid JSON");
  if (!j.is_object()) return ConfigError(c, "not a JSON object");

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
  WD_RETURN_IF_ERROR(ParsePatterns(c, j, "rank_pattern", /*integer=*/true, &c.rank_pattern));
  WD_RETURN_IF_ERROR(ParsePatterns(c, j, "alpha_pattern", /*integer=*/false, &c.alpha_pattern));
  if (auto it = j.find("modules_to_save"); it != j.end() && !it->is_null()) {
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
  }
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
  return c;
}

// Value of the first pattern matching `module`, if any.
std::optional<double> MatchPattern(const std::vector<Pattern>& patterns, absl::string_view module) {
  for (const Pattern& p : patterns) {
    if (RE2::FullMatch(re2::StringPiece(module.data(), module.size()), *p.re)) return p.value;
  }
  return std::nullopt;
}

// ------------------------------------------------------------------ keys

enum class Role {
  kPeftA,
  kPeftB,
  kPeftBias,  // lora_B.bias
  kEmbA,
  kEmbB,
  kMagnitude,
  kKohyaDown,
  kKohyaUp,
  kAlpha,      // <m>.alpha / <m>.lora_alpha
  kDoraScale,  // kohya <m>.dora_scale
  kDenseAdd,
  kDenseSet,
  kOther,
};

bool IsPeftRole(Role r) {
  return r == Role::kPeftA || r == Role::kPeftB || r == Role::kPeftBias || r == Role::kEmbA ||
         r == Role::kEmbB || r == Role::kMagnitude;
}
bool IsKohyaRole(Role r) {
  return r == Role::kKohyaDown || r == Role::kKohyaUp || r == Role::kDoraScale;
}

struct KeyInfo {
  std::string key;   // as in the file
  std::string name;  // normalized (prefixes stripped)
  Role role = Role::kOther;
  std::string module;  // module (LoRA roles) or target parameter (dense roles)
  bool kohya_name = false;
};

std::string Join(const std::vector<absl::string_view>& t, size_t begin, size_t end) {
  return absl::StrJoin(t.begin() + begin, t.begin() + end, ".");
}

KeyInfo Classify(absl::string_view key) {
  KeyInfo info;
  info.key = std::string(key);
  absl::string_view n = key;
  absl::ConsumePrefix(&n, "base_model.model.");
  absl::ConsumePrefix(&n, "diffusion_model.");
  info.name = std::string(n);

  // Dense suffixes are authoritative (FastVideo), longest first.
  struct Suffix {
    absl::string_view suffix;
    absl::string_view param;  // appended to the stem
    Role role;
    bool whole_param;  // the stem is a parameter, not a module
  };
  static constexpr Suffix kDense[] = {{".diff_param", "", Role::kDenseAdd, true},
                                      {".diff_b", ".bias", Role::kDenseAdd, false},
                                      {".diff", ".weight", Role::kDenseAdd, false},
                                      {".set_weight", ".weight", Role::kDenseSet, false},
                                      {".set_param", "", Role::kDenseSet, true}};
  for (const Suffix& s : kDense) {
    if (!absl::EndsWith(n, s.suffix)) continue;
    absl::string_view stem = n.substr(0, n.size() - s.suffix.size());
    if (stem.empty()) return info;
    const bool kohya = HasKohyaPrefix(stem) && !absl::StrContains(stem, '.');
    // A kohya-named whole parameter cannot be resolved (ResolveKohyaTarget
    // matches module names): left to ignored_keys.
    if (kohya && s.whole_param) return info;
    info.role = s.role;
    info.kohya_name = kohya;
    info.module = kohya && s.param == ".weight" ? std::string(stem) : absl::StrCat(stem, s.param);
    return info;
  }

  std::vector<absl::string_view> t = absl::StrSplit(n, '.');
  const size_t size = t.size();
  auto set = [&](Role role, size_t i) {
    if (i == 0) return;  // no module name
    info.role = role;
    info.module = Join(t, 0, i);
    info.kohya_name = HasKohyaPrefix(info.module) && !absl::StrContains(info.module, '.');
  };
  // Find the last LoRA marker component.
  for (size_t i = size; i-- > 0;) {
    absl::string_view c = t[i];
    const size_t rest = size - i - 1;
    if (c == "lora_A" || c == "lora_B") {
      // .weight, or .<adapter>.weight (in-memory spelling); lora_B also .bias.
      absl::string_view last = t[size - 1];
      if ((rest == 1 || rest == 2) && last == "weight") {
        set(c == "lora_A" ? Role::kPeftA : Role::kPeftB, i);
      } else if (c == "lora_B" && (rest == 1 || rest == 2) && last == "bias") {
        set(Role::kPeftBias, i);
      }
      return info;
    }
    if (c == "lora_embedding_A" || c == "lora_embedding_B") {
      if (rest <= 1) set(c == "lora_embedding_A" ? Role::kEmbA : Role::kEmbB, i);
      return info;
    }
    if (c == "lora_magnitude_vector") {
      if (rest == 0 || (rest == 1 && t[size - 1] == "weight") ||
          (rest == 2 && t[size - 1] == "weight")) {
        set(Role::kMagnitude, i);
      }
      return info;
    }
    if (c == "lora_down" || c == "lora_up") {
      if (rest == 1 && t[size - 1] == "weight") {
        set(c == "lora_down" ? Role::kKohyaDown : Role::kKohyaUp, i);
      }
      return info;
    }
  }
  if (size >= 2 && (t[size - 1] == "alpha" || t[size - 1] == "lora_alpha")) {
    set(Role::kAlpha, size - 1);
  } else if (size >= 2 && t[size - 1] == "dora_scale") {
    set(Role::kDoraScale, size - 1);
  }
  return info;
}

// ------------------------------------------------------------------ building

struct Builder {
  std::string file;
  Digest digest;
  const TensorMap* tensors = nullptr;
  Adapter* adapter = nullptr;
  // target -> (what patches it, first key), to reject conflicting payloads.
  struct Claim {
    bool lora = false, add = false, replace = false;
    std::string key;
  };
  std::map<std::pair<std::string, bool>, Claim> claims;

  const LoadedTensor& T(const KeyInfo* k) const { return tensors->at(k->key); }

  absl::Status Reserve(const std::string& target, bool kohya, TensorPatch::Kind kind, bool lora,
                       const std::string& key) {
    auto [it, inserted] = claims.try_emplace({target, kohya});
    Claim& c = it->second;
    if (!inserted) {
      const bool conflict =
          c.replace || kind == TensorPatch::Kind::kReplace || (lora && c.lora) || (!lora && c.add);
      if (conflict) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": tensors \"", c.key, "\" and \"",
                                                       key, "\" both patch \"", target, "\""));
      }
    } else {
      c.key = key;
    }
    if (kind == TensorPatch::Kind::kReplace)
      c.replace = true;
    else if (lora)
      c.lora = true;
    else
      c.add = true;
    return absl::OkStatus();
  }

  absl::Status Add(std::string target, bool kohya, TensorPatchPtr patch, bool lora,
                   const std::string& key, uint64_t bytes) {
    WD_RETURN_IF_ERROR(Reserve(target, kohya, patch->kind(), lora, key));
    adapter->bytes += bytes;
    adapter->entries.push_back(AdapterEntry{std::move(target), kohya, std::move(patch)});
    return absl::OkStatus();
  }

  PatchSource Source(const std::string& target) const { return PatchSource{digest, target}; }

  absl::Status AddDense(const KeyInfo& k) {
    const LoadedTensor& t = T(&k);
    const auto mode = k.role == Role::kDenseAdd ? DensePatch::Mode::kAdd : DensePatch::Mode::kSet;
    auto patch = DensePatch::Create(Source(k.module), t.shape, t.values, mode);
    if (!patch.ok()) return KeyError(file, k.key, patch.status().message());
    return Add(k.module, k.kohya_name, *patch, false, k.key, (*patch)->bytes());
  }

  absl::Status AddReplacement(const KeyInfo& k, const std::string& target) {
    const LoadedTensor& t = T(&k);
    auto patch = DensePatch::Create(Source(target), t.shape, t.values,
                                    DensePatch::Mode::kSetIgnoringStrength);
    if (!patch.ok()) return KeyError(file, k.key, patch.status().message());
    return Add(target, false, *patch, false, k.key, (*patch)->bytes());
  }

  // A 2-D factor pair -> LowRankFactors. `down`: [r, in], `up`: [out, r].
  absl::StatusOr<LowRankFactors> Factors(const KeyInfo* down, const KeyInfo* up,
                                         absl::string_view down_name, absl::string_view up_name) {
    const LoadedTensor& a = T(down);
    const LoadedTensor& b = T(up);
    for (auto [k, t, what] : {std::tuple{down, &a, down_name}, std::tuple{up, &b, up_name}}) {
      if (t->shape.size() != 2) {
        return KeyError(file, k->key,
                        absl::StrCat(what, " must be 2-D, got shape ", ShapeString(t->shape),
                                     t->shape.size() > 2 ? " (conv LoRA is not supported)" : ""));
      }
    }
    if (a.shape[0] != b.shape[1]) {
      return KeyError(
          file, up->key,
          absl::StrCat("rank mismatch: ", down_name, " ", ShapeString(a.shape), " has rank ",
                       a.shape[0], " but ", up_name, " is ", ShapeString(b.shape)));
    }
    if (a.shape[0] < 1) return KeyError(file, down->key, "rank 0");
    LowRankFactors f;
    f.rank = a.shape[0];
    f.in = a.shape[1];
    f.out = b.shape[0];
    f.a = a.values;
    f.b = b.values;
    return f;
  }

  absl::StatusOr<double> ScalarAlpha(const KeyInfo* k, int64_t rank) {
    if (k == nullptr) return static_cast<double>(rank);
    const LoadedTensor& t = T(k);
    if (t.values.size() != 1) {
      return KeyError(file, k->key,
                      absl::StrCat("alpha must be a scalar, got shape ", ShapeString(t.shape)));
    }
    const double alpha = t.values[0];
    if (!std::isfinite(alpha)) return KeyError(file, k->key, "alpha is not finite");
    return alpha == 0.0 ? static_cast<double>(rank) : alpha;
  }
};

struct PeftModule {
  const KeyInfo* a = nullptr;
  const KeyInfo* b = nullptr;
  const KeyInfo* bias = nullptr;
  const KeyInfo* emb_a = nullptr;
  const KeyInfo* emb_b = nullptr;
  const KeyInfo* magnitude = nullptr;
  const KeyInfo* alpha = nullptr;
};

struct KohyaModule {
  const KeyInfo* down = nullptr;
  const KeyInfo* up = nullptr;
  const KeyInfo* alpha = nullptr;
  const KeyInfo* dora_scale = nullptr;
};

absl::Status SetSlot(const std::string& file, const KeyInfo* k, const KeyInfo** slot) {
  if (*slot != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensors \"", (*slot)->key, "\" and \"",
                                                   k->key, "\" are the same LoRA factor"));
  }
  *slot = k;
  return absl::OkStatus();
}

absl::Status MissingPartner(const std::string& file, const KeyInfo* have, absl::string_view has,
                            absl::string_view lacks) {
  return KeyError(file, have->key, absl::StrCat(has, " without ", lacks));
}

// The target of a PEFT non-LoRA key: a modules_to_save replacement or a
// bias="all"/"lora_only" bias; nullopt = ignored.
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
  std::map<std::string, PeftModule> modules;
  for (const KeyInfo& k : keys) {
    PeftModule& m = modules[k.module];
    switch (k.role) {
      case Role::kPeftA:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.a));
        break;
      case Role::kPeftB:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.b));
        break;
      case Role::kPeftBias:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.bias));
        break;
      case Role::kEmbA:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.emb_a));
        break;
      case Role::kEmbB:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.emb_b));
        break;
      case Role::kMagnitude:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.magnitude));
        break;
      case Role::kAlpha:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.alpha));
        break;
      default:
        break;
    }
  }
  for (const auto& [name, m] : modules) {
    const bool linear = m.a != nullptr || m.b != nullptr;
    const bool embedding = m.emb_a != nullptr || m.emb_b != nullptr;
    if (!linear && !embedding) {
      const KeyInfo* k = m.bias ? m.bias : m.magnitude ? m.magnitude : m.alpha;
      if (k == m.alpha && k != nullptr) {  // a stray alpha: not understood
        bld.adapter->ignored_keys.push_back(k->key);
        continue;
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
    const KeyInfo* ka = linear ? m.a : m.emb_a;
    const KeyInfo* kb = linear ? m.b : m.emb_b;
    WD_ASSIGN_OR_RETURN(LowRankFactors f,
                        bld.Factors(ka, kb, linear ? "lora_A" : "lora_embedding_A",
                                    linear ? "lora_B" : "lora_embedding_B"));
    const int64_t rank = f.rank;
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
    const double scale = cfg.use_rslora ? alpha / std::sqrt(r) : alpha / r;
    const bool transposed = embedding || cfg.fan_in_fan_out;
    const std::string target = absl::StrCat(name, ".weight");
    const int64_t out = f.out;

    if (m.magnitude != nullptr || (cfg.present && cfg.use_dora)) {
      if (m.magnitude == nullptr) {
        return KeyError(bld.file, ka->key, "use_dora is set but lora_magnitude_vector is missing");
      }
      if (cfg.present && !cfg.use_dora) {
        return KeyError(bld.file, m.magnitude->key,
                        "lora_magnitude_vector present but use_dora is not set");
      }
      if (embedding)
        return KeyError(bld.file, m.magnitude->key, "DoRA on embeddings is not supported");
      if (transposed) {
        return KeyError(bld.file, m.magnitude->key, "DoRA with fan_in_fan_out is not supported");
      }
      const LoadedTensor& mag = bld.T(m.magnitude);
      if (mag.shape != std::vector<int64_t>{out}) {
        return KeyError(bld.file, m.magnitude->key,
                        absl::StrCat("magnitude shape ", ShapeString(mag.shape),
                                     " does not match lora_B's ", out, " output rows"));
      }
      auto patch = DoraPatch::Create(bld.Source(target), std::move(f), scale, mag.values);
      if (!patch.ok()) return KeyError(bld.file, ka->key, patch.status().message());
      WD_RETURN_IF_ERROR(bld.Add(target, false, *patch, true, ka->key, (*patch)->bytes()));
    } else {
      auto patch = LoraPatch::Create(bld.Source(target), std::move(f), scale, transposed);
      if (!patch.ok()) return KeyError(bld.file, ka->key, patch.status().message());
      WD_RETURN_IF_ERROR(bld.Add(target, false, *patch, true, ka->key, (*patch)->bytes()));
    }
    if (m.bias != nullptr) {
      const LoadedTensor& bias = bld.T(m.bias);
      if (bias.shape != std::vector<int64_t>{out}) {
        return KeyError(bld.file, m.bias->key,
                        absl::StrCat("lora_B.bias shape ", ShapeString(bias.shape),
                                     " does not match lora_B's ", out, " output rows"));
      }
      const std::string bias_target = absl::StrCat(name, ".bias");
      auto patch = DensePatch::Create(bld.Source(bias_target), bias.shape, bias.values,
                                      DensePatch::Mode::kAdd, scale);
      if (!patch.ok()) return KeyError(bld.file, m.bias->key, patch.status().message());
      WD_RETURN_IF_ERROR(
          bld.Add(bias_target, false, *patch, false, m.bias->key, (*patch)->bytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status BuildKohya(Builder& bld, const std::vector<KeyInfo>& keys) {
  std::map<std::string, KohyaModule> modules;
  for (const KeyInfo& k : keys) {
    KohyaModule& m = modules[k.module];
    switch (k.role) {
      case Role::kKohyaDown:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.down));
        break;
      case Role::kKohyaUp:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.up));
        break;
      case Role::kAlpha:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.alpha));
        break;
      case Role::kDoraScale:
        WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, &m.dora_scale));
        break;
      default:
        break;
    }
  }
  for (const auto& [name, m] : modules) {
    if (m.down == nullptr && m.up == nullptr) {
      // alpha / dora_scale with no factors: not understood.
      if (m.alpha) bld.adapter->ignored_keys.push_back(m.alpha->key);
      if (m.dora_scale) bld.adapter->ignored_keys.push_back(m.dora_scale->key);
      continue;
    }
    if (m.down == nullptr) return MissingPartner(bld.file, m.up, "lora_up", "lora_down");
    if (m.up == nullptr) return MissingPartner(bld.file, m.down, "lora_down", "lora_up");
    WD_ASSIGN_OR_RETURN(LowRankFactors f, bld.Factors(m.down, m.up, "lora_down", "lora_up"));
    WD_ASSIGN_OR_RETURN(double alpha, bld.ScalarAlpha(m.alpha, f.rank));
    const double scale = alpha / static_cast<double>(f.rank);
    const bool kohya = m.down->kohya_name;
    const std::string target = kohya ? name : absl::StrCat(name, ".weight");
    if (m.dora_scale != nullptr) {
      const LoadedTensor& d = bld.T(m.dora_scale);
      const bool on_out =
          d.shape == std::vector<int64_t>{f.out} || d.shape == std::vector<int64_t>{f.out, 1};
      if (!on_out) {
        return KeyError(bld.file, m.dora_scale->key,
                        absl::StrCat("dora_scale shape ", ShapeString(d.shape),
                                     " is not [out] or [out, 1] with out=", f.out,
                                     " (input-axis DoRA is not supported)"));
      }
      auto patch = DoraPatch::Create(bld.Source(target), std::move(f), scale, d.values);
      if (!patch.ok()) return KeyError(bld.file, m.down->key, patch.status().message());
      WD_RETURN_IF_ERROR(bld.Add(target, kohya, *patch, true, m.down->key, (*patch)->bytes()));
    } else {
      auto patch = LoraPatch::Create(bld.Source(target), std::move(f), scale, false);
      if (!patch.ok()) return KeyError(bld.file, m.down->key, patch.status().message());
      WD_RETURN_IF_ERROR(bld.Add(target, kohya, *patch, true, m.down->key, (*patch)->bytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNotDirectoryFormat(const std::string& path, AdapterFormat format) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " is a directory; format ", AdapterFormatName(format),
                   " expects a .safetensors file (directories are PEFT adapters)"));
}

}  // namespace

absl::StatusOr<AdapterFormat> ParseAdapterFormat(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto") return AdapterFormat::kAuto;
  if (t == "peft") return AdapterFormat::kPeft;
  if (t == "kohya") return AdapterFormat::kKohya;
  if (t == "dense") return AdapterFormat::kDense;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown adapter format \"", text, "\" (expected auto, peft, kohya or dense)"));
}

absl::string_view AdapterFormatName(AdapterFormat format) {
  switch (format) {
    case AdapterFormat::kAuto:
      return "auto";
    case AdapterFormat::kPeft:
      return "peft";
    case AdapterFormat::kKohya:
      return "kohya";
    case AdapterFormat::kDense:
      return "dense";
  }
  return "unknown";
}

absl::StatusOr<std::shared_ptr<const Adapter>> LoadAdapter(const std::string& path,
                                                           AdapterFormat format,
                                                           const AdapterLoadOptions& options) {
  // Each file is opened once, where it really lies, and read through its fd.
  const UnconfinedFileOpener unconfined;
  const FileOpener& opener = options.files != nullptr ? *options.files : unconfined;
  WD_ASSIGN_OR_RETURN(OpenedFile top, opener.Open(path));
  std::string weights_path = path;
  std::optional<OpenedFile> config;
  OpenedFile weights;
  if (top.is_directory()) {
    if (format != AdapterFormat::kAuto && format != AdapterFormat::kPeft) {
      return CheckNotDirectoryFormat(path, format);
    }
    format = AdapterFormat::kPeft;
    auto cfg = opener.OpenIn(top, kConfigName);
    if (absl::IsNotFound(cfg.status())) {
      return absl::NotFoundError(
          absl::StrCat("PEFT adapter directory ", path, " has no ", kConfigName));
    }
    if (!cfg.ok()) return cfg.status();
    auto w = opener.OpenIn(top, kWeightsName);
    if (absl::IsNotFound(w.status())) {
      const bool bin = !absl::IsNotFound(opener.OpenIn(top, "adapter_model.bin").status());
      return absl::NotFoundError(absl::StrCat(
          "PEFT adapter directory ", path, " has no ", kWeightsName,
          bin ? " (adapter_model.bin, a pickle, is not supported: convert it to safetensors)"
              : ""));
    }
    if (!w.ok()) return w.status();
    config = std::move(*cfg);
    weights = std::move(*w);
    weights_path = weights.path;
  } else {
    weights = std::move(top);
  }

  WD_ASSIGN_OR_RETURN(TensorFile file, OpenTensorFile(std::move(weights)));
  std::vector<KeyInfo> keys;
  keys.reserve(file.header.tensors.size());
  for (const SafetensorsEntry& e : file.header.tensors) keys.push_back(Classify(e.name));
  std::sort(keys.begin(), keys.end(),
            [](const KeyInfo& a, const KeyInfo& b) { return a.key < b.key; });

  if (format == AdapterFormat::kAuto) {
    size_t peft = 0, kohya = 0, dense = 0;
    for (const KeyInfo& k : keys) {
      peft += IsPeftRole(k.role);
      kohya += k.role == Role::kKohyaDown || k.role == Role::kKohyaUp;
      dense += k.role == Role::kDenseAdd || k.role == Role::kDenseSet;
    }
    if (peft > 0 && kohya > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(weights_path,
                       ": mixes PEFT (lora_A/lora_B) and kohya (lora_down/lora_up) keys; "
                       "pass the format explicitly"));
    }
    if (peft > 0) {
      format = AdapterFormat::kPeft;
    } else if (kohya > 0) {
      format = AdapterFormat::kKohya;
    } else if (dense > 0) {
      format = AdapterFormat::kDense;
    } else {
      std::vector<absl::string_view> sample;
      for (size_t i = 0; i < keys.size() && i < 3; ++i) sample.push_back(keys[i].key);
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot tell the adapter format of ", weights_path,
          ": no lora_A/lora_B, lora_down/lora_up or dense (.diff, .set_weight) keys among its ",
          keys.size(), " tensors", sample.empty() ? "" : " (e.g. \"",
          absl::StrJoin(sample, "\", \""), sample.empty() ? "" : "\")"));
    }
  }

  // PEFT config: the directory's, or one beside a single file.
  PeftConfig cfg;
  DigestBuilder digest;
  if (format == AdapterFormat::kPeft) {
    if (!config) {
      auto sibling = opener.OpenBeside(file.file, kConfigName);
      if (sibling.ok()) {
        config = std::move(*sibling);
      } else if (!absl::IsNotFound(sibling.status())) {
        return sibling.status();
      }
    }
    if (config) {
      WD_ASSIGN_OR_RETURN(std::string text,
                          ReadFdToString(config->fd.get(), config->path, kMaxConfigBytes));
      WD_ASSIGN_OR_RETURN(cfg, ParsePeftConfig(text, config->path));
      digest.Update(text.data(), text.size());
    }
  }

  // Which keys this format uses; the rest are ignored.
  auto adapter = std::make_shared<Adapter>();
  adapter->path = path;
  adapter->format = format;
  std::vector<KeyInfo> used;
  std::vector<std::pair<const KeyInfo*, std::string>> replacements;
  absl::flat_hash_set<std::string> wanted;
  for (const KeyInfo& k : keys) {
    bool use = false;
    const bool dense = k.role == Role::kDenseAdd || k.role == Role::kDenseSet;
    switch (format) {
      case AdapterFormat::kPeft:
        use = dense || IsPeftRole(k.role) || (k.role == Role::kAlpha && !cfg.present);
        if (!use && !IsPeftRole(k.role) && !IsKohyaRole(k.role) && cfg.present) {
          if (auto target = PeftReplacementTarget(cfg, k.name)) {
            replacements.emplace_back(&k, *target);
            wanted.insert(k.key);
            continue;
          }
        }
        break;
      case AdapterFormat::kKohya:
        use = dense || IsKohyaRole(k.role) || k.role == Role::kAlpha;
        break;
      case AdapterFormat::kDense:
        use = dense;
        break;
      case AdapterFormat::kAuto:
        break;
    }
    if (use) {
      used.push_back(k);
      wanted.insert(k.key);
    } else {
      adapter->ignored_keys.push_back(k.key);
    }
  }

  if (options.reserve) {
    uint64_t bytes = 0;
    for (const SafetensorsEntry& e : file.header.tensors) {
      if (wanted.contains(e.name)) bytes += static_cast<uint64_t>(NumElements(e.shape)) * 4;
    }
    WD_ASSIGN_OR_RETURN(adapter->reservation, options.reserve(bytes));
  }
  const uint8_t* fetched = nullptr;
  if (options.fetch) {
    WD_ASSIGN_OR_RETURN(AdapterLoadOptions::FetchedBytes bytes,
                        options.fetch(file.path, file.prefix));
    if (bytes.data != nullptr) {
      if (bytes.length != file.size - file.header.data_offset) {
        return absl::DataLossError(absl::StrCat(file.path, " changed while it was being loaded"));
      }
      fetched = bytes.data;
      adapter->fetched = std::move(bytes.keep);
    }
  }
  WD_ASSIGN_OR_RETURN(TensorMap tensors, ReadTensors(file, wanted, &digest, fetched));
  adapter->digest = digest.Finish();

  Builder bld;
  bld.file = weights_path;
  bld.digest = adapter->digest;
  bld.tensors = &tensors;
  bld.adapter = adapter.get();
  std::vector<KeyInfo> lowrank;
  for (const KeyInfo& k : used) {
    if (k.role == Role::kDenseAdd || k.role == Role::kDenseSet) {
      WD_RETURN_IF_ERROR(bld.AddDense(k));
    } else {
      lowrank.push_back(k);
    }
  }
  if (format == AdapterFormat::kPeft) {
    WD_RETURN_IF_ERROR(BuildPeft(bld, lowrank, cfg));
  } else if (format == AdapterFormat::kKohya) {
    WD_RETURN_IF_ERROR(BuildKohya(bld, lowrank));
  }
  for (const auto& [k, target] : replacements) WD_RETURN_IF_ERROR(bld.AddReplacement(*k, target));

  if (adapter->entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(weights_path, ": no ", AdapterFormatName(format),
                                                   " adapter tensors among its ", keys.size(),
                                                   " keys"));
  }
  std::sort(adapter->ignored_keys.begin(), adapter->ignored_keys.end());
  return std::shared_ptr<const Adapter>(std::move(adapter));
}

absl::StatusOr<std::string> ResolveKohyaTarget(absl::string_view flat,
                                               absl::Span<const std::string> base_names) {
  absl::string_view module = flat;
  absl::string_view param = "weight";
  if (size_t dot = module.rfind('.'); dot != absl::string_view::npos) {
    param = module.substr(dot + 1);
    module = module.substr(0, dot);
  }
  for (absl::string_view p : kKohyaPrefixes) {
    if (absl::ConsumePrefix(&module, p)) break;
  }
  if (module.empty() || param.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("kohya name \"", flat, "\" names no module"));
  }
  const std::string suffix = absl::StrCat(".", param);
  std::vector<const std::string*> exact, tail;
  for (const std::string& name : base_names) {
    if (!absl::EndsWith(name, suffix)) continue;
    absl::string_view m = absl::string_view(name).substr(0, name.size() - suffix.size());
    if (m.size() < module.size()) continue;
    const size_t off = m.size() - module.size();
    bool equal = true;
    for (size_t i = 0; i < module.size(); ++i) {
      char c = m[off + i];
      if (c == '.') c = '_';
      if (c != module[i]) {
        equal = false;
        break;
      }
    }
    if (!equal) continue;
    if (off == 0) {
      exact.push_back(&name);
    } else if (m[off - 1] == '.') {
      tail.push_back(&name);
    }
  }
  const std::vector<const std::string*>& found = exact.empty() ? tail : exact;
  if (found.size() == 1) return *found[0];
  if (found.empty()) {
    return absl::NotFoundError(
        absl::StrCat("kohya module \"", flat, "\" matches no parameter of the base (looking for a ",
                     suffix, " whose module, with '.' as '_', is \"", module, "\")"));
  }
  std::vector<absl::string_view> names;
  for (size_t i = 0; i < found.size() && i < 4; ++i) names.push_back(*found[i]);
  return absl::InvalidArgumentError(absl::StrCat(
      "kohya module \"", flat, "\" is ambiguous: it matches ", found.size(), " parameters (\"",
      absl::StrJoin(names, "\", \""), "\"", found.size() > 4 ? ", ..." : "", ")"));
}

}  // namespace weightd
