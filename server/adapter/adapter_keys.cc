// What each key of an adapter's weights file is: the role it plays (a PEFT
// or kohya factor, an alpha, a DoRA vector, a dense payload, or nothing
// understood) and the module or parameter it belongs to. Format detection
// and every builder work from these; the spellings are in adapter.h.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/adapter/adapter_internal.h"

namespace weightd::adapter_internal {
namespace {

// Dense suffixes are authoritative (FastVideo), longest first. True when
// `n` (a normalized name) ends in one; `info` then says what it patches, or
// stays kOther when the stem cannot name a parameter.
bool ClassifyDense(absl::string_view n, KeyInfo& info) {
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
    if (stem.empty()) return true;
    const bool kohya = HasKohyaPrefix(stem) && !absl::StrContains(stem, '.');
    // A kohya-named whole parameter cannot be resolved (ResolveKohyaTarget
    // matches module names): left to ignored_keys.
    if (kohya && s.whole_param) return true;
    info.role = s.role;
    info.kohya_name = kohya;
    info.module = kohya && s.param == ".weight" ? std::string(stem) : absl::StrCat(stem, s.param);
    return true;
  }
  return false;
}

// The low-rank spellings: the last LoRA marker component decides, then a
// trailing alpha / dora_scale.
void ClassifyLowRank(absl::string_view n, KeyInfo& info) {
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
      return;
    }
    if (c == "lora_embedding_A" || c == "lora_embedding_B") {
      if (rest <= 1) set(c == "lora_embedding_A" ? Role::kEmbA : Role::kEmbB, i);
      return;
    }
    if (c == "lora_magnitude_vector") {
      if (rest == 0 || (rest == 1 && t[size - 1] == "weight") ||
          (rest == 2 && t[size - 1] == "weight")) {
        set(Role::kMagnitude, i);
      }
      return;
    }
    if (c == "lora_down" || c == "lora_up") {
      if (rest == 1 && t[size - 1] == "weight") {
        set(c == "lora_down" ? Role::kKohyaDown : Role::kKohyaUp, i);
      }
      return;
    }
  }
  if (size >= 2 && (t[size - 1] == "alpha" || t[size - 1] == "lora_alpha")) {
    set(Role::kAlpha, size - 1);
  } else if (size >= 2 && t[size - 1] == "dora_scale") {
    set(Role::kDoraScale, size - 1);
  }
}

}  // namespace

bool IsPeftRole(Role r) {
  return r == Role::kPeftA || r == Role::kPeftB || r == Role::kPeftBias || r == Role::kEmbA ||
         r == Role::kEmbB || r == Role::kMagnitude;
}
bool IsKohyaRole(Role r) {
  return r == Role::kKohyaDown || r == Role::kKohyaUp || r == Role::kDoraScale;
}

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
  if (!ClassifyDense(n, info)) ClassifyLowRank(n, info);
  return info;
}

}  // namespace weightd::adapter_internal
