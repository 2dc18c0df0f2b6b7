// WeightService (weight_service.h): the facade's construction, the
// housekeeper's jobs and the forwards to the parts. The publish commit is
// in publish.cc, Stats() in service_stats.cc.
#include "server/engine/weight_service.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/base/log.h"
#include "server/adapter/lora_patch.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<WeightService>> WeightService::Create(
    WeightServiceOptions options) {
  WD_ASSIGN_OR_RETURN(ModelRoots roots, ModelRoots::Create(options.model_roots));
  // Parallelism comes from the materializer's workers (one item each);
  // OpenBLAS threads inside every GEMM would only oversubscribe the cores.
  SetGemmThreads(1);
  return std::unique_ptr<WeightService>(new WeightService(std::move(options), std::move(roots)));
}

WeightService::WeightService(WeightServiceOptions options, ModelRoots roots)
    : options_(std::move(options)),
      roots_(std::move(roots)),
      pinner_(HostPinner::Options{.mode = options_.pin_host_memory, .gpus = options_.gpus}),
      memory_(HostMemoryManager::Options{
          .limit_bytes = options_.host_memory_bytes,
          .warm_reserve_bytes = options_.warm_reserve_bytes,
          .reserve_chunk_bytes = options_.reserve_chunk_bytes,
          .huge_pages = options_.huge_pages,
          .keep_writable_mappings = pinner_.wants_writable_mappings()}),
      materializer_(Materializer::Options{&memory_, options_.worker_threads}),
      leases_(options_.lease_idle_ttl, memory_.disposer()),
      access_(options_.access),
      catalog_(options_.on_state_change),
      copies_(ResidentCopies::Options{
          .catalog = &catalog_, .resident = &resident_, .access = &access_, .files = &files_}),
      models_(ModelService::Options{
          .catalog = &catalog_,
          .access = &access_,
          .files = &files_,
          .memory = &memory_,
          .resident = &resident_,
          .copies = &copies_,
          .materializer = &materializer_,
          .donated = options_.donated,
          .peers = options_.peers,
          .checkpoint_segment_bytes = options_.checkpoint_segment_bytes,
          .read_chunk_bytes = options_.read_chunk_bytes,
          .worker_threads = options_.worker_threads,
          .peer_streams = options_.peer_streams,
          .peer_verify = options_.peer_verify,
          .source_streams = options_.source_streams,
          .source_chunk_bytes = options_.source_chunk_bytes,
          .on_loaded =
              [this](const std::string& model, const Checkpoint& checkpoint) {
                pinner_.Pin(model, "checkpoint", checkpoint.host_segments());
              },
          .on_unloaded = [this](const Model& model) { OnUnloaded(model); }}),
      adapters_(AdapterService::Options{.catalog = &catalog_,
                                        .models = &models_,
                                        .files = &files_,
                                        .memory = &memory_,
                                        .materializer = &materializer_,
                                        .has_peers = options_.peers != nullptr}),
      fetch_(FetchService::Options{.catalog = &catalog_,
                                   .access = &access_,
                                   .materializer = &materializer_,
                                   .leases = &leases_,
                                   .data_socket_path = options_.data_socket_path,
                                   .data_socket_name = options_.data_socket_name}),
      staging_(StagingReserve::Options{
          .enabled = options_.publish_staging_ahead,
          .memory = &memory_,
          .still_loaded =
              [this](const std::string& name, uint64_t instance) {
                auto loaded = catalog_.FindModel(name);
                return loaded.ok() && (*loaded)->instance == instance;
              }}),
      publish_(PublishService::Options{
          .memory = &memory_,
          .access = &access_,
          .staging = &staging_,
          .limits = {options_.max_publish_sessions, options_.max_publish_sessions_per_caller},
          .idle_timeout = options_.publish_idle_timeout,
          .find_model = [this](const std::string& name) { return catalog_.FindModel(name); },
          .commit = [this](PublishSession& session,
                           const std::optional<Principal>& caller) {
            return CommitStaged(session, caller);
          }}) {
  if (options_.state_dir != nullptr) {
    published_store_ = std::make_unique<PublishedStore>(options_.state_dir);
  }
  housekeeper_.Start(ReapJobs());
}

WeightService::~WeightService() {
  staging_.Stop();
  housekeeper_.Stop();
}

std::vector<Housekeeper::Job> WeightService::ReapJobs() {
  return {
      {"lease_expiry",
       [this] {
         size_t expired = leases_.Expire(absl::Now());
         if (expired > 0) {
           LogEvent(LogLevel::kInfo, "lease_expired", {{"count", absl::StrCat(expired)}});
         }
       }},
      {"prune_generations", [this] { fetch_.PruneGenerations(); }},
      {"expire_publishes", [this] { publish_.Expire(); }},
      // A model that stopped publishing does not keep a staging for good.
      {"reclaim_staging", [this] { staging_.Reclaim(absl::Minutes(10)); }},
      {"materializer_sweep", [this] { materializer_.Sweep(); }},
  };
}

