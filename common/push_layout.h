// Where a push writes each tensor of a fetch in the client's destination
// (common/data_protocol.h): the default layout both sides compute, and the
// check of offsets a client chose. Pure functions, shared by the daemon and
// the clients.
#ifndef WEIGHTD_COMMON_PUSH_LAYOUT_H_
#define WEIGHTD_COMMON_PUSH_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace weightd {

// Every tensor of a push starts at a multiple of this (CUDA's allocation
// granularity for vectorized access; also every dtype's alignment).
inline constexpr uint64_t kPushAlignment = 256;

struct PushLayout {
  std::vector<uint64_t> offsets;  // one per tensor
  std::vector<uint64_t> lengths;  // the tensors' byte lengths
  uint64_t size = 0;              // bytes the destination must have
};

// Tensor i at the next multiple of kPushAlignment after tensor i-1's end,
// the first at 0; size = the last tensor's end (0 for none).
// INVALID_ARGUMENT if the layout would pass 2^63 bytes.
absl::StatusOr<PushLayout> DefaultPushLayout(absl::Span<const uint64_t> lengths);

// Checks a client's offsets for tensors of `lengths`: as many as tensors,
// each a multiple of kPushAlignment, no two non-empty tensors overlapping,
// no end past 2^63. Returns the layout (size = the furthest end).
// INVALID_ARGUMENT naming the first offending tensor (by index).
absl::StatusOr<PushLayout> CheckPushLayout(absl::Span<const uint64_t> lengths,
                                           absl::Span<const uint64_t> offsets);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_PUSH_LAYOUT_H_
