// FetchService: turns a fetch request into a lease on a materialized
// table (cached tables first), serves the grpc-transport Read and
// Release, decides who may use a lease, and counts fetches, reads and
// pushes with their latencies.
//
// Thread-safe, with no lock of its own: the catalog is read through
// snapshots; the fetch-table cache, the lease table, the materializer
// and the latency histograms have their own synchronization.
//
// Borrows: the catalog, access policy, materializer and lease table.
// Owns: the fetch-table cache and its counters (FetchStats).
#ifndef WEIGHTD_SERVER_SERVICE_FETCH_SERVICE_H_
#define WEIGHTD_SERVER_SERVICE_FETCH_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/auth/access_control.h"
#include "server/lease/lease_table.h"
#include "server/materialize/materializer.h"
#include "server/service/catalog.h"
#include "server/service/fetch_plan.h"
#include "server/service/fetch_table_cache.h"
#include "server/service/latency_histogram.h"
#include "server/service/model.h"
#include "server/service/types.h"

namespace weightd {

enum class TransportKind { kShm, kGrpc, kCuda };

struct FetchParams {
  std::string model;
  uint64_t generation = 0;  // 0 = current
  MeshCoord mesh;
  std::optional<std::vector<Placement>> placements;  // overrides defaults
  std::optional<DType> dtype;                        // nullopt = keep
  // Empty = all. A name given twice is INVALID_ARGUMENT naming it; an
  // unknown one NOT_FOUND (names summarized, messages bounded).
  std::vector<std::string> names;
  TransportKind transport = TransportKind::kShm;
  uint64_t changed_since = 0;
  // The lease is for a push only: tensors that need only a cast of one
  // contiguous stored slice are leased as their stored bytes and cast by
  // the push (LeaseTensor::cast; FetchRequest.defer_casts).
  bool defer_casts = false;
  // With defer_casts: patched tensors a push can merge element by element
  // (MergeOnPush) are leased as their stored bytes and merged by the push.
  bool defer_merges = false;
  // Who asks: checked against the readers of the model and of the adapters
  // of the generation served, and recorded as the lease's owner. nullopt =
  // the daemon itself (no check).
  std::optional<Principal> caller;
};

struct FetchResult {
  LeaseGrant lease;
  std::shared_ptr<const FetchTable> table;
};

// FetchService's counters (ServiceStats' fetch fields).
struct FetchStats {
  uint64_t bytes_served = 0;
  uint64_t bytes_read = 0;  // asked for by grpc-transport Reads
  uint64_t fetches = 0;
  uint64_t fetch_errors = 0;
  uint64_t pushes = 0;      // pushes into clients' memory answered OK
  uint64_t push_bytes = 0;  // the tensor bytes they wrote
  LatencyHistogram::Snapshot fetch_latency_shm;
  LatencyHistogram::Snapshot fetch_latency_grpc;
};

class FetchService {
 public:
  struct Options {
    Catalog* catalog = nullptr;
    const AccessPolicy* access = nullptr;
    Materializer* materializer = nullptr;
    LeaseTable* leases = nullptr;
    // Reported to shm clients in every table.
    std::string data_socket_path;
    std::string data_socket_name;
  };
  explicit FetchService(Options options) : options_(std::move(options)) {}
  FetchService(const FetchService&) = delete;
  FetchService& operator=(const FetchService&) = delete;

  // WeightService::Fetch, TryFetchCached, Read, Release and CheckLeaseUse
  // state the contracts.
  absl::StatusOr<FetchResult> Fetch(const FetchParams& params);
  std::optional<absl::StatusOr<FetchResult>> TryFetchCached(const FetchParams& params);
  absl::StatusOr<ReadRange> Read(uint64_t lease_id, absl::string_view token, uint32_t segment,
                                 uint64_t offset, uint64_t length, const Principal* caller);
  absl::Status Release(uint64_t lease_id, absl::string_view token, const Principal* caller);
  absl::Status CheckLeaseUse(uint64_t lease_id, const Principal& caller) const;
  // Drops generations that are neither current nor leased, and their
  // materializations.
  void PruneGenerations();
  // A push into a client's memory answered OK (the data socket calls it).
  void RecordPush(uint64_t bytes) {
    pushes_.fetch_add(1);
    push_bytes_.fetch_add(bytes);
  }
  // The counters and the latency histograms now.
  FetchStats Stats() const;

 private:
  absl::StatusOr<FetchResult> FetchImpl(const FetchParams& params);
  // FetchImpl's phases. The content of generation params.changed_since
  // (null when 0): NOT_FOUND when it is not kept.
  static absl::StatusOr<std::shared_ptr<const ContentMap>> ChangedSince(
      const Model& model, const FetchParams& params);
  // The served tensors of `gen` the request names (all when none), less
  // those whose content is the same as in `since` (when not null).
  static absl::StatusOr<std::vector<const Served*>> SelectServed(const Model& model,
                                                                 const Generation& gen,
                                                                 const ContentMap* since,
                                                                 const FetchParams& params);
  // Plans and materializes the selected tensors of `gen` and grants the
  // lease (caching the table when it holds no patches).
  absl::StatusOr<FetchResult> PlanAndMaterialize(const FetchParams& params, const Model& model,
                                                 const std::shared_ptr<const Generation>& gen,
                                                 std::string cache_key,
                                                 std::vector<ReadGuard> guards);
  // For a push lease (defer_casts): a plain view but for its dtype is
  // leased as its stored bytes, cast by the push (the output dtype kept in
  // `cast_on_push`); with `defer_merges`, so is a patched tensor the push
  // can merge element by element (its patches go with the lease then).
  static void DeferToPush(bool defer_merges, std::vector<MaterializeItem>& items,
                          std::vector<std::optional<DType>>& cast_on_push,
                          std::vector<std::shared_ptr<const PushMerge>>& merge_on_push);
  // The fetch table of the materialized `served` (one per item), its
  // segments in `buffers`.
  std::shared_ptr<FetchTable> BuildTable(
      const Generation& gen, const std::vector<MaterializeItem>& items,
      std::vector<FetchedTensor>& tables, const std::vector<MaterializedTensor>& served,
      const std::vector<std::optional<DType>>& cast_on_push,
      const std::vector<std::shared_ptr<const PushMerge>>& merge_on_push,
      std::vector<BufferPtr>* buffers) const;
  // Counts one fetch (an error, or its latency by transport) since `start`.
  void RecordFetch(const FetchParams& params, bool ok, absl::Time start);
  // The fetch-table cache's key of a request on a generation number.
  static std::string FetchCacheKey(const FetchParams& params, uint64_t generation);
  // The fetch from the cached table for `key` on `gen`, or nullopt.
  std::optional<absl::StatusOr<FetchResult>> FetchFromCache(
      const FetchParams& params, const std::string& key,
      const std::shared_ptr<const Generation>& gen);
  // Grants the lease on `table` and records its owner.
  FetchResult GrantFetch(const FetchParams& params, const Generation& gen,
                         std::shared_ptr<const FetchTable> table, std::vector<BufferPtr> buffers,
                         std::vector<ReadGuard> guards);

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  FetchTableCache fetch_cache_;
  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> pushes_{0};
  std::atomic<uint64_t> push_bytes_{0};
  std::atomic<uint64_t> fetches_{0};
  std::atomic<uint64_t> fetch_errors_{0};
  LatencyHistogram fetch_latency_shm_;
  LatencyHistogram fetch_latency_grpc_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_FETCH_SERVICE_H_
