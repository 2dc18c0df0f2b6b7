// WeightService: the daemon's domain core — models, fetches, leases,
// publishes — with no gRPC in sight. server/grpc adapts it to weightd.v1;
// tests may drive it directly.
//
// A facade (issue 40): it builds the single-job parts in dependency order,
// owns them, wires them together and forwards its public methods to them:
//   Catalog (service/catalog.h): models and adapters by name, the
//     journaled swap of what is served (with its ChangeCommitter);
//   ResidentCopies (service/resident_copies.h): bytes loaded models hold,
//     for sharing and for peers;
//   ModelService, AdapterService, FetchService (service/): loads, adapters
//     and generations, fetches and leases;
//   StagingReserve, PublishService (publish/): publish sessions; the
//     commit's catalog phases are this facade's (publish.cc);
//   Housekeeper (service/housekeeper.h): the periodic jobs.
// Stats() aggregates the parts' counters (service_stats.cc).
//
// Thread-safe; no lock of its own. Loading and materialization run on the
// caller's thread (and their own workers) without holding the catalog lock.
//
// Lock order (each may be taken while holding those to its left, never the
// other way):
//   ChangeCommitter::mu_ (in Catalog) -> Catalog::mu_ -> PublishService::mu_
//   PublishSession::mu   taken alone, never with the three above
//   leaves (nothing is taken while one is held): StagingReserve::mu_,
//     PublishSlots::mu_, ModelService::mu_ (load counters),
//     Generation::scale_mu, FetchTableCache, LeaseTable, HostMemoryManager
//     internals, ResidentCheckpoints, DonatedCheckpoints
#ifndef WEIGHTD_SERVER_ENGINE_WEIGHT_SERVICE_H_
#define WEIGHTD_SERVER_ENGINE_WEIGHT_SERVICE_H_

#include <atomic>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/adapter/adapter.h"
#include "server/auth/access_control.h"
#include "server/gpu/gpu_devices.h"
#include "server/lease/lease_table.h"
#include "server/materialize/materializer.h"
#include "server/profile/profile.h"
#include "server/store/checkpoint_loader.h"
#include "server/store/model_roots.h"
#include "server/source/source_opener.h"
#include "server/service/fetch_plan.h"
#include "server/service/fetch_table_cache.h"
#include "server/service/latency_histogram.h"
#include "server/publish/publish_plan.h"
#include "server/publish/publish_slots.h"
#include "server/publish/publish_service.h"
#include "server/publish/publish_session.h"
#include "server/publish/publish_types.h"
#include "server/publish/staging_reserve.h"
#include "server/engine/service_stats.h"
#include "server/service/adapter_service.h"
#include "server/service/catalog.h"
#include "server/service/fetch_service.h"
#include "server/service/model_service.h"
#include "server/service/resident_copies.h"
#include "server/service/housekeeper.h"
#include "server/service/model.h"
#include "server/service/types.h"
#include "server/state/published_store.h"
#include "server/state/state_journal.h"
#include "server/gpu/host_pinner.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"

