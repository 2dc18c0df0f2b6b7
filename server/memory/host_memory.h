// HostMemoryManager: the memory manager of the host kind (buffer.h).
//
// Everything the daemon allocates in host memory goes through here: the
// checkpoint loader's segments, the materializer's output segments, the
// metadata and adapter charges. One place owns what used to be wired
// together by WeightService:
//   - the budget (MemoryAccount, --host-memory-bytes);
//   - the warm reserve of pre-faulted chunks (SegmentPool, optional);
//   - the disposer, which frees large retired buffers off request threads;
//   - the reclaimer chain a short budget runs before it refuses: the
//     disposer's pending frees first (rank 0), then the warm reserve
//     (rank 10), then whatever owners of reclaimable memory add (the
//     materializer's unused cache entries, rank 20).
// A CUDA device memory manager (issue [gpu]) has the same jobs for device
// memory with its own budget; planning, leasing and the wire protocol see
// only Buffers.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MEMORY_HOST_MEMORY_H_
#define WEIGHTD_SERVER_MEMORY_HOST_MEMORY_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/memory/buffer.h"
#include "server/memory/disposer.h"
#include "server/memory/segment.h"
#include "server/memory/segment_pool.h"

namespace weightd {

struct HostMemoryStats {
  uint64_t limit_bytes = 0;     // 0 = unlimited
  uint64_t used_bytes = 0;      // segments and charges
  uint64_t segments = 0;        // live segments
  SegmentPoolStats reserve;     // zeros without a reserve
  HugePageMode huge_pages = HugePageMode::kOff;
  uint64_t page_bytes[kPageKinds] = {};  // live segments' bytes by PageKind
  uint64_t page_fallbacks = 0;           // huge segments that got a smaller kind
  HostPages host;                        // what the host offers now
};

class HostMemoryManager {
 public:
  struct Options {
    uint64_t limit_bytes = 0;  // 0 = unlimited
    // Warm reserve of pre-faulted chunks (SegmentPool); 0 = none.
    uint64_t warm_reserve_bytes = 0;
    uint64_t reserve_chunk_bytes = uint64_t{256} << 20;
    // Retired holders smaller than this are freed on the caller's thread.
    uint64_t dispose_min_bytes = uint64_t{16} << 20;
    // --huge-pages: the pages of every segment allocated here, the warm
    // reserve's chunks included (huge_pages.h).
    HugePageMode huge_pages = HugePageMode::kOff;
    // Sealed segments keep the daemon's mapping writable (the seals still
    // shut out every other writer): set where the host pinner registers
    // writable mappings (server/gpu/host_pinner.h, MemoryAccount).
    bool keep_writable_mappings = false;
  };

  struct AllocateOptions {
    // Names the memfd ("weightd:<purpose>", shown in /proc/<pid>/fd) and
    // the budget in messages.
    absl::string_view purpose = "buffer";
    // Touch every page now, so that the writer does not fault page by page.
    bool prefault = false;
    // Take a pre-faulted chunk from the warm reserve when `size` fits one
    // (output that must be fast to write right after a request); a fresh
    // segment when the reserve is empty or the size exceeds a chunk.
    bool warm = false;
    // false: charged to the budget without running the reclaimer chain
    // (memory made ahead of need must not evict anything for itself).
    bool reclaim = true;
  };

  // Registers the disposer's reclaimer and starts the reserve's filler.
  explicit HostMemoryManager(Options options);
  ~HostMemoryManager();
  HostMemoryManager(const HostMemoryManager&) = delete;
  HostMemoryManager& operator=(const HostMemoryManager&) = delete;

  // A writable segment of exactly `size` bytes, charged to the budget. When
  // the budget is short the reclaimer chain runs first; RESOURCE_EXHAUSTED
  // naming `purpose` if that does not free enough.
  absl::StatusOr<std::unique_ptr<Segment>> Allocate(uint64_t size,
                                                    const AllocateOptions& options);

  // A sealed memfd another process filled (a predecessor daemon's segment
  // at a hand-over), mapped read-only and charged to the budget as Allocate
  // would (Segment::Adopt).
  absl::StatusOr<std::unique_ptr<Segment>> Adopt(UniqueFd fd, PageKind pages,
                                                 absl::string_view purpose);

  // Host memory the daemon holds outside segments (tensor metadata, adapter
  // factors), charged to the same budget for as long as the charge lives;
  // the reclaimer chain runs when short.
  absl::StatusOr<std::unique_ptr<MemoryCharge>> Charge(uint64_t bytes, absl::string_view what);

  // Frees a segment nothing else needs any more (an evicted cache entry):
  // here with `now` (the caller needs the budget back at once, e.g. a
  // reclaimer); else, with a warm reserve, in an idle moment between
  // materializations (or when the budget runs short), without one on the
  // disposer's thread.
  void Retire(SegmentPtr segment, bool now);

  // Brackets foreground work (a materialization): background refills and
  // idle disposals pause meanwhile.
  class WorkScope {
   public:
    explicit WorkScope(HostMemoryManager* memory);
    ~WorkScope();
    WorkScope(const WorkScope&) = delete;
    WorkScope& operator=(const WorkScope&) = delete;

   private:
    SegmentPool* pool_;
  };

  // Adds `fn` to the reclaimer chain at `rank` (MemoryAccount::AddReclaimer;
  // the owner removes it with RemoveReclaimer before it goes away).
  uint64_t AddReclaimer(int rank, std::function<uint64_t(uint64_t)> fn);
  void RemoveReclaimer(uint64_t id);

  // The reserve's chunk size; 0 without a reserve. Packing output into
  // chunk-sized segments lets every one of them come from the reserve.
  uint64_t reserve_chunk_bytes() const;
  // Waits until the reserve holds its target (true) or `timeout` passes;
  // true at once without a reserve.
  bool WaitReserveFull(absl::Duration timeout);

  HostMemoryStats stats() const;
  // For owners that hand it holders directly (the lease table), and tests.
  Disposer* disposer() { return &disposer_; }
  const std::shared_ptr<MemoryAccount>& account() const { return account_; }

 private:
  const Options options_;
  const std::shared_ptr<MemoryAccount> account_;
  Disposer disposer_;
  uint64_t disposer_reclaimer_ = 0;
  std::unique_ptr<SegmentPool> pool_;  // null without a reserve
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MEMORY_HOST_MEMORY_H_
