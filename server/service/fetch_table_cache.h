// FetchTableCache: the tables of fetches served before, by request and
// generation, so that a repeated fetch costs a lookup and a lease (no
// planning, no materialization). An entry holds its generation and its
// segments weakly: once the materializer evicts a segment, or the
// generation is retired, the entry misses (and is dropped); it never keeps
// memory alive nor outlives its generation. The read guards it stores are
// the generation's, for the caller to check on every hit.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_SERVICE_FETCH_TABLE_CACHE_H_
#define WEIGHTD_SERVER_SERVICE_FETCH_TABLE_CACHE_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "server/auth/access_control.h"
#include "server/service/fetch_plan.h"
#include "server/memory/buffer.h"

namespace weightd {

class FetchTableCache {
 public:
  struct Hit {
    std::shared_ptr<const FetchTable> table;
    std::vector<BufferPtr> buffers;  // held now, for the lease
    std::vector<ReadGuard> guards;
  };

  // At `capacity` entries a store first drops everything (the working set
  // of a serving node is far smaller; a flood of distinct requests must
  // not grow it without bound).
  explicit FetchTableCache(size_t capacity = 1024) : capacity_(capacity) {}

  // The entry for `key` if it was stored for this very `generation` object
  // and every segment it names is still alive; nullopt otherwise (and a
  // dead entry is dropped).
  std::optional<Hit> Lookup(const std::string& key,
                            const std::shared_ptr<const void>& generation)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Stores (or replaces) `key`'s entry. Dead entries go first: stores follow
  // misses (a materialization at least), so the pass is cheap next to them.
  void Store(std::string key, const std::shared_ptr<const void>& generation,
             std::shared_ptr<const FetchTable> table, const std::vector<BufferPtr>& buffers,
             std::vector<ReadGuard> guards) ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::weak_ptr<const void> generation;
    std::shared_ptr<const FetchTable> table;
    std::vector<std::weak_ptr<const Buffer>> buffers;
    std::vector<ReadGuard> guards;
  };

  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_FETCH_TABLE_CACHE_H_
