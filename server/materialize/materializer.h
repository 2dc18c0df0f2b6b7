// Materialization: the bytes of one rank's local shard of a served tensor,
// in the dtype it asked for, with its adapter patches merged.
//
// A served tensor is one or more checkpoint tensors ("parts", concatenated
// along dim 0 by a profile's merge rules) or none (a zero-filled new
// parameter). A request names, per part, the box of that part it needs; the
// output is those boxes concatenated along dim 0.
//
// A single unpatched contiguous slice in the stored dtype is a view into the
// base segment (zero copy). Anything else — a cast, a non-contiguous slice,
// several parts, LoRA patches, FP8 quantization — is computed into a new
// sealed segment: patched slices in fp32 with one rounding at the end
// (DESIGN §2). Results are cached by their inputs (part digests, boxes,
// patches and strengths, output dtype, scale) so identical requests — HSDP
// replicas, repeated fetches — share one copy. One Materialize() call packs
// all its misses into one segment (or into chunks of the warm reserve, see
// SegmentPool), so a fetch hands out a handful of fds.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
#define WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/adapter/patch.h"
#include "server/store/checkpoint.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"

namespace weightd {

struct AppliedPatch {
  TensorPatchPtr patch;
  float strength = 1.0f;
};

// The box of one part that a request needs.
struct PartSlice {
  const StoredTensor* stored = nullptr;  // borrowed; nullptr = zeros
  DType dtype = DType::kF32;             // stored dtype (zero-fill dtype when no stored)
  std::vector<int64_t> shape;            // the part's shape
  ShardBox box;                          // in the part's coordinates
  std::vector<AppliedPatch> patches;     // applied in order, fp32
};

struct MaterializeItem {
  std::string name;  // for messages
  std::vector<PartSlice> slices;  // concatenated along dim 0
  DType out_dtype = DType::kF32;
  // FP8 quantization: out = e4m3(clamp(x / scale, ±448)); out_dtype must be
  // F8_E4M3.
  std::optional<float> fp8_scale;
  // Instead of slices: one F32 scalar (an FP8 scale companion tensor).
  std::optional<float> scalar;
};

struct MaterializedTensor {
  SegmentPtr segment;
  uint64_t offset = 0;
  uint64_t length = 0;
  Digest digest;      // of the served bytes
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
    // Where output segments come from (borrowed; outlives the
    // materializer). With a warm reserve a call's misses are packed into
    // chunk-sized segments taken from it; an item larger than a chunk, or
    // a call that finds the reserve empty, gets a fresh segment. Evicted
    // segments are retired through it, never freed under the lock. The
    // cache's unused entries join its reclaimer chain (kRankCache): a
    // short budget drops them before anything is refused.
    HostMemoryManager* memory = nullptr;
    int threads = 2;  // workers that slice, merge and cast one call's misses
  };
  explicit Materializer(Options options);
  ~Materializer();
  Materializer(const Materializer&) = delete;
  Materializer& operator=(const Materializer&) = delete;

  // One result per item, in order. Fails with INVALID_ARGUMENT for a cast
  // the kernels do not support, RESOURCE_EXHAUSTED when the budget cannot
  // hold the packed segment even after evicting unused cache entries.
  // `tag` names what the results depend on beyond their inputs' content
  // (e.g. "model#generation" when adapters are merged); packed segments
  // holding patched or quantized items carry it, and RetireTag() lets the
  // cache drop them once nothing holds them.
  //
  // `scope` (ReadScope of the request's read guards; "" = public) names who
  // may read what this call computes. A client maps or Reads whole
  // segments, so a result is shared only with calls of the same scope: a
  // hit never hands out a packed segment filled for another scope, nor a
  // view into another scope's checkpoint. Views of this call's own items
  // point into the segments its slices name, which the caller vouches for.
  absl::StatusOr<std::vector<MaterializedTensor>> Materialize(
      absl::Span<const MaterializeItem> items, const std::string& tag = "",
      const std::string& scope = "") ABSL_LOCKS_EXCLUDED(mu_);

  // The tag's segments are dropped now if unheld, else by a later Sweep().
  void RetireTag(const std::string& tag) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops every cache entry nobody else holds (its segment is referenced
  // only by the cache) and frees those segments here: the memory manager's
  // reclaimer (kRankCache), run when the budget is short. Returns bytes freed.
  uint64_t EvictUnused() ABSL_LOCKS_EXCLUDED(mu_);

  // Drops the entries derived from base segments that are gone (their
  // checkpoint was unloaded and nothing leases it) once no lease holds
  // them either. Returns bytes freed.
  uint64_t Sweep() ABSL_LOCKS_EXCLUDED(mu_);

  MaterializerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
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
    std::weak_ptr<const Segment> base;  // of the first stored part; for sweeping
    uint64_t entries = 0;
    std::string tag;
  };

  static std::string MakeKey(const MaterializeItem& item, const std::string& scope);
  // Looks `key` up; fills `out` on a hit.
  bool Lookup(const std::string& key, MaterializedTensor* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops packed segments only the cache holds; with `orphans_only`, just
  // those whose base is gone. Then drops the entries left dangling. The
  // segments' last holds are moved to `dropped`, to be freed unlocked.
  uint64_t EvictLocked(bool orphans_only, std::vector<SegmentPtr>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // EvictLocked, then retires what it dropped without the lock
  // (HostMemoryManager::Retire; `now`: the caller needs the budget back).
  uint64_t Evict(bool orphans_only, bool now) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  uint64_t reclaimer_id_ = 0;  // in the memory manager's chain
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PackedSegment> packed_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> retired_tags_ ABSL_GUARDED_BY(mu_);
  int sweeps_since_prune_ ABSL_GUARDED_BY(mu_) = 0;
  bool EntryLive(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MaterializerStats stats_ ABSL_GUARDED_BY(mu_);
};

// Elements of the item's output (sum over its slices).
int64_t OutputElements(const MaterializeItem& item);

// Copies the `box` of the row-major tensor at `src` (dtype `src_dtype`,
// shape `global_shape`) into `dst`, densely, converting to `dst_dtype`.
absl::Status CopyBox(const uint8_t* src, DType src_dtype,
                     absl::Span<const int64_t> global_shape, const ShardBox& box,
                     uint8_t* dst, DType dst_dtype);

// Writes the item's output into `dst` (OutputElements * out size bytes).
// With `digest`, feeds it every byte written, in order, while the bytes are
// still in cache (the same digest as DigestBytes over the output after).
absl::Status FillItem(const MaterializeItem& item, uint8_t* dst,
                      DigestBuilder* digest = nullptr);

// max |x| over the fp32 values of `slices` (patches applied), NaN ignored.
absl::StatusOr<float> AbsMax(absl::Span<const PartSlice> slices);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
