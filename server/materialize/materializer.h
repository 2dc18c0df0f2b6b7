// Materialization: the bytes of one rank's local shard of a stored tensor,
// in the dtype it asked for.
//
// A contiguous slice in the stored dtype is a view into the base segment
// (zero copy). Anything else (a cast, a non-contiguous slice) is packed into
// a new sealed segment. Results are cached by (base digest, global shape,
// box, output dtype) so identical requests — HSDP replicas, repeated
// fetches — share one copy. One Materialize() call packs all its misses into
// one segment, so a fetch hands out a handful of fds, not one per tensor.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
#define WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/store/checkpoint.h"
#include "server/store/segment.h"

namespace weightd {

struct MaterializeItem {
  const StoredTensor* tensor;  // borrowed for the call
  ShardBox box;
  DType out_dtype;
};

struct ServedTensor {
  SegmentPtr segment;
  uint64_t offset = 0;
  uint64_t length = 0;
  Digest digest;  // of the served bytes
  bool view = false;  // true when the bytes are the base segment's own
};

struct MaterializerStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t entries = 0;
  uint64_t packed_segments = 0;
  uint64_t packed_bytes = 0;
};

class Materializer {
 public:
  struct Options {
    std::shared_ptr<MemoryAccount> account;
    int threads = 2;  // workers that slice and cast one call's misses
  };
  explicit Materializer(Options options);

  // One result per item, in order. Fails with INVALID_ARGUMENT for a cast
  // the kernels do not support, RESOURCE_EXHAUSTED when the budget cannot
  // hold the packed segment even after evicting unused cache entries.
  absl::StatusOr<std::vector<ServedTensor>> Materialize(
      absl::Span<const MaterializeItem> items) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops every cache entry nobody else holds (its segment is referenced
  // only by the cache): used under memory pressure. Returns bytes freed.
  uint64_t EvictUnused() ABSL_LOCKS_EXCLUDED(mu_);

  // Drops the entries derived from base segments that are gone (their
  // checkpoint was unloaded and nothing leases it) once no lease holds
  // them either. Returns bytes freed.
  uint64_t Sweep() ABSL_LOCKS_EXCLUDED(mu_);

  MaterializerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Key {
    Digest base;
    DType src;
    DType out;
    std::vector<int64_t> global_shape;
    std::vector<int64_t> offset;
    std::vector<int64_t> shape;
    bool operator==(const Key& o) const {
      return base == o.base && src == o.src && out == o.out &&
             global_shape == o.global_shape && offset == o.offset && shape == o.shape;
    }
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.base, k.src, k.out, k.global_shape,
                        k.offset, k.shape);
    }
  };
  struct Entry {
    // Views point into the base segment without owning it, so that a
    // cached view never keeps an unloaded checkpoint's memory alive.
    std::weak_ptr<const Segment> view_segment;
    uint64_t packed_segment_id = 0;  // 0 for views
    uint64_t offset = 0;
    uint64_t length = 0;
    Digest digest;
  };
  struct PackedSegment {
    SegmentPtr segment;
    std::weak_ptr<const Segment> base;  // of the first item; for sweeping
    uint64_t entries = 0;
  };

  static Key MakeKey(const MaterializeItem& item);
  // Looks `key` up; fills `out` on a hit.
  bool Lookup(const Key& key, ServedTensor* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::unique_ptr<Segment>> CreateSegment(uint64_t size);
  // Drops packed segments only the cache holds; with `orphans_only`, just
  // those whose base is gone. Then drops the entries left dangling.
  uint64_t EvictLocked(bool orphans_only) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, Entry> cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PackedSegment> packed_ ABSL_GUARDED_BY(mu_);
  MaterializerStats stats_ ABSL_GUARDED_BY(mu_);
};

// Copies the `box` of the row-major tensor at `src` (dtype `src_dtype`,
// shape `global_shape`) into `dst`, densely, converting to `dst_dtype`.
absl::Status CopyBox(const uint8_t* src, DType src_dtype,
                     absl::Span<const int64_t> global_shape, const ShardBox& box,
                     uint8_t* dst, DType dst_dtype);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
