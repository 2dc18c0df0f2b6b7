// Profile's small pieces: the report's summary, the layout's lookup, the
// empty profile and Identity. Parsing a profile document is in
// profile_parse.cc and mapping a checkpoint through one in profile_map.cc.
#include "server/profile/profile.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/untrusted_text.h"
#include "server/profile/name_summary.h"
#include "server/profile/profile_internal.h"

namespace weightd {

namespace profile_internal {

std::string Quote(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes &&
      FindControlCharacter(text) == absl::string_view::npos) {
    return absl::StrCat("\"", text, "\"");
  }
  return QuoteForMessage(text);
}

}  // namespace profile_internal

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

Profile::Profile() = default;

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
