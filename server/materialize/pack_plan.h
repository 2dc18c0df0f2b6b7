// Planning a materialize call's misses: which are views into their stored
// buffer (zero copy) and where each of the others goes in the buffers the
// call will allocate. Pure: no memory is touched, nothing is locked.
//
// Misses are packed in order into one buffer or, with a warm reserve of
// `chunk_bytes` chunks (HostMemoryManager), into as many chunk-sized groups
// as they fill; an item larger than a chunk gets a group of its own. Items
// start on 64-byte boundaries.
#ifndef WEIGHTD_SERVER_MATERIALIZE_PACK_PLAN_H_
#define WEIGHTD_SERVER_MATERIALIZE_PACK_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/materialize/item.h"

namespace weightd {

inline constexpr uint64_t kPackAlign = 64;

// Where one miss goes.
struct PackSlot {
  size_t item = 0;      // index into the call's items
  bool view = false;    // the bytes are the stored buffer's own
  BufferPtr view_of;    // for a view: that buffer
  size_t group = 0;     // otherwise: the group it is packed into
  uint64_t offset = 0;  // in view_of, or in the group's buffer
  uint64_t length = 0;  // bytes
};

// One buffer to allocate and fill.
struct PackGroup {
  uint64_t bytes = 0;           // its size (at least 1 to allocate)
  bool tagged = false;          // holds a patched, quantized or scalar item
  const StoredTensor* first_base = nullptr;  // of its first item; for sweeping
  std::vector<size_t> slots;    // indices into PackPlan::slots
};

struct PackPlan {
  std::vector<PackSlot> slots;  // one per miss, in the order given
  std::vector<PackGroup> groups;
};

// INVALID_ARGUMENT (naming the tensor and both dtypes) for a cast the
// kernels do not support. `chunk_bytes` 0: no reserve, one group.
absl::StatusOr<PackPlan> PlanPack(absl::Span<const MaterializeItem> items,
                                  absl::Span<const size_t> misses, uint64_t chunk_bytes);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_PACK_PLAN_H_
