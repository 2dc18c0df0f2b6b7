// Publish planning: the pure parts of a publish (WeightService::BeginPublish
// and friends) — where each published tensor lies in the staging segment,
// which byte ranges of it have arrived, and how a served tensor's bytes
// split into the checkpoint parts it replaces. No locks, no I/O.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_PLAN_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_PLAN_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace weightd {

// One tensor a publisher will write: a served name of the model, in the
// dtype and shape the model stores it in.
struct PublishTensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t bytes() const;
};

// Each tensor starts at a multiple of this in the staging segment (so a
// publisher may copy straight into it from a GPU or with vector stores).
inline constexpr uint64_t kPublishAlignment = 256;

struct PublishLayout {
  std::vector<uint64_t> offsets;  // per spec, in the staging segment
  uint64_t total = 0;             // the segment's size (>= 1)
};
// INVALID_ARGUMENT for an empty list, a name given twice, a shape that
// does not fit (CheckShapeFits).
absl::StatusOr<PublishLayout> LayoutPublish(absl::Span<const PublishTensorSpec> specs);

// The byte ranges of one tensor that have arrived. A range that overlaps
// one already there is refused (every byte must arrive exactly once).
class RangeCoverage {
 public:
  explicit RangeCoverage(uint64_t size) : size_(size) {}
  // INVALID_ARGUMENT "bytes [a, b) ..." for a range past the end, or one
  // that overlaps bytes already written; nothing recorded then.
  absl::Status Add(uint64_t offset, uint64_t length);
  uint64_t size() const { return size_; }
  uint64_t covered() const { return covered_; }
  bool complete() const { return covered_ == size_; }
  // Disjoint ranges recorded (what the coverage holds in memory).
  size_t ranges() const { return ranges_.size(); }
  // The first range not yet written, [begin, end); nullopt when complete.
  std::optional<std::pair<uint64_t, uint64_t>> FirstGap() const;

 private:
  uint64_t size_;
  uint64_t covered_ = 0;
  std::map<uint64_t, uint64_t> ranges_;  // begin -> end, disjoint, not adjacent
};

// Where part k of a served tensor (parts concatenated along dim 0, part
// k having part_rows[k] rows) lies in the served tensor's row-major bytes.
struct PartBytes {
  uint64_t offset = 0;
  uint64_t length = 0;
};
std::vector<PartBytes> SplitParts(absl::Span<const int64_t> shape, DType dtype,
                                  absl::Span<const int64_t> part_rows);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_PLAN_H_