void WeightService::OnUnloaded(const Model& model) {
  publish_.EndSessionsOf(model.instance,
                         absl::StrCat("model \"", model.name, "\" was unloaded"));
  if (published_store_ != nullptr) published_store_->Forget(model.name);
}

void WeightService::PinPublished(const std::string& model, const PublishedBase* published) {
  if (published == nullptr) return;
  std::vector<SegmentPtr> segments;
  absl::flat_hash_set<uint64_t> seen;
  for (const auto& [key, t] : *published) {
    auto seg = std::dynamic_pointer_cast<const Segment>(t->buffer);
    if (seg != nullptr && seen.insert(seg->id()).second) segments.push_back(std::move(seg));
  }
  pinner_.Pin(model, "publish", segments);
}

absl::Status WeightService::CheckCanRead(const std::string& model_name,
                                         const Principal& caller) const {
  return models_.CheckCanRead(model_name, caller);
}

// Models (ModelService).
absl::StatusOr<ModelSummary> WeightService::LoadModel(const std::string& name,
                                                      const std::string& path,
                                                      const std::string& profile_json,
                                                      const LoadProgressFn& progress,
                                                      const std::vector<std::string>& readers,
                                                      LoadSource source) {
  return models_.Load(name, path, profile_json, progress, readers, nullptr, source);
}

absl::StatusOr<ModelSummary> WeightService::RestoreLoadModel(
    const std::string& name, const std::string& path, const std::string& profile_json,
    const std::vector<std::string>& readers, const RestoreExpect& expect,
    const LoadProgressFn& progress) {
  return models_.Load(name, path, profile_json, progress, readers, &expect);
}

absl::Status WeightService::UnloadModel(const std::string& name) { return models_.Unload(name); }

std::vector<ModelSummary> WeightService::ListModels() const { return models_.List(); }

absl::StatusOr<ModelDetail> WeightService::GetModel(const std::string& name) const {
  return models_.Get(name);
}

absl::StatusOr<WeightService::VerifyResult> WeightService::Verify(const std::string& name) const {
  return models_.Verify(name);
}

// Peers (ResidentCopies).
absl::StatusOr<PeerHolding> WeightService::FindHeld(const Digest& key,
                                                    const std::vector<CheckpointRange>& samples,
                                                    const std::vector<Digest>& sample_digests,
                                                    const Principal& asker) const {
  return copies_.FindHeld(key, samples, sample_digests, asker);
}

absl::StatusOr<ReadRange> WeightService::ReadHeld(const Digest& key, const Digest& copy,
                                                  const CheckpointRange& range,
                                                  const Principal& asker) {
  return copies_.ReadHeld(key, copy, range, asker);
}

// Fetches and leases (FetchService).
absl::StatusOr<FetchResult> WeightService::Fetch(const FetchParams& params) {
  return fetch_.Fetch(params);
}

std::optional<absl::StatusOr<FetchResult>> WeightService::TryFetchCached(
    const FetchParams& params) {
  return fetch_.TryFetchCached(params);
}

absl::StatusOr<ReadRange> WeightService::Read(uint64_t lease_id, absl::string_view token,
                                              uint32_t segment, uint64_t offset,
                                              uint64_t length, const Principal* caller) {
  return fetch_.Read(lease_id, token, segment, offset, length, caller);
}

absl::Status WeightService::Release(uint64_t lease_id, absl::string_view token,
                                    const Principal* caller) {
  return fetch_.Release(lease_id, token, caller);
}

absl::Status WeightService::CheckLeaseUse(uint64_t lease_id, const Principal& caller) const {
  return fetch_.CheckLeaseUse(lease_id, caller);
}

// Adapters and generations (AdapterService, Catalog).
absl::StatusOr<AdapterSummary> WeightService::LoadAdapter(const std::string& name,
                                                          const std::string& path,
                                                          const std::string& format, bool strict,
                                                          const std::vector<std::string>& readers,
                                                          LoadSource source) {
  return adapters_.Load(name, path, format, strict, readers, source);
}

absl::Status WeightService::UnloadAdapter(const std::string& name) {
  return adapters_.Unload(name);
}

std::vector<AdapterSummary> WeightService::ListAdapters() const { return adapters_.List(); }

absl::StatusOr<GenerationInfo> WeightService::Apply(const std::string& model,
                                                    const std::vector<AdapterRef>& stack,
                                                    uint64_t expect_generation) {
  return adapters_.Apply(model, stack, expect_generation);
}

absl::StatusOr<GenerationInfo> WeightService::RestoreApply(const std::string& model,
                                                           const std::vector<AdapterRef>& stack,
                                                           uint64_t number,
                                                           const Digest& expect_content) {
  return adapters_.RestoreApply(model, stack, number, expect_content);
}

absl::Status WeightService::SetGenerationFloor(const std::string& model, uint64_t floor) {
  return adapters_.SetGenerationFloor(model, floor);
}

absl::StatusOr<std::optional<GenerationInfo>> WeightService::WaitForGeneration(
    const std::string& model, uint64_t after, absl::Duration timeout) {
  return models_.WaitForGeneration(model, after, timeout);
}

}  // namespace weightd
