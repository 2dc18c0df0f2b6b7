// Pinning: registering the daemon's host segments (checkpoints, published
// weights) with CUDA (cudaHostRegister), so that a CUDA push copies from
// them by DMA at pinned speed instead of staging pageable memory through
// the driver (about half the bandwidth). --pin-host-memory: auto (when the
// daemon has GPUs), on, off.
//
// How, chosen once from the GPUs (ChoosePinPlan):
//  - read-only: the segment's own mapping, read-only once sealed, with
//    cudaHostRegisterReadOnly. Needs cudaDevAttrHostRegisterReadOnlySupported
//    on every GPU (Grace Hopper/Blackwell report 1).
//  - writable: x86 H100/H200 report 0 (read-only registration unsupported),
//    and a plain registration of a read-only mapping fails there. The
//    daemon's mapping of each segment then stays writable through the seal
//    (MemoryAccount::keep_writable_mappings): the memfd is still sealed
//    with F_SEAL_FUTURE_WRITE|F_SEAL_GROW|F_SEAL_SHRINK|F_SEAL_SEAL, so no
//    client can map it writable, write(2), truncate or punch it; only this
//    mapping, made before the seal, stays writable, and nothing writes
//    through it. Segments without such a mapping (adopted at a --take-over
//    hand-over, or sealed exclusively after a publisher wrote them in
//    place) are not pinned there: the "pinned" event counts them.
//  - none: pinning off, no GPU, or a GPU that registers no host memory.
// Registrations are portable (every GPU's context), made and undone with
// the first GPU current, and undone by the segment's release hook before
// its memory is unmapped. Each segment is pinned once however many
// checkpoints, generations or dedupe holders share it.
//
// Thread-safe. Pin() calls CUDA (blocking): callers hold no lock.
#ifndef WEIGHTD_SERVER_GPU_HOST_PINNER_H_
#define WEIGHTD_SERVER_GPU_HOST_PINNER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/gpu/cuda_plugin.h"
#include "server/gpu/gpu_devices.h"
#include "server/memory/segment.h"

namespace weightd {

enum class PinMode { kAuto, kOn, kOff };
enum class PinMethod { kNone, kReadOnly, kWritable };
// "none", "read_only", "writable": as in the "pinned" event.
absl::string_view PinMethodName(PinMethod method);

struct PinPlan {
  PinMethod method = PinMethod::kNone;
  int ordinal = 0;     // the device current while registering
  std::string reason;  // why kNone ("" when pinning is simply off)
  bool log_skips = false;  // kNone worth a "pin_skipped" event per model
};

// The method for `gpus` under `mode` (see the file comment).
PinPlan ChoosePinPlan(PinMode mode, const GpuInventory& gpus);

class HostPinner {
 public:
  struct Options {
    PinMode mode = PinMode::kAuto;
    GpuInventory gpus;
    // The registration calls (pin, unpin); null: the CUDA plugin's,
    // loaded at the first Pin (tests pass a fake).
    const CudaPluginApi* api = nullptr;
  };
  explicit HostPinner(Options options);
  HostPinner(const HostPinner&) = delete;
  HostPinner& operator=(const HostPinner&) = delete;

  const PinPlan& plan() const { return plan_; }
  // Whether sealed segments must keep a writable mapping for Pin
  // (HostMemoryManager::Options::keep_writable_mappings).
  bool wants_writable_mappings() const { return plan_.method == PinMethod::kWritable; }

  // Registers every host segment of `segments` not pinned yet (each
  // segment once, Segment::ClaimPinning); each is unregistered by its
  // release hook. Logs one "pinned" event (model, what, method, segments,
  // bytes, not_pinnable, ms, error) or, where pinning is off for a reason
  // worth saying, "pin_skipped" with it. Never fails: a segment CUDA
  // refuses stays pageable and the push still works, slower.
  void Pin(absl::string_view model, absl::string_view what,
           absl::Span<const SegmentPtr> segments);

  // Host memory registered now (stats pinned_bytes).
  uint64_t pinned_bytes() const { return pinned_bytes_->load(std::memory_order_relaxed); }

 private:
  const Options options_;
  const PinPlan plan_;
  // Shared with the release hooks, which may outlive the pinner.
  const std::shared_ptr<std::atomic<uint64_t>> pinned_bytes_ =
      std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GPU_HOST_PINNER_H_
