// Fuzzes Profile::Parse (server/profile/profile.h) — profile documents come
// from operators and LoadRequest.profile_json — and, for every profile it
// accepts, Profile::Map over a small fixed checkpoint (a two-layer Llama plus
// a few odd tensors: 0-dim, integer, FP8, _extra_state), checking the
// ServedLayout invariants the store and materializer rely on.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/untrusted_text.h"
#include "server/profile/profile.h"

namespace weightd {
namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

std::vector<SourceTensorInfo> MakeCheckpoint() {
  constexpr int64_t kHidden = 8, kKv = 4, kFfn = 16, kVocab = 10;
  std::vector<SourceTensorInfo> out = {
      {"model.embed_tokens.weight", DType::kBF16, {kVocab, kHidden}},
      {"model.norm.weight", DType::kF32, {kHidden}},
      {"lm_head.weight", DType::kBF16, {kVocab, kHidden}},
      {"model.rotary.inv_freq", DType::kF32, {}},
      {"model.step", DType::kI64, {}},
      {"model.mask", DType::kBool, {kHidden, kHidden}},
      {"model.fp8.weight", DType::kF8E4M3, {kHidden, kHidden}},
      {"model.fp8.weight_scale", DType::kF32, {}},
      {"model.layers.0.mlp._extra_state", DType::kU8, {0}},
  };
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    out.push_back({p + "self_attn.q_proj.weight", DType::kBF16, {kHidden, kHidden}});
    out.push_back({p + "self_attn.k_proj.weight", DType::kBF16, {kKv, kHidden}});
    out.push_back({p + "self_attn.v_proj.weight", DType::kBF16, {kKv, kHidden}});
    out.push_back({p + "self_attn.o_proj.weight", DType::kBF16, {kHidden, kHidden}});
    out.push_back({p + "mlp.gate_proj.weight", DType::kBF16, {kFfn, kHidden}});
    out.push_back({p + "mlp.up_proj.weight", DType::kBF16, {kFfn, kHidden}});
    out.push_back({p + "mlp.down_proj.weight", DType::kBF16, {kHidden, kFfn}});
    out.push_back({p + "input_layernorm.weight", DType::kF16, {kHidden}});
    out.push_back({p + "post_attention_layernorm.weight", DType::kF16, {kHidden}});
  }
  return out;
}

const std::vector<SourceTensorInfo>& Checkpoint() {
  static const auto* const kCheckpoint = new std::vector<SourceTensorInfo>(MakeCheckpoint());
  return *kCheckpoint;
}

void CheckLayout(const ServedLayout& layout, const std::vector<SourceTensorInfo>& ckpt) {
  std::map<std::string, const SourceTensorInfo*> by_name;
  for (const SourceTensorInfo& t : ckpt) by_name[t.name] = &t;

  FUZZ_CHECK(layout.reverse.size() == layout.tensors.size());
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ServedTensorPlan& plan = layout.tensors[i];
    FUZZ_CHECK(!plan.name.empty());
    if (i > 0) FUZZ_CHECK(layout.tensors[i - 1].name < plan.name);
    FUZZ_CHECK(layout.Find(plan.name) == &plan);
    FUZZ_CHECK(plan.parts.size() == plan.part_rows.size());

    auto rev = layout.reverse.find(plan.name);
    FUZZ_CHECK(rev != layout.reverse.end());
    FUZZ_CHECK(rev->second.size() == plan.parts.size());
    int64_t rows = 0;
    for (size_t k = 0; k < plan.parts.size(); ++k) {
      FUZZ_CHECK(rev->second[k] == plan.parts[k].source);
      auto src = by_name.find(plan.parts[k].source);
      FUZZ_CHECK(src != by_name.end());
      FUZZ_CHECK(src->second->dtype == plan.dtype);
      rows += plan.part_rows[k];
    }
    for (int64_t d : plan.shape) FUZZ_CHECK(d >= 0);
    // Every size computed from a plan fits (issue 16 F10, F17).
    FUZZ_CHECK(CheckShapeFits(plan.shape, kMaxDTypeSize).ok());
    FUZZ_CHECK(FindControlCharacter(plan.name) == absl::string_view::npos);
    if (plan.parts.size() == 1) {
      FUZZ_CHECK(by_name[plan.parts[0].source]->shape == plan.shape);
    } else if (plan.parts.size() > 1) {
      FUZZ_CHECK(!plan.shape.empty());
      FUZZ_CHECK(plan.shape[0] == rows);
      for (const ServedPart& part : plan.parts) {
        const std::vector<int64_t>& s = by_name[part.source]->shape;
        FUZZ_CHECK(s.size() == plan.shape.size());
        FUZZ_CHECK(std::equal(s.begin() + 1, s.end(), plan.shape.begin() + 1));
      }
    }
    if (plan.per_part) FUZZ_CHECK(plan.parts.size() >= 2);
    if (plan.placements.has_value()) {
      FUZZ_CHECK(!plan.placements->empty() && plan.placements->size() <= 8);
    }
    if (plan.dtype_override.has_value()) {
      FUZZ_CHECK(CanCast(plan.dtype, *plan.dtype_override));
    }
    if (plan.quantize_fp8) {
      FUZZ_CHECK(IsFloating(plan.dtype));
      FUZZ_CHECK(layout.Find(plan.name + "_scale") == nullptr);
    }
  }
  const ProfileReport& r = layout.report;
  FUZZ_CHECK(std::is_sorted(r.skipped_extra_state.begin(), r.skipped_extra_state.end()));
  FUZZ_CHECK(std::is_sorted(r.unexpected.begin(), r.unexpected.end()));
  FUZZ_CHECK(std::is_sorted(r.zero_filled.begin(), r.zero_filled.end()));
  for (const std::string& name : r.zero_filled) {
    const ServedTensorPlan* plan = layout.Find(name);
    FUZZ_CHECK(plan != nullptr && plan->parts.empty());
  }
  const std::vector<std::string> lines = r.Summary();
  FUZZ_CHECK(lines.empty() == r.empty());
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<Profile> profile = Profile::Parse(in);
  if (!profile.ok()) {
    FUZZ_CHECK(profile.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  const std::vector<SourceTensorInfo>& ckpt = Checkpoint();
  absl::StatusOr<ServedLayout> layout = profile->Map(ckpt);
  if (!layout.ok()) {
    const absl::StatusCode code = layout.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument ||
               code == absl::StatusCode::kFailedPrecondition);
    return 0;
  }
  CheckLayout(*layout, ckpt);
  return 0;
}
