#include "server/service/model.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

constexpr size_t kMaxModelName = 128;

}  // namespace

absl::Status ValidateModelName(const std::string& name) {
  if (name.empty() || name.size() > kMaxModelName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model name must be 1 to ", kMaxModelName, " characters, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (!(std::isalnum(c) || c == '.' || c == '_' || c == '-' || c == '/' || c == ':')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model name \"", absl::CHexEscape(name),
          "\" may hold only letters, digits and . _ - / :"));
    }
  }
  return absl::OkStatus();
}

std::vector<ReadGuard> ModelGuards(const Model& model) {
  std::vector<ReadGuard> guards;
  if (!model.readers.empty()) {
    guards.push_back(ReadGuard{absl::StrCat("model \"", model.name, "\""), model.readers});
  }
  return guards;
}

std::vector<ReadGuard> GuardsOf(const Model& model, const Generation& gen) {
  std::vector<ReadGuard> guards = ModelGuards(model);
  for (const ReadGuard& g : gen.adapter_guards) {
    guards.push_back(ReadGuard{absl::StrCat(g.what, " (applied to model \"", model.name,
                                            "\" at generation ", gen.number, ")"),
                               g.readers});
  }
  return guards;
}

std::vector<const Served*> ServedAt(const Model& model, const Generation& gen) {
  std::vector<const Served*> out;
  const std::vector<Served>& base = gen.served != nullptr ? *gen.served : *model.served;
  out.reserve(base.size() + gen.added.size());
  for (const Served& s : base) out.push_back(&s);
  for (const Served& s : gen.added) out.push_back(&s);
  std::sort(out.begin(), out.end(),
            [](const Served* a, const Served* b) { return a->plan.name < b->plan.name; });
  return out;
}

}  // namespace weightd
