// The generations of a model: building one (an adapter stack and published
// weights on the checkpoint), installing, pruning and describing them,
// content identities and FP8 scales (generations.h).
#include "server/service/generations.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/adapter/lora_patch.h"
#include "server/materialize/cpu_fill.h"

namespace weightd {

Digest ContentIdentity(const ContentMap& content) {
  std::vector<std::pair<absl::string_view, const Digest*>> entries;
  entries.reserve(content.size());
  for (const auto& [name, digest] : content) entries.emplace_back(name, &digest);
  std::sort(entries.begin(), entries.end());
  DigestBuilder b;
  for (const auto& [name, digest] : entries) {
    const uint64_t n = name.size();
    b.Update(&n, sizeof(n));
    b.Update(name.data(), name.size());
    b.Update(digest->bytes.data(), digest->bytes.size());
  }
  return b.Finish();
}

namespace {

// The model's served tensors with the published parts in place of the
// checkpoint's; an allow_new tensor published becomes a one-part tensor of
// its own bytes.
std::shared_ptr<const std::vector<Served>> ServedWithPublished(const Model& model,
                                                               const PublishedBase& published) {
  // The published parts in place of the checkpoint's; an allow_new
  // tensor published becomes a one-part tensor of its own bytes.
  auto served = std::make_shared<std::vector<Served>>(*model.served);
  for (Served& s : *served) {
    if (s.parts.empty()) {
      auto it = published.find(s.plan.name);
      if (it == published.end()) continue;
      s.parts = {it->second.get()};
      s.plan.parts = {ServedPart{s.plan.name}};
      s.plan.part_rows = {s.plan.shape.empty() ? 1 : s.plan.shape[0]};
      continue;
    }
    for (const StoredTensor*& p : s.parts) {
      auto it = published.find(p->name);
      if (it != published.end()) p = it->second.get();
    }
  }
  return served;
}

// Puts the patches of `stack` (adapters[i] is stack[i]'s) on `gen`: by
// part key, with the served names each adapter touches, and the tensors
// .set_weight adds. INVALID_ARGUMENT for a stack that does not fit.
absl::Status AddPatches(const Model& model, const std::vector<AdapterRef>& stack,
                        const std::vector<std::shared_ptr<const Adapter>>& adapters,
                        Generation* gen) {
  // Where each checkpoint name and single-part served name lands.
  absl::flat_hash_map<std::string, std::pair<const Served*, const StoredTensor*>> by_name;
  for (const Served& s : *gen->served) {
    for (const StoredTensor* p : s.parts) by_name.emplace(p->name, std::make_pair(&s, p));
    if (s.parts.size() == 1) by_name.emplace(s.plan.name, std::make_pair(&s, s.parts[0]));
  }
  std::vector<std::string> base_names;
  for (const StoredTensor& t : model.checkpoint->tensors()) base_names.push_back(t.name);
  absl::flat_hash_map<std::string, size_t> added_index;
  for (size_t a = 0; a < stack.size(); ++a) {
    const AdapterRef& ref = stack[a];
    const Adapter& adapter = *adapters[a];
    if (!std::isfinite(ref.strength)) {
      return absl::InvalidArgumentError(absl::StrCat("adapter \"", ref.name,
                                                     "\": strength must be finite"));
    }
    for (const AdapterEntry& entry : adapter.entries) {
      std::string target = entry.target;
      if (entry.needs_kohya_resolution) {
        auto resolved = ResolveKohyaTarget(target, base_names);
        if (!resolved.ok()) {
          // Like any target the model lacks: the request does not fit the
          // model (NOT_FOUND would read as "adapter not loaded").
          return absl::InvalidArgumentError(absl::StrCat(
              "adapter \"", ref.name, "\": ", resolved.status().message()));
        }
        target = *resolved;
      }
      std::vector<int64_t> want = entry.patch->shape();
      auto it = by_name.find(target);
      std::string key;
      std::string served_name;
      if (it != by_name.end()) {
        const StoredTensor* part = it->second.second;
        if (want != part->shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              "adapter \"", ref.name, "\": patch for \"", target, "\" has shape ",
              ShapeString(want), " but the parameter is ", ShapeString(part->shape)));
        }
        if (!IsFloating(part->dtype)) {
          return absl::InvalidArgumentError(absl::StrCat("adapter \"", ref.name, "\": \"", target,
                                                         "\" is not a floating tensor"));
        }
        key = part->name;
        served_name = it->second.first->plan.name;
      } else if (entry.patch->kind() == TensorPatch::Kind::kReplace) {
        // .set_weight may add a parameter the checkpoint lacks.
        auto [ai, inserted] = added_index.try_emplace(target, gen->added.size());
        if (inserted) {
          Served s;
          s.plan.name = target;
          s.plan.dtype = DType::kF32;
          s.plan.shape = want;
          s.plan.part_rows = {want.empty() ? 1 : want[0]};
          gen->added.push_back(std::move(s));
        } else if (gen->added[ai->second].plan.shape != want) {
          return absl::InvalidArgumentError(absl::StrCat("adapters disagree on the shape of new "
                                                         "parameter \"", target, "\""));
        }
        key = target;
        served_name = target;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "adapter \"", ref.name, "\" patches \"", target, "\", which model \"", model.name,
            "\" does not have"));
      }
      gen->patches[key].push_back(AppliedPatch{entry.patch, ref.strength});
      auto& by = gen->patched_by[served_name];
      if (by.empty() || by.back() != ref.name) by.push_back(ref.name);
    }
  }
  return absl::OkStatus();
}