namespace weightd {

struct PublishDiff;

struct WeightServiceOptions {
  std::vector<std::string> model_roots;
  uint64_t host_memory_bytes = 0;  // 0 = unlimited
  std::string data_socket_path;    // reported to shm clients
  std::string data_socket_name;    // its file name when beside the gRPC Unix socket, else ""
  absl::Duration lease_idle_ttl = absl::Seconds(60);
  int worker_threads = 2;
  // Warm reserve of pre-faulted output segments (SegmentPool); 0 = none.
  uint64_t warm_reserve_bytes = 0;
  uint64_t reserve_chunk_bytes = uint64_t{256} << 20;
  // Socket allow-list, admins, implicit daemon uid (access_control.h).
  AccessPolicyOptions access;
  // The GPUs found at start-up (reported by Stats).
  GpuInventory gpus;
  // --pin-host-memory: register checkpoint and published segments with
  // CUDA (kAuto: when there are GPUs), unregistered before they are freed
  // (server/gpu/host_pinner.h). Failures are logged, never fatal.
  using Pin = PinMode;
  Pin pin_host_memory = Pin::kAuto;
  // --huge-pages: the pages of host segments (server/memory/huge_pages.h).
  // Off here (tests and embedders); the daemon's flag defaults to auto.
  HugePageMode huge_pages = HugePageMode::kOff;
  // --checkpoint-segment-bytes: a checkpoint's files are packed into
  // segments of up to this size (a larger file gets one of its own). With
  // huge pages each segment is hugetlb or falls back whole: smaller ones
  // fill a pool smaller than the checkpoint more fully.
  uint64_t checkpoint_segment_bytes = uint64_t{1} << 30;
  // --state-dir: called with every committed change of what is served
  // (loads, unloads, applies), in commit order by StateRecord::seq, before
  // the change is answered, outside the service's locks. Failures are the
  // sink's to report; the change stands.
  std::function<void(const StateRecord&)> on_state_change;
  // --state-dir: published weights are saved in its published/ for
  // restarts (server/state/published_store.h); null: not saved.
  std::shared_ptr<const StateDir> state_dir;
  // Segments a predecessor daemon handed over (--take-over): loads of the
  // same files adopt them instead of reading (checkpoint.h). Borrowed; null
  // = none.
  DonatedCheckpoints* donated = nullptr;
  // The daemon's peers (--peers, --peer-dns): loads whose source is not
  // kStorage ask them for the files' bytes (checkpoint.h). Borrowed; null
  // = none.
  CheckpointPeers* peers = nullptr;
  int peer_streams = 4;  // --peer-streams
  // --peer-verify: how much of what peers send is compared with storage.
  PeerVerify peer_verify;
  // Bytes per read of a checkpoint, from storage or a peer (--read-chunk-bytes).
  uint64_t read_chunk_bytes = 16ull << 20;
  // --model-source: loads of URLs (s3://, https://) go through it; null =
  // none may be loaded (PERMISSION_DENIED). Borrowed. Their ranged GETs:
  // --source-streams at once, of --source-chunk-bytes each.
  const RemoteFileOpener* sources = nullptr;
  int source_streams = 8;
  uint64_t source_chunk_bytes = 16ull << 20;
  // --publish-staging-ahead: after a model's publish, its next publish's
  // staging (the same size) is allocated and faulted in the background,
  // while the budget has room for it without evicting anything; the
  // memory manager takes it back first when short (like the warm reserve).
  bool publish_staging_ahead = true;
  // Open publish sessions, in all and per caller (--max-publish-sessions,
  // --max-publish-sessions-per-caller; 0 = no cap): RESOURCE_EXHAUSTED at
  // begin past either.
  size_t max_publish_sessions = 64;
  size_t max_publish_sessions_per_caller = 8;
  // --publish-idle-seconds: an open session with no write, stage or
  // waiting commit for this long ends (DEADLINE_EXCEEDED) and frees its
  // memory; zero = only its deadline ends it.
  absl::Duration publish_idle_timeout = absl::Minutes(5);
};

class WeightService : public ServiceStatsSource {
 public:
  static absl::StatusOr<std::unique_ptr<WeightService>> Create(WeightServiceOptions options);
  ~WeightService();

  // Loads `path` (inside a model root) as model `name`. ALREADY_EXISTS when
  // the name is taken or being loaded; errors from the store otherwise,
  // with nothing left allocated.
  // `readers` (ReaderList syntax) makes the model private; INVALID_ARGUMENT
  // when malformed. A load ends CANCELLED, having freed what it allocated,
  // when it is unloaded meanwhile or its caller cancels it
  // (ModelService::Load's `cancel`).
  absl::StatusOr<ModelSummary> LoadModel(const std::string& name, const std::string& path,
                                         const std::string& profile_json,
                                         const LoadProgressFn& progress,
                                         const std::vector<std::string>& readers = {},
                                         LoadSource source = LoadSource::kStorage);
  // For peers loading from this daemon (FindCheckpoint, ReadCheckpoint;
  // `asker`: a fleet member, AccessPolicy::CheckFleetMember): the digests
  // of the resident checkpoint `key` names (CheckpointKey), per file in
  // data-offset order, and of `samples` of its bytes; and a range of one
  // file's data section. Only a copy that a loaded model or adapter holding
  // it lets `asker` read is offered (MayOfferToPeer), and of the copies of
  // a key (sibling checkpoints with the same names, sizes and headers)
  // FindHeld answers only with the one whose samples are `sample_digests`:
  // NOT_FOUND when there is none, whichever the reason (no existence
  // oracle). INVALID_ARGUMENT without samples, or for samples or a range
  // outside the files. ReadHeld reads copy `copy`.
  absl::StatusOr<PeerHolding> FindHeld(const Digest& key,
                                       const std::vector<CheckpointRange>& samples,
                                       const std::vector<Digest>& sample_digests,
                                       const Principal& asker) const;
  absl::StatusOr<ReadRange> ReadHeld(const Digest& key, const Digest& copy,
                                     const CheckpointRange& range, const Principal& asker);
  // For a restore (--state-dir): LoadModel that publishes the model only if
  // its served content is `content` (DATA_LOSS otherwise: nothing served,
  // nothing journaled), with its next generation numbered at least
  // `generation_floor`.
  using RestoreExpect = ModelService::RestoreExpect;
  absl::StatusOr<ModelSummary> RestoreLoadModel(const std::string& name, const std::string& path,
                                                const std::string& profile_json,
                                                const std::vector<std::string>& readers,
                                                const RestoreExpect& expect,
                                                const LoadProgressFn& progress = nullptr);
  // Leased bytes stay readable until their leases end. A load of `name`
  // still running is cancelled (it ends CANCELLED for its caller) and
  // waited for, so that what it allocated is freed when this returns; then
  // OK, or the model is unloaded if that load had finished meanwhile.
  absl::Status UnloadModel(const std::string& name);
  std::vector<ModelSummary> ListModels() const;
  absl::StatusOr<ModelDetail> GetModel(const std::string& name) const;

