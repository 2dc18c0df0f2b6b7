#include "server/publish/publish_plan.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {

uint64_t PublishTensorSpec::bytes() const {
  return static_cast<uint64_t>(NumElements(shape)) * DTypeSize(dtype);
}

absl::StatusOr<PublishLayout> LayoutPublish(absl::Span<const PublishTensorSpec> specs) {
  if (specs.empty()) return absl::InvalidArgumentError("a publish needs at least one tensor");
  absl::flat_hash_set<std::string> seen;
  PublishLayout layout;
  uint64_t at = 0;
  for (const PublishTensorSpec& s : specs) {
    if (!seen.insert(s.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", s.name, "\" is published twice"));
    }
    absl::Status fits = CheckShapeFits(s.shape, DTypeSize(s.dtype));
    if (!fits.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", s.name, "\": ", fits.message()));
    }
    at = (at + kPublishAlignment - 1) / kPublishAlignment * kPublishAlignment;
    layout.offsets.push_back(at);
    const uint64_t n = s.bytes();
    if (at + n < at) return absl::InvalidArgumentError("the published tensors are too large");
    at += n;
  }
  layout.total = at == 0 ? 1 : at;
  return layout;
}

absl::Status RangeCoverage::Add(uint64_t offset, uint64_t length) {
  const uint64_t end = offset + length;
  if (end < offset || end > size_) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", ", end,
                                                   ") lie past the tensor's end (", size_, ")"));
  }
  if (length == 0) return absl::OkStatus();
  // The first range that ends after `offset` must begin at or after `end`.
  auto next = ranges_.upper_bound(offset);
  if (next != ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->second > offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("bytes [", offset, ", ", end, ") overlap bytes [", prev->first, ", ",
                       prev->second, ") already written"));
    }
  }
  if (next != ranges_.end() && next->first < end) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", ", end,
                                                   ") overlap bytes [", next->first, ", ",
                                                   next->second, ") already written"));
  }
  uint64_t begin = offset, stop = end;
  // Merge with adjacent neighbours.
  if (next != ranges_.end() && next->first == end) {
    stop = next->second;
    next = ranges_.erase(next);
  }
  if (next != ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->second == offset) {
      prev->second = stop;
      covered_ += length;
      return absl::OkStatus();
    }
  }
  ranges_.emplace(begin, stop);
  covered_ += length;
  return absl::OkStatus();
}

std::optional<std::pair<uint64_t, uint64_t>> RangeCoverage::FirstGap() const {
  if (complete()) return std::nullopt;
  uint64_t at = 0;
  for (const auto& [b, e] : ranges_) {
    if (b > at) return std::make_pair(at, b);
    at = e;
  }
  return std::make_pair(at, size_);
}

std::vector<PartBytes> SplitParts(absl::Span<const int64_t> shape, DType dtype,
                                  absl::Span<const int64_t> part_rows) {
  uint64_t row = DTypeSize(dtype);
  for (size_t d = 1; d < shape.size(); ++d) row *= static_cast<uint64_t>(shape[d]);
  std::vector<PartBytes> out;
  uint64_t at = 0;
  for (int64_t rows : part_rows) {
    const uint64_t n = static_cast<uint64_t>(rows) * row;
    out.push_back(PartBytes{at, n});
    at += n;
  }
  return out;
}

}  // namespace weightd
