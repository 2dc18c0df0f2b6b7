// Buffers the daemon owns and exports (common/data_protocol.h,
// kCudaDaemonExport): filled once per fetch table and device, handed to
// every client that exports the same table to the same device, held while
// a client holds its ExportHold (the data socket: while the connection that
// took it is open), and kept afterwards, unheld, until the room is needed.
// Every buffer counts against bounds, none of them "unlimited":
//   - per device, the buffers held or kept take at most the request's
//     `device_bytes` (--device-memory-bytes): a fill first evicts the least
//     recently used unheld ones, and is RESOURCE_EXHAUSTED when the held
//     ones leave no room;
//   - per holder (a peer uid) and device, the buffers its holds keep take at
//     most `holder_bytes` (--max-export-bytes-per-uid): a Get past it is
//     RESOURCE_EXHAUSTED, so one reader cannot take a device's whole budget
//     (a buffer it holds already counts once, however often held);
//   - in all, at most Options::max_buffers buffers (each keeps an fd of the
//     daemon's), and a holder holds at most Options::max_buffers_per_holder;
//   - Reclaim() gives unheld buffers back under memory pressure (the host
//     twin's buffers are host memory segments: its reclaimer).
// A buffer whose fetch table died is never handed out again; it goes when
// its last hold does.
//
// Thread-safe. Fills run one at a time, and a lookup waits for a fill in
// progress (an export is rare next to a push; a fill of many GiB delays
// the others: a known limit). The cache must outlive its holds.
#ifndef WEIGHTD_SERVER_PUSH_EXPORT_CACHE_H_
#define WEIGHTD_SERVER_PUSH_EXPORT_CACHE_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/fd.h"
#include "server/memory/segment.h"

namespace weightd {

// A filled buffer: fd() exports it (dup()ed for each client). A device
// buffer owns `fd` and `release` frees it (after the fd is closed); the
// host twin is a sealed `segment` charged to the host memory budget, whose
// memfd exports it.
struct ExportedBuffer {
  UniqueFd fd;
  std::shared_ptr<const Segment> segment;
  uint64_t size = 0;
  std::function<void()> release;
  ExportedBuffer() = default;
  ExportedBuffer(const ExportedBuffer&) = delete;
  ExportedBuffer& operator=(const ExportedBuffer&) = delete;
  ~ExportedBuffer() {
    fd.Reset();
    segment.reset();
    if (release) release();
  }
  int export_fd() const { return segment != nullptr ? segment->fd() : fd.get(); }
};

struct ExportCacheStats {
  uint64_t buffers = 0;
  uint64_t bytes = 0;
  uint64_t held = 0;  // buffers some hold keeps
  uint64_t fills = 0;
  uint64_t hits = 0;
  uint64_t evictions = 0;   // unheld buffers dropped for room (a fill's or a reclaimer's)
  uint64_t refusals = 0;    // Gets refused RESOURCE_EXHAUSTED
};

class ExportCache;

// One holder's claim on a buffer: the buffer stays while the hold lives and
// counts against the holder's share. Move-only; destroyed before the cache.
class ExportHold {
 public:
  ExportHold() = default;
  ExportHold(ExportHold&& other) noexcept { *this = std::move(other); }
  ExportHold& operator=(ExportHold&& other) noexcept;
  ExportHold(const ExportHold&) = delete;
  ExportHold& operator=(const ExportHold&) = delete;
  ~ExportHold() { Reset(); }

  const ExportedBuffer& buffer() const { return *buffer_; }
  bool valid() const { return cache_ != nullptr; }
  void Reset();

 private:
  friend class ExportCache;
  ExportHold(ExportCache* cache, uint64_t entry, uid_t holder,
             std::shared_ptr<const ExportedBuffer> buffer)
      : cache_(cache), entry_(entry), holder_(holder), buffer_(std::move(buffer)) {}

