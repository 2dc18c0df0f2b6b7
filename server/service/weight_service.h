// WeightService: the daemon's domain core — models, fetches, leases — with
// no gRPC in sight. server/grpc adapts it to weightd.v1; tests may drive it
// directly.
//
// Thread-safe. Loading and materialization run on the caller's thread (and
// their own workers) without holding the registry lock.
#ifndef WEIGHTD_SERVER_SERVICE_WEIGHT_SERVICE_H_
#define WEIGHTD_SERVER_SERVICE_WEIGHT_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/lease/lease_table.h"
#include "server/materialize/materializer.h"
#include "server/store/checkpoint.h"
#include "server/store/model_roots.h"
#include "server/store/segment.h"

namespace weightd {

struct WeightServiceOptions {
  std::vector<std::string> model_roots;
  uint64_t host_memory_bytes = 0;  // 0 = unlimited
  std::string data_socket_path;    // reported to shm clients
  absl::Duration lease_idle_ttl = absl::Seconds(60);
  int worker_threads = 2;
};

struct ModelSummary {
  std::string name;
  std::string path;
  uint64_t generation = 0;
  uint64_t tensor_count = 0;
  uint64_t total_bytes = 0;
  std::vector<std::string> files;
};

struct TensorSummary {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Digest digest;
};

struct ModelDetail {
  ModelSummary summary;
  std::vector<TensorSummary> tensors;
};

enum class TransportKind { kShm, kGrpc, kCuda };

struct FetchParams {
  std::string model;
  uint64_t generation = 0;  // 0 = current
  MeshCoord mesh;
  std::optional<std::vector<Placement>> placements;  // overrides defaults
  std::optional<DType> dtype;                        // nullopt = keep
  std::vector<std::string> names;                    // empty = all
  TransportKind transport = TransportKind::kShm;
  uint64_t changed_since = 0;
};

struct FetchedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  Digest digest;
};

struct FetchResult {
  LeaseGrant lease;
  uint64_t generation = 0;
  std::vector<uint64_t> segment_sizes;
  std::vector<FetchedTensor> tensors;
  std::string data_socket;
};

// The bytes a grpc-transport Read streams.
struct ReadRange {
  SegmentPtr segment;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ServiceStats {
  uint64_t models = 0;
  uint64_t segments = 0;
  uint64_t bytes_resident = 0;
  uint64_t memory_limit = 0;
  MaterializerStats materializer;
  uint64_t leases_open = 0;
  uint64_t bytes_served = 0;
  uint64_t fetches = 0;
};

class WeightService {
 public:
  static absl::StatusOr<std::unique_ptr<WeightService>> Create(WeightServiceOptions options);
  ~WeightService();

  // Loads `path` (inside a model root) as model `name`. ALREADY_EXISTS when
  // the name is taken or being loaded; errors from the store otherwise,
  // with nothing left allocated.
  absl::StatusOr<ModelSummary> LoadModel(const std::string& name, const std::string& path,
                                         const std::string& profile_json,
                                         const LoadProgressFn& progress)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Leased bytes stay readable until their leases end.
  absl::Status UnloadModel(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ModelSummary> ListModels() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ModelDetail> GetModel(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<FetchResult> Fetch(const FetchParams& params) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ReadRange> Read(uint64_t lease_id, absl::string_view token,
                                 uint32_t segment, uint64_t offset, uint64_t length);
  absl::Status Release(uint64_t lease_id, absl::string_view token);

  ServiceStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  LeaseTable* leases() { return &leases_; }
  const WeightServiceOptions& options() const { return options_; }

 private:
  struct Model {
    std::string name;
    std::string path;
    uint64_t generation = 1;
    std::shared_ptr<const Checkpoint> checkpoint;
  };

  WeightService(WeightServiceOptions options, ModelRoots roots);
  static ModelSummary Summarize(const Model& model);
  void ReapLoop();

  const WeightServiceOptions options_;
  const ModelRoots roots_;
  std::shared_ptr<MemoryAccount> account_;
  Materializer materializer_;
  LeaseTable leases_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Model>> models_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> loading_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> fetches_{0};

  absl::Notification stop_;
  std::thread reaper_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_WEIGHT_SERVICE_H_
