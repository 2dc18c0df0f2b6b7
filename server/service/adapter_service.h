// AdapterService: loads and unloads adapters, and applies adapter stacks
// (and restored publishes) to models as new generations.
//
// Thread-safe, with no lock of its own: the catalog is read through
// snapshots and changed through Catalog::Commit; generations are built
// outside any lock.
//
// Borrows: the catalog, the model service (adapter files read as
// checkpoints with peers), model roots, memory manager, materializer.
// Owns: the count of applies.
#ifndef WEIGHTD_SERVER_SERVICE_ADAPTER_SERVICE_H_
#define WEIGHTD_SERVER_SERVICE_ADAPTER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/digest.h"
#include "server/adapter/adapter.h"
#include "server/materialize/materializer.h"
#include "server/memory/host_memory.h"
#include "server/service/catalog.h"
#include "server/service/model.h"
#include "server/service/model_service.h"
#include "server/service/types.h"
#include "server/store/model_roots.h"
#include "server/store/peer_source.h"

namespace weightd {

class AdapterService {
 public:
  struct Options {
    Catalog* catalog = nullptr;
    ModelService* models = nullptr;
    const FileOpener* files = nullptr;  // paths to the model roots, URLs to the sources
    HostMemoryManager* memory = nullptr;
    Materializer* materializer = nullptr;
    // With peers, adapter files are read as checkpoints (ReadCheckpoint).
    bool has_peers = false;
  };
  explicit AdapterService(Options options) : options_(options) {}
  AdapterService(const AdapterService&) = delete;
  AdapterService& operator=(const AdapterService&) = delete;

  // WeightService::LoadAdapter, UnloadAdapter, ListAdapters, Apply,
  // RestoreApply and SetGenerationFloor state the contracts.
  absl::StatusOr<AdapterSummary> Load(const std::string& name, const std::string& path,
                                      const std::string& format, bool strict,
                                      const std::vector<std::string>& readers,
                                      LoadSource source);
  absl::Status Unload(const std::string& name);
  std::vector<AdapterSummary> List() const;
  absl::StatusOr<GenerationInfo> Apply(const std::string& model,
                                       const std::vector<AdapterRef>& stack,
                                       uint64_t expect_generation);
  absl::StatusOr<GenerationInfo> RestoreApply(const std::string& model,
                                              const std::vector<AdapterRef>& stack,
                                              uint64_t number, const Digest& expect_content);
  absl::Status SetGenerationFloor(const std::string& model, uint64_t floor);

  // A restored publish (WeightService::RestorePublish): its weights replace
  // the current generation's published ones, and it is journaled as a
  // publish.
  struct RestoredPublish {
    std::shared_ptr<const PublishedBase> base;
    std::string path;
    uint64_t bytes_shared = 0;  // held by another model already (ResidentCopies)
    std::string store_dir;      // the published store's directory (messages)
  };
  // RestoreApply of `restored` under `stack`.
  absl::StatusOr<GenerationInfo> RestorePublished(const std::string& model,
                                                  const std::vector<AdapterRef>& stack,
                                                  uint64_t number, const Digest& expect_content,
                                                  const RestoredPublish& restored);

  uint64_t applies() const { return applies_.load(); }

 private:
  absl::StatusOr<GenerationInfo> ApplyImpl(const std::string& model,
                                           const std::vector<AdapterRef>& stack,
                                           uint64_t expect_generation, uint64_t number_at_least,
                                           const Digest* expect_content,
                                           const RestoredPublish* restored = nullptr);
  // ApplyImpl's commit: `gen` installed unless the model moved on
  // (ABORTED); the retired generations' materializations dropped.
  absl::StatusOr<GenerationInfo> CommitApply(const std::string& model_name,
                                             const std::shared_ptr<const Model>& model,
                                             std::shared_ptr<Generation> gen,
                                             uint64_t number_at_least, StateRecord& record);
  // An adapter's weights file read as a one-file checkpoint from `source`
  // (with peers: AdapterLoadOptions::fetch), kept resident with the adapter;
  // empty when it is resident only as tensors shared with other models.
  absl::StatusOr<AdapterLoadOptions::FetchedBytes> FetchAdapterFile(const std::string& file,
                                                                    absl::string_view header,
                                                                    LoadSource source);

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  std::atomic<uint64_t> applies_{0};
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_ADAPTER_SERVICE_H_