  ExportCache* cache_ = nullptr;
  uint64_t entry_ = 0;
  uid_t holder_ = 0;
  std::shared_ptr<const ExportedBuffer> buffer_;
};

// What one Get asks for, and the bounds it is held to.
struct ExportRequest {
  // The fetch table's identity, held weakly: its buffer is handed out only
  // while it lives.
  std::shared_ptr<const void> table;
  std::string device;  // "host", or a GPU's UUID
  uint64_t size = 0;   // bytes the fill will allocate
  uid_t holder = 0;
  uint64_t device_bytes = 0;  // the device's budget; > 0
  uint64_t holder_bytes = 0;  // the holder's share of it; > 0
};

class ExportCache {
 public:
  struct Options {
    size_t max_buffers = 1024;           // in all, held or kept
    size_t max_buffers_per_holder = 256;  // one holder's holds
  };
  explicit ExportCache(Options options) : options_(options) {}
  ExportCache() : ExportCache(Options{}) {}

  using Fill = std::function<absl::StatusOr<std::unique_ptr<ExportedBuffer>>()>;

  // A hold on the buffer of (request.table, request.device): the cached one
  // while the table lives, else `fill()`'s, once request.size bytes fit the
  // bounds above. `filled` says which. RESOURCE_EXHAUSTED names the bound.
  absl::StatusOr<ExportHold> Get(const ExportRequest& request, const Fill& fill,
                                 bool* filled = nullptr) ABSL_LOCKS_EXCLUDED(fill_mu_, mu_);

  // Drops unheld buffers of `device`, least recently used first, until
  // `bytes` are freed (or none is left); returns the bytes dropped. Never
  // waits for a fill: a memory reclaimer may call it from the fill's own
  // allocation.
  uint64_t Reclaim(const std::string& device, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // Bytes the device's buffers hold now, and those `holder` holds there.
  uint64_t bytes(const std::string& device) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t held_bytes(const std::string& device, uid_t holder) const ABSL_LOCKS_EXCLUDED(mu_);
  ExportCacheStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class ExportHold;
  struct Entry {
    std::weak_ptr<const void> table;
    const void* key = nullptr;  // table.get() when filled
    std::string device;
    std::shared_ptr<const ExportedBuffer> buffer;
    std::map<uid_t, size_t> holders;  // holds per holder
    size_t holds = 0;
    uint64_t last_use = 0;
  };
  void Release(uint64_t entry, uid_t holder) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes unheld entries of `device` ("" = any), dead tables' first, then
  // the least recently used, until `bytes` bytes and `buffers` buffers are
  // removed (or none is left); their buffers go to `dropped` (freed outside
  // mu_). Returns the bytes removed.
  uint64_t EvictUnheldLocked(const std::string& device, uint64_t bytes, size_t buffers,
                             std::vector<std::shared_ptr<const ExportedBuffer>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a refusal: RESOURCE_EXHAUSTED saying `why`.
  absl::Status RefuseLocked(std::string why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Get's phases, under mu_.
  using Entries = std::map<uint64_t, Entry>;
  // What a Get finds: the request's cached entry (or end()), the bytes of
  // the device's buffers, and the holder's bytes there and buffers
  // anywhere.
  struct Usage {
    Entries::iterator hit;
    uint64_t used = 0;
    uint64_t mine_bytes = 0;
    size_t mine_buffers = 0;
  };
  // Drops dead tables' buffers nobody holds (never handed out again).
  void DropDeadLocked(std::vector<std::shared_ptr<const ExportedBuffer>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Usage UsageLocked(const ExportRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The holder's share, unless it holds the cached buffer already.
  absl::Status CheckShareLocked(const ExportRequest& request, const Usage& usage)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for a new buffer of request.size bytes: evicts unheld ones of the
  // device (bytes) and of any device (count), or refuses.
  absl::Status MakeRoomLocked(const ExportRequest& request, uint64_t used,
                              std::vector<std::shared_ptr<const ExportedBuffer>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new hold of `entry`'s buffer for `holder`.
  ExportHold HoldLocked(Entries::iterator entry, uid_t holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Caches a filled buffer, held once by the request's holder.
  ExportHold InsertLocked(const ExportRequest& request,
                          std::shared_ptr<const ExportedBuffer> buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Options options_;

  // Serializes Gets (a fill runs under it, mu_ released), so that two
  // exports of one table fill one buffer.
  absl::Mutex fill_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  // Protected by mu_.
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  ExportCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUSH_EXPORT_CACHE_H_
