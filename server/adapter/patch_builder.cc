// The Builder every adapter format shares: each patch it adds claims its
// target parameter first (two payloads that do not stack are refused), and
// the dense payloads — understood in every format — are built here too.
// Low-rank factors and alphas are checked here for the PEFT and kohya
// builders (peft.cc, kohya.cc).
#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/adapter/adapter_internal.h"

namespace weightd::adapter_internal {

absl::Status KeyError(absl::string_view file, absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor \"", key, "\": ", what));
}

absl::Status AnnotateKey(const absl::Status& status, absl::string_view file,
                         absl::string_view key) {
  return Annotate(status, absl::StrCat(file, ": tensor \"", key, "\""));
}

absl::Status Builder::Reserve(const std::string& target, bool kohya, TensorPatch::Kind kind,
                              bool lora, const std::string& key) {
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

absl::Status Builder::Add(std::string target, bool kohya, TensorPatchPtr patch, bool lora,
                          const std::string& key, uint64_t bytes) {
  WD_RETURN_IF_ERROR(Reserve(target, kohya, patch->kind(), lora, key));
  adapter->bytes += bytes;
  adapter->entries.push_back(AdapterEntry{std::move(target), kohya, std::move(patch)});
  return absl::OkStatus();
}

absl::Status Builder::AddDense(const KeyInfo& k) {
  const LoadedTensor& t = T(&k);
  const auto mode = k.role == Role::kDenseAdd ? DensePatch::Mode::kAdd : DensePatch::Mode::kSet;
  auto patch = DensePatch::Create(Source(k.module), t.shape, t.values, mode);
  if (!patch.ok()) return AnnotateKey(patch.status(), file, k.key);
  return Add(k.module, k.kohya_name, *patch, false, k.key, (*patch)->bytes());
}

absl::Status Builder::AddReplacement(const KeyInfo& k, const std::string& target) {
  const LoadedTensor& t = T(&k);
  auto patch = DensePatch::Create(Source(target), t.shape, t.values,
                                  DensePatch::Mode::kSetIgnoringStrength);
  if (!patch.ok()) return AnnotateKey(patch.status(), file, k.key);
  return Add(target, false, *patch, false, k.key, (*patch)->bytes());
}

absl::StatusOr<LowRankFactors> Builder::Factors(const KeyInfo* down, const KeyInfo* up,
                                                absl::string_view down_name,
                                                absl::string_view up_name) {
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

absl::StatusOr<double> Builder::ScalarAlpha(const KeyInfo* k, int64_t rank) {
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

}  // namespace weightd::adapter_internal
