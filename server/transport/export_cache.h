// Buffers the daemon owns and exports (common/data_protocol.h,
// kCudaDaemonExport): filled once per fetch table and device, handed to
// every client that exports the same table to the same device, held while
// a client's connection holds it, and kept afterwards until the device's
// budget (--device-memory-bytes) needs the room: the least recently used
// unheld ones go first; RESOURCE_EXHAUSTED when the held ones leave none.
//
// Thread-safe. Fills run one at a time, and a lookup waits for a fill in
// progress (an export is rare next to a push; a fill of many GiB delays
// the others: a known limit).
#ifndef WEIGHTD_SERVER_TRANSPORT_EXPORT_CACHE_H_
#define WEIGHTD_SERVER_TRANSPORT_EXPORT_CACHE_H_

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

namespace weightd {

// A filled buffer: `fd` exports it (dup()ed for each client), `release`
// frees it (after the fd is closed) when the last holder lets go.
struct ExportedBuffer {
  UniqueFd fd;
  uint64_t size = 0;
  std::function<void()> release;
  ExportedBuffer() = default;
  ExportedBuffer(const ExportedBuffer&) = delete;
  ExportedBuffer& operator=(const ExportedBuffer&) = delete;
  ~ExportedBuffer() {
    fd.Reset();
    if (release) release();
  }
};

struct ExportCacheStats {
  uint64_t buffers = 0;
  uint64_t bytes = 0;
  uint64_t fills = 0;
  uint64_t hits = 0;
  uint64_t evictions = 0;
};

class ExportCache {
 public:
  // `budget`: bytes per device; 0 = no limit.
  explicit ExportCache(uint64_t budget) : budget_(budget) {}

  using Fill = std::function<absl::StatusOr<std::unique_ptr<ExportedBuffer>>()>;

  // The buffer of (`table`, `device`): the cached one while `table` lives
  // (`table` is the fetch table's identity, held weakly), else `fill()`'s,
  // once `size` bytes fit the device's budget. `filled` says which.
  absl::StatusOr<std::shared_ptr<const ExportedBuffer>> Get(
      const std::shared_ptr<const void>& table, const std::string& device, uint64_t size,
      const Fill& fill, bool* filled = nullptr) ABSL_LOCKS_EXCLUDED(fill_mu_, mu_);

  // Bytes the device's buffers hold now.
  uint64_t bytes(const std::string& device) const ABSL_LOCKS_EXCLUDED(mu_);
  ExportCacheStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::weak_ptr<const void> table;
    std::shared_ptr<const ExportedBuffer> buffer;
    uint64_t last_use = 0;
  };
  using Key = std::pair<const void*, std::string>;

  const uint64_t budget_;
  absl::Mutex fill_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Held buffers of dead tables whose key a new table took: counted until
  // their last holder lets go.
  std::vector<std::pair<std::string, std::shared_ptr<const ExportedBuffer>>> orphans_
      ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  ExportCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_TRANSPORT_EXPORT_CACHE_H_
