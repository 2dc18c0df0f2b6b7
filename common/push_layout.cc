#include "common/push_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

constexpr uint64_t kMaxEnd = uint64_t{1} << 63;

}  // namespace

absl::StatusOr<PushLayout> DefaultPushLayout(absl::Span<const uint64_t> lengths) {
  PushLayout layout;
  layout.offsets.reserve(lengths.size());
  uint64_t end = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    uint64_t at = (end + kPushAlignment - 1) / kPushAlignment * kPushAlignment;
    if (lengths[i] > kMaxEnd || at > kMaxEnd - lengths[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " of the push ends past 2^63 bytes"));
    }
    layout.offsets.push_back(at);
    end = at + lengths[i];
  }
  layout.size = end;
  layout.lengths.assign(lengths.begin(), lengths.end());
  return layout;
}

absl::StatusOr<PushLayout> CheckPushLayout(absl::Span<const uint64_t> lengths,
                                           absl::Span<const uint64_t> offsets) {
  if (offsets.size() != lengths.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the push names ", offsets.size(),
                                                   " offsets for ", lengths.size(), " tensors"));
  }
  PushLayout layout;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (offsets[i] % kPushAlignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, "'s offset ", offsets[i],
                                                     " is not a multiple of ", kPushAlignment));
    }
    if (offsets[i] > kMaxEnd || lengths[i] > kMaxEnd - offsets[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " of the push ends past 2^63 bytes"));
    }
    layout.size = std::max(layout.size, offsets[i] + lengths[i]);
  }
  std::vector<size_t> order;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    size_t prev = order[k - 1], cur = order[k];
    if (offsets[prev] + lengths[prev] > offsets[cur]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors ", std::min(prev, cur), " and ", std::max(prev, cur),
          " of the push overlap (bytes [", offsets[prev], ", ", offsets[prev] + lengths[prev],
          ") and [", offsets[cur], ", ", offsets[cur] + lengths[cur], ")"));
    }
  }
  layout.offsets.assign(offsets.begin(), offsets.end());
  layout.lengths.assign(lengths.begin(), lengths.end());
  return layout;
}

}  // namespace weightd
