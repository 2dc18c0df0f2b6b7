// The grpc transport's reads: a fetched shard's tensor bytes streamed from
// the daemon (Shards.Read) — only the tensors' ranges, never whole
// segments (a view-backed tensor lives in a segment that may hold its
// whole checkpoint). Ranges of one segment closer than kReadMergeGap (the
// client policy's) are read as one. Stateless; thread-safe.
#ifndef WEIGHTD_CLIENT_GRPC_READ_H_
#define WEIGHTD_CLIENT_GRPC_READ_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

// One tensor range to read, after merging: [lo, hi) of `segment`, holding
// `tensors` (indices into the FetchResponse).
struct ReadRun {
  uint32_t segment = 0;
  uint64_t lo = 0, hi = 0;
  std::vector<int> tensors;
};

// The runs of `resp`'s non-empty tensors, in (segment, offset) order: a
// tensor starting at most kReadMergeGap bytes past the previous run's end
// in the same segment joins it. REQUIRES: every tensor lies inside its
// segment (the caller checked).
std::vector<ReadRun> PlanReadRuns(const v1::FetchResponse& resp);

// One Read per run; returns the start of each tensor's bytes (nullptr for
// empty ones), kept in `buffers`. The chunk errors of
// common/grpc/chunk_stream.h (DATA_LOSS for chunks out of order, too long
// or short), the daemon's own otherwise.
absl::StatusOr<std::vector<const uint8_t*>> ReadTensorRanges(v1::Shards::Stub* stub,
                                                             const v1::FetchResponse& resp,
                                                             std::vector<std::string>* buffers);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_GRPC_READ_H_
