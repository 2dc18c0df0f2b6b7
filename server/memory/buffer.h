// Buffer: bytes the daemon holds, knowing which memory they live in.
//
// The memory seam (Arrow's Buffer / MemoryManager is the model). What the
// daemon serves is a sealed, immutable buffer shared by checkpoints, cache
// entries and leases (BufferPtr) and freed when the last holder lets go.
// Whoever only moves bytes to a client — leases, the data socket, the fetch
// cache — asks the buffer for its kind and a shareable fd and never needs
// to know more; only a fill backend of the buffer's own kind touches the
// bytes (host_data() is null where the CPU cannot address them).
//
// Memory kinds:
//   kHost        a sealed memfd in host memory (Segment, server/memory/segment.h);
//                its fd is the memfd, which a client maps read-only.
//   kCudaDevice  GPU memory the daemon owns (issue [gpu]); its shareable fd
//                is a CUDA VMM POSIX fd a client imports. Not built yet:
//                nothing allocates it, and a kind a transport cannot carry
//                is refused there (UNIMPLEMENTED), never copied silently.
//
// Each kind has its memory manager (server/memory/host_memory.h for host
// memory) that allocates, seals, accounts against its own budget and
// reclaims.
#ifndef WEIGHTD_SERVER_MEMORY_BUFFER_H_
#define WEIGHTD_SERVER_MEMORY_BUFFER_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

enum class MemoryKind : uint8_t {
  kHost = 0,
  kCudaDevice = 1,
};

// "host", "cuda_device": as in messages and metrics.
absl::string_view MemoryKindName(MemoryKind kind);

// Where a buffer's bytes are: a memory kind and, for device memory, the
// device's ordinal in the daemon (-1 for host memory).
struct MemoryLocation {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;

  bool operator==(const MemoryLocation& o) const {
    return kind == o.kind && device == o.device;
  }
  bool operator!=(const MemoryLocation& o) const { return !(*this == o); }
};

class Buffer {
 public:
  virtual ~Buffer() = default;

  // Unique among the daemon's live and past buffers (never reused).
  virtual uint64_t id() const = 0;
  virtual uint64_t size() const = 0;
  virtual MemoryLocation location() const = 0;
  MemoryKind kind() const { return location().kind; }

  // The bytes, where the CPU can read them; nullptr for device memory.
  virtual const uint8_t* host_data() const = 0;

  // An fd that lets another process map (host) or import (device) this
  // buffer's bytes, read-only: borrowed, valid while the buffer lives.
  // FAILED_PRECONDITION before the buffer is sealed (a client must never
  // see bytes that can still change).
  virtual absl::StatusOr<int> ShareableFd() const = 0;
};

using BufferPtr = std::shared_ptr<const Buffer>;

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_BUFFER_H_