  // Serves one rank's request on generation `params.generation` (0 = the
  // current one, read once: an apply racing with the fetch serves either
  // generation whole, never a mix). Order: the model (NOT_FOUND), the
  // caller's read access to the generation served (PERMISSION_DENIED,
  // before anything else about the model is said), the generation and
  // changed_since (NOT_FOUND), the mesh and placements (INVALID_ARGUMENT),
  // the names (INVALID_ARGUMENT for repeats, NOT_FOUND for unknowns), then
  // planning (fetch_plan.h) and materialization (RESOURCE_EXHAUSTED over
  // the budget). On success the result's lease holds every segment its
  // table names until Release, the data connection's end or the idle TTL;
  // those segments hold nothing the caller may not read (ReadScope). On
  // error nothing is leased and the caches keep only what they shared.
  absl::StatusOr<FetchResult> Fetch(const FetchParams& params);
  // Fetch, if the request's table is cached (a lookup and a lease, no
  // materialization: cheap enough for a gRPC callback thread); nullopt when
  // it is not, or when only Fetch can tell what is wrong with the request.
  std::optional<absl::StatusOr<FetchResult>> TryFetchCached(const FetchParams& params);

  using VerifyResult = ModelService::VerifyResult;
  // Recomputes every stored tensor's digest: DATA_LOSS naming mismatches.
  absl::StatusOr<VerifyResult> Verify(const std::string& name) const;
  // `caller` (null = the daemon) must be allowed to use the lease
  // (AccessPolicy::CheckLeaseUse): PERMISSION_DENIED otherwise.
  absl::StatusOr<ReadRange> Read(uint64_t lease_id, absl::string_view token,
                                 uint32_t segment, uint64_t offset, uint64_t length,
                                 const Principal* caller = nullptr);
  // Ends the lease now: NOT_FOUND for an unknown or ended lease,
  // PERMISSION_DENIED for a wrong token or a caller that may not use it.
  // Bytes already mapped by the client stay valid (the kernel keeps the
  // memfds); the daemon drops its hold, and generations and cache entries
  // that nothing else holds are pruned (large frees on the disposer
  // thread, never on the caller's).
  absl::Status Release(uint64_t lease_id, absl::string_view token,
                       const Principal* caller = nullptr);
  // For the data socket: may `caller` attach lease `lease_id`? OK for leases
  // fetched without a caller and for unknown ids (the token check decides).
  absl::Status CheckLeaseUse(uint64_t lease_id, const Principal& caller) const;
  // May `caller` read `model` at its current generation? NOT_FOUND when
  // it is not loaded.
  absl::Status CheckCanRead(const std::string& model, const Principal& caller) const;
  const AccessPolicy& access() const { return access_; }
  // The GPUs found at start-up, or why none.
  const GpuInventory& gpus() const override { return options_.gpus; }
  // A push into a client's memory answered OK (the data socket calls it).
  void RecordPush(uint64_t bytes) { fetch_.RecordPush(bytes); }

