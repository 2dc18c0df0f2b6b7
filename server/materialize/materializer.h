// Materialization: the bytes of one rank's local shard of a served tensor,
// in the dtype it asked for, with its adapter patches merged (item.h).
//
// A call goes through three parts, each in its own file:
//   materialize_cache.h  finds what was computed before;
//   pack_plan.h          plans the misses: views, and where the rest goes;
//   cpu_fill.h           the CPU fill backend computes them, on one executor.
// The materializer allocates the planned buffers from the memory manager,
// seals them and records them in the cache.
//
// A single unpatched contiguous slice in the stored dtype is a view into the
// base segment (zero copy). Anything else — a cast, a non-contiguous slice,
// several parts, LoRA patches, FP8 quantization — is computed into a new
// sealed segment: patched slices in fp32 with one rounding at the end
// (docs/DESIGN.md §2.5). Results are cached by their inputs (part digests, boxes,
// patches and strengths, output dtype, scale) so identical requests — HSDP
// replicas, repeated fetches — share one copy. One Materialize() call packs
// all its misses into one segment (or into chunks of the warm reserve, see
// SegmentPool), so a fetch hands out a handful of fds.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
#define WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/materialize/cpu_fill.h"
#include "server/materialize/item.h"
#include "server/materialize/materialize_cache.h"
#include "server/materialize/pack_plan.h"
#include "server/memory/host_memory.h"

namespace weightd {

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
      const std::string& scope = "");

  // The tag's segments are dropped now if unheld, else by a later Sweep().
  void RetireTag(const std::string& tag);

  // Drops every cache entry nobody else holds (its segment is referenced
  // only by the cache) and frees those segments here: the memory manager's
  // reclaimer (kRankCache), run when the budget is short. Returns bytes freed.
  uint64_t EvictUnused();

  // Drops the entries derived from base segments that are gone (their
  // checkpoint was unloaded and nothing leases it) once no lease holds
  // them either. Returns bytes freed.
  uint64_t Sweep();

  MaterializerStats stats() const;

 private:
  // Evicts, then retires what was dropped without the cache's lock
  // (HostMemoryManager::Retire; `now`: the caller needs the budget back).
  uint64_t Evict(bool orphans_only, bool now);

  const Options options_;
  uint64_t reclaimer_id_ = 0;  // in the memory manager's chain
  MaterializeCache cache_;
  CpuFillBackend fill_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MATERIALIZE_MATERIALIZER_H_