// Content identity per served tensor of `gen`, for --changed-since.
std::shared_ptr<ContentMap> ContentOf(const Model& model, const Generation& gen) {
  auto content = std::make_shared<ContentMap>();
  for (const Served* s : ServedAt(model, gen)) {
    DigestBuilder b;
    for (const StoredTensor* p : s->parts) b.Update(p->digest.bytes.data(), 16);
    std::vector<std::string> keys;
    for (const StoredTensor* p : s->parts) keys.push_back(p->name);
    if (s->parts.empty()) keys.push_back(s->plan.name);
    for (const std::string& k : keys) {
      auto pit = gen.patches.find(k);
      if (pit == gen.patches.end()) continue;
      for (const AppliedPatch& ap : pit->second) {
        std::string ck = ap.patch->CacheKey();
        b.Update(ck.data(), ck.size());
        b.Update(&ap.strength, sizeof(float));
      }
    }
    (*content)[s->plan.name] = b.Finish();
  }
  return content;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Generation>> BuildGeneration(
    const Model& model, uint64_t number, const std::vector<AdapterRef>& stack,
    std::vector<std::shared_ptr<const Adapter>> adapters,
    std::shared_ptr<const PublishedBase> published) {
  auto gen = std::make_shared<Generation>();
  gen->number = number;
  gen->stack = stack;
  gen->served = model.served;
  if (published != nullptr && !published->empty()) {
    gen->served = ServedWithPublished(model, *published);
    gen->published = std::move(published);
  }
  WD_RETURN_IF_ERROR(AddPatches(model, stack, adapters, gen.get()));
  gen->adapters = std::move(adapters);
  // Content identity per served tensor, for --changed-since.
  std::shared_ptr<ContentMap> content = ContentOf(model, *gen);
  gen->identity = ContentIdentity(*content);
  gen->content = std::move(content);
  return gen;
}

absl::StatusOr<float> Fp8Scale(const Served& served, const Generation& gen) {
  {
    absl::MutexLock lock(&gen.scale_mu);
    auto it = gen.fp8_scales.find(served.plan.name);
    if (it != gen.fp8_scales.end()) return it->second;
  }
  std::vector<PartSlice> slices;
  for (const StoredTensor* p : served.parts) {
    PartSlice s;
    s.stored = p;
    s.dtype = p->dtype;
    s.shape = p->shape;
    s.box.offset.assign(p->shape.size(), 0);
    s.box.shape = p->shape;
    auto pit = gen.patches.find(p->name);
    if (pit != gen.patches.end()) s.patches = pit->second;
    slices.push_back(std::move(s));
  }
  WD_ASSIGN_OR_RETURN(float amax, AbsMax(slices));
  // amax / 448 (docs/DESIGN.md §2.6); an all-zero tensor gets scale 1 so that x / scale
  // stays defined.
  float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
  absl::MutexLock lock(&gen.scale_mu);
  gen.fp8_scales[served.plan.name] = scale;
  return scale;
}

std::shared_ptr<const Generation> GenerationOf(const Model& model, uint64_t number) {
  if (number == 0) return model.current;
  for (const auto& g : model.history) {
    if (g->number == number) return g;
  }
  return nullptr;
}

std::shared_ptr<Model> WithGeneration(const Model& model, std::shared_ptr<Generation> gen,
                                      std::vector<uint64_t>* retired) {
  auto next = std::make_shared<Model>(model);
  next->current = gen;
  next->history.clear();
  for (const auto& g : model.history) {
    if (IsLeased(*g)) {
      next->history.push_back(g);
    } else {
      retired->push_back(g->number);
    }
  }
  next->history.push_back(gen);
  next->digests.emplace_back(gen->number, gen->content);
  if (next->digests.size() > kDigestHistory) next->digests.erase(next->digests.begin());
  return next;
}

std::shared_ptr<Model> WithoutUnleased(const Model& model, std::vector<std::string>* retired) {
  bool prune = false;
  for (const auto& g : model.history) {
    if (g != model.current && !IsLeased(*g)) prune = true;
  }
  if (!prune) return nullptr;
  auto next = std::make_shared<Model>(model);
  next->history.clear();
  for (const auto& g : model.history) {
    if (g == model.current || IsLeased(*g)) {
      next->history.push_back(g);
    } else {
      retired->push_back(absl::StrCat(model.name, "#", g->number));
    }
  }
  return next;
}

GenerationInfo InfoOf(const Model& model, const Generation& gen) {
  GenerationInfo info;
  info.model = model.name;
  info.generation = gen.number;
  for (const AdapterRef& r : gen.stack) {
    info.adapters.push_back(absl::StrCat(r.name, ":", r.strength));
  }
  info.guards = GuardsOf(model, gen);
  info.content = gen.identity;
  return info;
}

}  // namespace weightd