  // Adapters. `strict`: keys the parser does not understand fail the load.
  // `readers`: a tenant-private adapter (see GenerationInfo::guards).
  // With peers (options().peers), the weights file is read as a one-file
  // checkpoint from `source` (LoadCheckpoint: storage, or peers holding the
  // same file) and its bytes stay resident while the adapter lives, so that
  // peers can take them in turn; without, it is read from storage.
  absl::StatusOr<AdapterSummary> LoadAdapter(const std::string& name, const std::string& path,
                                             const std::string& format, bool strict,
                                             const std::vector<std::string>& readers = {},
                                             LoadSource source = LoadSource::kStorage);
  // Models applying it keep their generations; the name becomes free.
  absl::Status UnloadAdapter(const std::string& name);
  std::vector<AdapterSummary> ListAdapters() const;
  // Sets `model`'s whole adapter stack (empty = back to the base) as a new
  // generation, atomically. expect_generation != 0 and != current: ABORTED.
  // Shape mismatches, unknown adapters or targets, bad strengths: an error
  // and the current generation untouched.
  absl::StatusOr<GenerationInfo> Apply(const std::string& model,
                                       const std::vector<AdapterRef>& stack,
                                       uint64_t expect_generation);
  // For a restore (--state-dir): Apply, numbering the new generation at
  // least `number` (a restored model serves its stack under the number it
  // had), published only if its content is `expect_content` (DATA_LOSS
  // otherwise); and the lowest number `model`'s next generation may get
  // (numbers already given out are never given to other content; at most
  // kMaxGeneration + 1, "none left": INVALID_ARGUMENT above). Both
  // journaled. Every new generation's number is checked
  // (NextGenerationNumber): FAILED_PRECONDITION past kMaxGeneration.
  absl::StatusOr<GenerationInfo> RestoreApply(const std::string& model,
                                              const std::vector<AdapterRef>& stack,
                                              uint64_t number, const Digest& expect_content);
  absl::Status SetGenerationFloor(const std::string& model, uint64_t floor);
  // For a restore: the published weights saved as `path` (a file name of
  // the PublishedStore)
  // in place of the model's checkpoint tensors, with `stack` merged on
  // them, as generation `number` — published (and journaled, naming `path`
  // again) only if its identity is `expect_content`: DATA_LOSS otherwise,
  // and for a file whose tensors the model does not have as stored.
  absl::StatusOr<GenerationInfo> RestorePublish(const std::string& model, const std::string& path,
                                                const std::vector<AdapterRef>& stack,
                                                uint64_t number, const Digest& expect_content);
  // Null without options.state_dir.
  PublishedStore* published_store() { return published_store_.get(); }
  // Blocks until `model` has a generation > `after`, or `timeout` passes
  // (then nullopt). NOT_FOUND when the model is unloaded.
  absl::StatusOr<std::optional<GenerationInfo>> WaitForGeneration(const std::string& model,
                                                                  uint64_t after,
                                                                  absl::Duration timeout);


