// ModelService: loads (and restores) models from checkpoints in the model
// roots, unloads, lists, describes and verifies them; reads checkpoints as
// this daemon reads them (its memory, segment and read sizes, resident
// files, donated segments, peers) and counts where their bytes came from.
//
// Thread-safe. Loads run on the caller's thread (and the loader's
// workers) without any lock; the catalog is changed through
// Catalog::Commit. Its one mutex, mu_, is a leaf guarding the load-source
// counters (was WeightService::peer_counters_mu_).
//
// Borrows: the catalog, access policy, model roots, memory manager, resident checkpoints,
// resident copies, materializer, donated checkpoints and peers. Owns: its
// counters (LoadStats).
#ifndef WEIGHTD_SERVER_SERVICE_MODEL_SERVICE_H_
#define WEIGHTD_SERVER_SERVICE_MODEL_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/digest.h"
#include "absl/time/time.h"
#include "server/auth/access_control.h"
#include "server/materialize/materializer.h"
#include "server/memory/host_memory.h"
#include "server/profile/profile.h"
#include "server/service/catalog.h"
#include "server/service/model.h"
#include "server/service/resident_copies.h"
#include "server/service/types.h"
#include "server/state/state_journal.h"
#include "server/store/checkpoint_loader.h"
#include "server/store/donated_checkpoints.h"
#include "server/store/load_tally.h"
#include "server/store/model_roots.h"
#include "server/store/peer_source.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

// ModelService's counters (ServiceStats' load fields).
struct LoadStats {
  uint64_t loads = 0;
  uint64_t load_bytes = 0;
  double load_seconds = 0;
  // Checkpoint bytes loads took from storage and from peers; per peer the
  // bytes received and the ranges it failed.
  uint64_t load_bytes_storage = 0;
  uint64_t load_bytes_peers = 0;  // kept by the loads
  // Sent by peers and thrown away (wrong, fetched again, the load failed).
  uint64_t load_bytes_peers_discarded = 0;
  struct PeerCounters {
    uint64_t bytes = 0;
    uint64_t failures = 0;
  };
  std::map<std::string, PeerCounters> peer_transfers;
};

class ModelService {
 public:
  struct Options {
    Catalog* catalog = nullptr;
    const AccessPolicy* access = nullptr;
    // Paths to the model roots, URLs to the --model-source sources
    // (SourceRoutingOpener).
    const FileOpener* files = nullptr;
    HostMemoryManager* memory = nullptr;
    ResidentCheckpoints* resident = nullptr;
    const ResidentCopies* copies = nullptr;
    Materializer* materializer = nullptr;
    DonatedCheckpoints* donated = nullptr;  // null: none
    CheckpointPeers* peers = nullptr;       // null: none
    uint64_t checkpoint_segment_bytes = uint64_t{1} << 30;
    uint64_t read_chunk_bytes = 16ull << 20;
    int worker_threads = 2;
    int peer_streams = 4;
    PeerVerify peer_verify;
    // A URL's ranged GETs: source_streams at once, source_chunk_bytes each.
    int source_streams = 8;
    uint64_t source_chunk_bytes = 16ull << 20;
    // Called with a loaded model's checkpoint before it is served (the
    // host pinner); may be null.
    std::function<void(const std::string& model, const Checkpoint&)> on_loaded;
    // Called after a model was unloaded (publish sessions on it end, its
    // saved publishes are forgotten); may be null.
    std::function<void(const Model&)> on_unloaded;
  };
  explicit ModelService(Options options);
  ModelService(const ModelService&) = delete;
  ModelService& operator=(const ModelService&) = delete;

