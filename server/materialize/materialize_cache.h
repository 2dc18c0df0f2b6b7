// The materializer's cache: results by their inputs (part digests, boxes,
// patches and strengths, output dtype, scale, and the caller's read scope),
// so that identical requests — HSDP replicas, repeated fetches — share one
// copy.
//
// A view entry points into its stored buffer without owning it (a cached
// view never keeps an unloaded checkpoint's memory alive). A packed entry
// lives as long as its packed buffer, which the cache holds until it is
// evicted: unused (only the cache holds it) under memory pressure, or
// orphaned (its base is gone, or its tag retired) by a sweep. Evicted
// buffers are handed to the caller, never freed under the cache's lock.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MATERIALIZE_MATERIALIZE_CACHE_H_
#define WEIGHTD_SERVER_MATERIALIZE_MATERIALIZE_CACHE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "server/materialize/item.h"
#include "server/memory/segment.h"

namespace weightd {

struct MaterializerStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t entries = 0;
  uint64_t packed_segments = 0;
  uint64_t packed_bytes = 0;
};

class MaterializeCache {
 public:
  // The key of `item` for callers of read scope `scope` ("" = public).
  // Entries of different scopes never meet, whatever the rest holds.
  static std::string Key(const MaterializeItem& item, const std::string& scope);

  // Fills out[i] for every key found; returns the indices of the others.
  std::vector<size_t> Lookup(absl::Span<const std::string> keys,
                             std::vector<MaterializedTensor>* out) ABSL_LOCKS_EXCLUDED(mu_);

  // A buffer one call packed its results into.
  struct Packed {
    SegmentPtr buffer;
    const StoredTensor* first_base = nullptr;  // its buffer's death orphans it
    bool tagged = false;                        // dropped when `tag` retires
  };
  // Records a call's results for `misses` (indices into keys and out): the
  // packed buffers they point into, then one entry each. A result another
  // call recorded first keeps its entry (identical bytes); a packed buffer
  // left without entries is not kept.
  void Insert(absl::Span<const std::string> keys, absl::Span<const size_t> misses,
              const std::vector<MaterializedTensor>& out, absl::Span<const Packed> packed,
              const std::string& tag) ABSL_LOCKS_EXCLUDED(mu_);

  // Marks `tag` retired: its buffers go at the next eviction that finds
  // them unheld.
  void RetireTag(const std::string& tag) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops packed buffers only the cache holds; with `orphans_only`, just
  // those whose base is gone or whose tag retired. Then drops the entries
  // left dangling. The buffers' last holds are moved to `dropped`, for the
  // caller to free unlocked. Returns their bytes.
  uint64_t Evict(bool orphans_only, std::vector<SegmentPtr>* dropped) ABSL_LOCKS_EXCLUDED(mu_);

  MaterializerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::weak_ptr<const Buffer> view_of;  // views; not owning
    uint64_t packed_id = 0;               // 0 for views
    uint64_t offset = 0;
    uint64_t length = 0;
    Digest digest;
  };
  struct PackedBuffer {
    SegmentPtr buffer;
    std::weak_ptr<const Buffer> base;
    uint64_t entries = 0;
    std::string tag;
  };

  bool LookupLocked(const std::string& key, MaterializedTensor* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EntryLive(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PackedBuffer> packed_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> retired_tags_ ABSL_GUARDED_BY(mu_);
  int sweeps_since_prune_ ABSL_GUARDED_BY(mu_) = 0;
  MaterializerStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_MATERIALIZE_CACHE_H_