  // Publishing new base weights (server/publish/). A publisher
  // opens a session for the served tensors it will write (names, dtypes and
  // shapes of the model's current generation: NOT_FOUND for an unknown
  // name, INVALID_ARGUMENT naming the tensor for another dtype or shape, a
  // name twice, a tensor an adapter adds), gets a staging segment laid out
  // for them (PublishLayout, charged to the budget: RESOURCE_EXHAUSTED
  // here, before anything is visible), writes every byte exactly once
  // (WritePublish, from one or several writers, e.g. the ranks of a
  // sharded trainer), and the last byte to arrive makes the generation:
  // each tensor is digested; one whose bytes equal the current ones keeps
  // its digest and memory; the others replace the base's (the adapter stack
  // is merged again on the new base). Nothing is visible before that, and a
  // session aborted, failed or past its deadline leaves nothing and frees
  // its memory. expect_generation != 0 is checked at begin and at commit
  // (ABORTED).
  //
  // Access: admin rights are the caller's to check (like load); writing
  // requires reading, checked here for every call that names a `caller`
  // (none = the daemon itself): the caller must be able to read the
  // model's current generation (as Fetch words it: NOT_FOUND for a model
  // not loaded, PERMISSION_DENIED naming the first guard that refuses),
  // before anything else about the model or the publish is checked or
  // said. The calls on a session check its token first, then the caller
  // against the model's readers; the commit also against the generation it
  // builds on. Open sessions are capped (PublishSlots) and charged: their
  // staging segments and their metadata count against --host-memory-bytes.
  using PublishBeginParams = ::weightd::PublishBeginParams;
  using PublishSessionInfo = ::weightd::PublishSessionInfo;
  using PublishRun = ::weightd::PublishRun;
  using PublishResult = ::weightd::PublishResult;
  using PublishProgress = ::weightd::PublishProgress;
  absl::StatusOr<PublishSessionInfo> BeginPublish(const PublishBeginParams& params);
  // Copies `data` (the runs' bytes, concatenated) into the staging segment.
  // INVALID_ARGUMENT naming the tensor and bytes for a run past a tensor's
  // end or over bytes already written, or data of another length — and the
  // session fails (nothing of it will be visible). NOT_FOUND for an
  // unknown or ended session, PERMISSION_DENIED for a wrong token.
  // `in_place`: the runs were written straight into the staging memfd
  // (StagePublish) and carry no data (`data` must be empty); they count as
  // arrived as if copied. FAILED_PRECONDITION when no writer took the
  // staging memfd.
  //
  // Nothing a writer of the staging memfd does can fail more than its own
  // session: a copy into a staging page the writer punched out (on hugetlb
  // with no free page left in the pool, a SIGBUS) ends the session
  // FAILED_PRECONDITION naming the page's offset (server/base/fault_guard.h).
  absl::StatusOr<PublishProgress> WritePublish(const std::optional<Principal>& caller,
                                               uint64_t id, absl::string_view token,
                                               absl::Span<const PublishRun> runs,
                                               absl::string_view data, bool in_place = false);
  // Zero-copy staging: a writable fd of the open session's staging memfd
  // (sealed against growing and shrinking), for a publisher on this node to
  // map, write in place and unmap (common/data_protocol.h, StageRequest).
  // From then on the commit seals the memfd with F_SEAL_WRITE: a publisher
  // that still maps it makes the session fail (FAILED_PRECONDITION); so
  // does one that sealed it itself (F_SEAL_SEAL), or punched pages out of
  // it (the commit finds fewer pages allocated than it handed out).
  // `token` as BeginPublish gave it (hex).
  absl::StatusOr<UniqueFd> StagePublish(const std::optional<Principal>& caller, uint64_t id,
                                        absl::string_view token);
  // The session's result: waits up to `wait` for its last byte and commit;
  // then FAILED_PRECONDITION naming the first tensor and bytes still
  // missing (the session stays open until its deadline), or the error that
  // ended it.
  absl::StatusOr<PublishResult> CommitPublish(const std::optional<Principal>& caller,
                                              uint64_t id, absl::string_view token,
                                              absl::Duration wait);
  absl::Status AbortPublish(const std::optional<Principal>& caller, uint64_t id,
                            absl::string_view token);

  ServiceStats Stats() const override;

  LeaseTable* leases() { return &leases_; }
  // The host memory manager (--host-memory-bytes): what else allocates host
  // memory for clients (the data socket's exports) charges it here.
  HostMemoryManager* host_memory() { return &memory_; }
  // The checkpoints resident by their files (what a hand-over gives away).
  const ResidentCheckpoints& resident_checkpoints() const { return resident_; }
  uint64_t checkpoint_segment_bytes() const { return options_.checkpoint_segment_bytes; }
  const WeightServiceOptions& options() const { return options_; }
  // The parts, for callers that need only one (they live as long as this).
  Catalog* catalog() { return &catalog_; }
  ModelService* models() { return &models_; }
  AdapterService* adapters() { return &adapters_; }
  FetchService* fetches() { return &fetch_; }
  ResidentCopies* copies() { return &copies_; }
  PublishService* publishes() { return &publish_; }

 private:
  WeightService(WeightServiceOptions options, ModelRoots roots);
  // The housekeeper's jobs: lease expiry, pruning, publish expiry, the
  // staging reclaim and the materializer's sweep.
  std::vector<Housekeeper::Job> ReapJobs();
  // A model left the catalog: its publish sessions end, its saved
  // publishes are forgotten.
  void OnUnloaded(const Model& model);
  // --pin-host-memory (pinner_): registers the segments of a generation's
  // published tensors with CUDA.
  void PinPublished(const std::string& model, const PublishedBase* published);
  // A published tensor's entry, its metadata (TensorMetadataBytes) charged
  // to the budget for as long as the entry lives: RESOURCE_EXHAUSTED when
  // it does not fit.
  absl::StatusOr<std::shared_ptr<const StoredTensor>> ChargedPublished(StoredTensor t);

