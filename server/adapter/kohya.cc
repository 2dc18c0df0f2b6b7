// The kohya/diffusers format: lora_down / lora_up pairs with an optional
// alpha and dora_scale, built into LoRA or DoRA patches, and the resolution
// of kohya's flattened module names (lora_unet_…) against a base's names.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/adapter/adapter_internal.h"

namespace weightd {
namespace adapter_internal {
namespace {

// Longest first where one is a prefix of another.
constexpr absl::string_view kKohyaPrefixes[] = {"lora_transformer_", "lora_unet_", "lora_te1_",
                                                "lora_te2_",         "lora_te3_",  "lora_te_"};

struct KohyaModule {
  const KeyInfo* down = nullptr;
  const KeyInfo* up = nullptr;
  const KeyInfo* alpha = nullptr;
  const KeyInfo* dora_scale = nullptr;

  // Where a key of `role` goes; nullptr for roles kohya does not group.
  const KeyInfo** Slot(Role role) {
    switch (role) {
      case Role::kKohyaDown: return &down;
      case Role::kKohyaUp: return &up;
      case Role::kAlpha: return &alpha;
      case Role::kDoraScale: return &dora_scale;
      default: return nullptr;
    }
  }
};

// One module with both factors: a DoRA patch when it has a dora_scale (of
// shape [out] or [out, 1]), else a LoRA patch; scale = alpha / rank.
absl::Status BuildModule(Builder& bld, const std::string& name, const KohyaModule& m) {
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
    if (!patch.ok()) return AnnotateKey(patch.status(), bld.file, m.down->key);
    return bld.Add(target, kohya, *patch, true, m.down->key, (*patch)->bytes());
  }
  auto patch = LoraPatch::Create(bld.Source(target), std::move(f), scale, false);
  if (!patch.ok()) return AnnotateKey(patch.status(), bld.file, m.down->key);
  return bld.Add(target, kohya, *patch, true, m.down->key, (*patch)->bytes());
}

}  // namespace

bool HasKohyaPrefix(absl::string_view name) {
  for (absl::string_view p : kKohyaPrefixes) {
    if (absl::StartsWith(name, p)) return true;
  }
  return false;
}

absl::Status BuildKohya(Builder& bld, const std::vector<KeyInfo>& keys) {
  std::map<std::string, KohyaModule> modules;
  for (const KeyInfo& k : keys) {
    KohyaModule& m = modules[k.module];
    if (const KeyInfo** slot = m.Slot(k.role)) WD_RETURN_IF_ERROR(SetSlot(bld.file, &k, slot));
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
    WD_RETURN_IF_ERROR(BuildModule(bld, name, m));
  }
  return absl::OkStatus();
}

}  // namespace adapter_internal

absl::StatusOr<std::string> ResolveKohyaTarget(absl::string_view flat,
                                               absl::Span<const std::string> base_names) {
  absl::string_view module = flat;
  absl::string_view param = "weight";
  if (size_t dot = module.rfind('.'); dot != absl::string_view::npos) {
    param = module.substr(dot + 1);
    module = module.substr(0, dot);
  }
  for (absl::string_view p : adapter_internal::kKohyaPrefixes) {
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