  // For a restore: the model is published only if its served content is
  // `content`, with its next generation numbered at least `generation_floor`.
  struct RestoreExpect {
    Digest content;
    uint64_t generation_floor = 0;
    // A URL load's objects as journaled: checked before anything is read,
    // FAILED_PRECONDITION when one changed (docs/sources.md).
    std::vector<StateRecord::SourceObject> objects;
  };
  // WeightService::LoadModel and RestoreLoadModel (`expect` non-null)
  // state the contract. `cancel` (null: one of its own) ends the load
  // CANCELLED when cancelled (the caller went away); Unload of the name
  // cancels it too.
  absl::StatusOr<ModelSummary> Load(const std::string& name, const std::string& path,
                                    const std::string& profile_json,
                                    const LoadProgressFn& progress,
                                    const std::vector<std::string>& readers,
                                    const RestoreExpect* expect,
                                    LoadSource source = LoadSource::kStorage,
                                    std::shared_ptr<Cancellation> cancel = nullptr);
  // WeightService::UnloadModel states the contract.
  absl::Status Unload(const std::string& name);
  std::vector<ModelSummary> List() const;
  absl::StatusOr<ModelDetail> Get(const std::string& name) const;
  struct VerifyResult {
    uint64_t tensors = 0;
    uint64_t bytes = 0;
  };
  // Recomputes every stored tensor's digest: DATA_LOSS naming mismatches.
  absl::StatusOr<VerifyResult> Verify(const std::string& name) const;
  // May `caller` read `model` at its current generation? NOT_FOUND when
  // it is not loaded.
  absl::Status CheckCanRead(const std::string& model, const Principal& caller) const;
  // Catalog::WaitForGeneration.
  absl::StatusOr<std::optional<GenerationInfo>> WaitForGeneration(const std::string& model,
                                                                  uint64_t after,
                                                                  absl::Duration timeout);

  // Reads `path` as this daemon reads checkpoints from `source`, and
  // counts where the bytes came from. `shared_charge`, `progress`,
  // `donated`: as CheckpointLoadOptions'. `share_held` (model loads):
  // tensors whose bytes a public model holds already are shared
  // (CheckpointLoadOptions::find_held, ResidentCopies::Find).
  // `offer_while_loading`: the readers of the model loading it, to whom
  // peers must belong to read its ranges before the load ends
  // (CheckpointLoadOptions::offer_while_loading); null: not offered.
  absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadCheckpoint(
      const std::string& path, LoadSource source, std::unique_ptr<MemoryCharge>* shared_charge,
      const LoadProgressFn& progress = nullptr, DonatedCheckpoints* donated = nullptr,
      std::vector<std::string>* opened_files = nullptr, bool share_held = false,
      const Cancellation* cancel = nullptr, const ReaderList* offer_while_loading = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  static ModelSummary Summarize(const Model& model);
  LoadStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Load's model, before it is committed: its checkpoint read (opened and
  // confined to the model roots by LoadCheckpoint, file by file), pinned,
  // laid out and at generation 1. `shared`: the checkpoint is another
  // model's (the same files).
  absl::StatusOr<std::shared_ptr<Model>> BuildModel(const std::string& name,
                                                    const std::string& path,
                                                    std::shared_ptr<const Profile> profile,
                                                    ReaderList readers,
                                                    const LoadProgressFn& progress,
                                                    LoadSource source, const Cancellation& cancel,
                                                    bool* shared);
  // FAILED_PRECONDITION unless every object still has its journaled
  // version and size (a restore of a URL load).
  absl::Status CheckSourceObjects(const std::vector<StateRecord::SourceObject>& objects) const;
  // The objects a URL load read, at the versions it read, for its journal
  // record (StateRecord::objects).
  std::vector<StateRecord::SourceObject> ObjectsOf(const Model& built) const;
  void CountLoadSources(const LoadSourceReport& report) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  std::atomic<uint64_t> next_model_instance_{1};
  std::atomic<uint64_t> loads_{0};
  std::atomic<uint64_t> load_bytes_{0};
  std::atomic<uint64_t> load_ns_{0};

  // Protected by mu_ (a leaf).
  mutable absl::Mutex mu_;
  uint64_t load_bytes_storage_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t load_bytes_peers_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t load_bytes_peers_discarded_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, LoadStats::PeerCounters> peer_transfers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_MODEL_SERVICE_H_