  // The publish commit (publish.cc). Digests the staged tensors and makes
  // the generation (the write that completed the session calls it).
  // `caller` made the call that committed it.
  absl::StatusOr<PublishResult> CommitStaged(PublishSession& session,
                                             const std::optional<Principal>& caller);
  // CommitStaged's phases beyond publish_commit.h's, those that read or
  // change the catalog. The commit's times, for its log line.
  struct CommitTimes {
    absl::Time start;     // the last byte landed
    absl::Time sealed;    // SealStaging done
    absl::Time digested;  // DigestPieces done
  };
  // The session's model, if it is still the instance the session began on
  // (ABORTED otherwise; NOT_FOUND when unloaded).
  absl::StatusOr<std::shared_ptr<const Model>> FindSessionModel(
      const PublishSession& session) const;
  // A publish that changes nothing: the current generation `cur` as the
  // result; ABORTED and `raced` when the model moved on meanwhile.
  absl::Status CurrentAsResult(const PublishSession& session,
                               const std::shared_ptr<const Generation>& cur,
                               PublishResult* result, bool* raced);
  // Shares or stores the changed pieces of `diff` (ResidentCopies::Find,
  // PlanStore, CompactStored, StoredTensorsOf) and installs the generation
  // they make on `cur` (InstallPublished).
  absl::Status StorePublished(PublishSession& session, const Model& model,
                              const std::shared_ptr<const Generation>& cur,
                              const SegmentPtr& segment, PublishDiff& diff,
                              PublishResult* result, bool* raced);
  // Builds the generation of `published` on `cur` and commits it
  // (Catalog::Commit): journaled, installed, pinned and saved for restarts.
  // ABORTED and `raced` when another change won (the caller builds on it).
  absl::Status InstallPublished(const PublishSession& session, const Model& model,
                                const std::shared_ptr<const Generation>& cur,
                                std::shared_ptr<PublishedBase> published, PublishResult* result,
                                bool* raced);
  // Records the result's guards on the session, counts and logs the publish.
  PublishResult FinishPublish(PublishSession& session, std::vector<ReadGuard> result_guards,
                              const CommitTimes& times, PublishResult result);

  // RestorePublish's phases: the saved file, read from the state
  // directory; where its bytes are shared from other models or packed;
  // its tensors checked against the model and placed.
  using ResidentCopy = ResidentCopies::ResidentCopy;
  using WantedBytes = ResidentCopies::WantedBytes;
  absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadPublishedFile(const std::string& path);
  struct RestoredSharing {
    std::vector<std::optional<HeldElsewhere>> copies;  // per saved tensor
    std::vector<uint64_t> packed_at;                   // in `packed`, per saved tensor
    SegmentPtr packed;  // the unshared tensors moved out of the file; null: kept there
    uint64_t bytes_shared = 0;
  };
  RestoredSharing ShareRestored(const Model& model, const std::vector<StoredTensor>& saved);
  absl::StatusOr<std::shared_ptr<PublishedBase>> RestoredBase(
      const Model& model, const std::string& path, const std::vector<StoredTensor>& saved,
      const RestoredSharing& sharing);

  // Constant after construction; the parts, in construction order (each
  // borrows those above it; destroyed in reverse).
  const WeightServiceOptions options_;
  const ModelRoots roots_;
  // Paths to roots_, URLs to options_.sources.
  const SourceRoutingOpener files_{&roots_, options_.sources};
  // --pin-host-memory; before memory_, whose segments keep writable
  // mappings where it registers those.
  HostPinner pinner_;
  // Budget, warm reserve, disposer, reclaimer chain; before materializer_
  // and leases_, which borrow it.
  HostMemoryManager memory_;
  // Checkpoints by the identity of their files: loading files that are
  // resident already shares them.
  ResidentCheckpoints resident_;
  // Saves published weights for restarts (null: no --state-dir).
  std::unique_ptr<PublishedStore> published_store_;
  Materializer materializer_;
  LeaseTable leases_;
  const AccessPolicy access_;
  // Models and adapters by name; serializes the changes of what is served.
  Catalog catalog_;
  ResidentCopies copies_;
  ModelService models_;
  AdapterService adapters_;
  FetchService fetch_;
  // Staging prepared ahead for a model's next publish
  // (options_.publish_staging_ahead; BeginPublish takes it).
  StagingReserve staging_;
  // Open publish sessions (publish/publish_service.h); commits call
  // CommitStaged.
  PublishService publish_;

  // Own synchronization: the publish counters.
  std::atomic<uint64_t> publish_count_{0};
  std::atomic<uint64_t> publish_bytes_{0};
  std::atomic<uint64_t> publish_ns_{0};

  // Runs the periodic jobs (ReapJobs); started last, stopped first.
  Housekeeper housekeeper_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ENGINE_WEIGHT_SERVICE_H_
