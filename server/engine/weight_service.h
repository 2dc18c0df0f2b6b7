// WeightService: the daemon's domain core — models, fetches, leases,
// publishes — with no gRPC in sight. server/grpc adapts it to weightd.v1;
// tests may drive it directly.
//
// It is becoming a facade over single-job parts (issue 40): ChangeCommitter
// (the journaled order of changes), Housekeeper (the periodic jobs),
// StagingReserve and PublishService (server/publish/: sessions, staging
// ahead, the commit's phases). The catalog, model, adapter, generation and
// fetch methods are still its own, defined in files by concern:
// weight_service.cc (models), generations.cc, fetch.cc, adapters.cc,
// resident_copies.cc, service_stats.cc, publish.cc (the commit).
//
// Thread-safe. Loading and materialization run on the caller's thread (and
// their own workers) without holding the registry lock.
//
// Lock order (each may be taken while holding those to its left, never the
// other way):
//   ChangeCommitter::mu_ -> WeightService::mu_ (the catalog) -> PublishService::mu_
//   PublishSession::mu   taken alone, never with the three above
//   leaves (nothing is taken while one is held): StagingReserve::mu_,
//     PublishSlots::mu_, peer_counters_mu_, Generation::scale_mu,
//     FetchTableCache, LeaseTable, HostMemoryManager internals,
//     ResidentCheckpoints, DonatedCheckpoints
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
#include "server/service/change_committer.h"
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

// The bytes a grpc-transport Read streams.
struct ReadRange {
  BufferPtr buffer;  // host memory (Read refuses other kinds)
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ServiceStats {
  uint64_t models = 0;
  uint64_t segments = 0;
  uint64_t bytes_resident = 0;
  // Checkpoint bytes summed over models, and held: a checkpoint that
  // several models share (ResidentCheckpoints) counts once.
  uint64_t checkpoint_bytes_logical = 0;
  uint64_t checkpoint_bytes_resident = 0;
  // Published bytes of the current generations summed over models, and the
  // segments that hold them beside the checkpoints', each counted once.
  uint64_t published_bytes_logical = 0;
  uint64_t published_bytes_resident = 0;
  uint64_t memory_limit = 0;
  SegmentPoolStats reserve;  // zeros without a reserve
  MaterializerStats materializer;
  uint64_t leases_open = 0;
  uint64_t bytes_served = 0;
  uint64_t bytes_read = 0;  // asked for by grpc-transport Reads
  uint64_t fetches = 0;
  uint64_t applies = 0;
  uint64_t adapters = 0;
  uint64_t loads = 0;
  uint64_t load_bytes = 0;
  double load_seconds = 0;
  uint64_t fetch_errors = 0;
  uint64_t pinned_bytes = 0;  // host memory registered with CUDA now
  HugePageMode huge_pages = HugePageMode::kOff;
  uint64_t page_bytes[kPageKinds] = {};  // live segments' bytes by PageKind
  uint64_t page_fallbacks = 0;
  HostPages host_pages;
  uint64_t pushes = 0;      // pushes into clients' memory answered OK
  uint64_t push_bytes = 0;  // the tensor bytes they wrote
  uint64_t publishes = 0;         // publish sessions committed
  uint64_t publish_bytes = 0;     // the bytes they received
  double publish_seconds = 0;     // from begin to visible, summed
  uint64_t publish_sessions = 0;  // open now (their staging memory is held)
  // Sessions begun on staging prepared ahead / allocated at begin; bytes
  // prepared and waiting now (WeightServiceOptions::publish_staging_ahead).
  uint64_t publish_staging_prepared = 0;
  uint64_t publish_staging_allocated = 0;
  uint64_t publish_staging_ahead_bytes = 0;
  LatencyHistogram::Snapshot fetch_latency_shm;
  LatencyHistogram::Snapshot fetch_latency_grpc;
  // Checkpoint bytes loads took from storage and from peers; per peer the
  // bytes received and the ranges it failed; bytes sent to loading peers.
  uint64_t load_bytes_storage = 0;
  uint64_t load_bytes_peers = 0;  // kept by the loads
  // Sent by peers and thrown away (wrong, fetched again, the load failed).
  uint64_t load_bytes_peers_discarded = 0;
  struct PeerCounters {
    uint64_t bytes = 0;
    uint64_t failures = 0;
  };
  std::map<std::string, PeerCounters> peer_transfers;
  uint64_t bytes_sent_to_peers = 0;
  // Remote sources (--model-source): bytes received, requests, retries,
  // failed operations (server/source/source_client.h).
  SourceCounters source;
};

class WeightService {
 public:
  static absl::StatusOr<std::unique_ptr<WeightService>> Create(WeightServiceOptions options);
  ~WeightService();

  // Loads `path` (inside a model root) as model `name`. ALREADY_EXISTS when
  // the name is taken or being loaded; errors from the store otherwise,
  // with nothing left allocated.
  // `readers` (ReaderList syntax) makes the model private; INVALID_ARGUMENT
  // when malformed.
  absl::StatusOr<ModelSummary> LoadModel(const std::string& name, const std::string& path,
                                         const std::string& profile_json,
                                         const LoadProgressFn& progress,
                                         const std::vector<std::string>& readers = {},
                                         LoadSource source = LoadSource::kStorage)
      ABSL_LOCKS_EXCLUDED(mu_);
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
                                       const Principal& asker) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ReadRange> ReadHeld(const Digest& key, const Digest& copy,
                                     const CheckpointRange& range, const Principal& asker)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Where copy `copy` of `key` keeps each file's data section (its segment,
  // the offset in it, the length), for a UCX grant: the same filter as
  // ReadHeld (NOT_FOUND otherwise).
  struct HeldSection {
    SegmentPtr segment;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  absl::StatusOr<std::vector<HeldSection>> HeldSections(const Digest& key, const Digest& copy,
                                                        const Principal& asker) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // For a restore (--state-dir): LoadModel that publishes the model only if
  // its served content is `content` (DATA_LOSS otherwise: nothing served,
  // nothing journaled), with its next generation numbered at least
  // `generation_floor`.
  struct RestoreExpect {
    Digest content;
    uint64_t generation_floor = 0;
    // A URL load's objects as journaled: checked before anything is read,
    // FAILED_PRECONDITION when one changed (docs/sources.md).
    std::vector<StateRecord::SourceObject> objects;
  };
  absl::StatusOr<ModelSummary> RestoreLoadModel(const std::string& name, const std::string& path,
                                                const std::string& profile_json,
                                                const std::vector<std::string>& readers,
                                                const RestoreExpect& expect,
                                                const LoadProgressFn& progress = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Leased bytes stay readable until their leases end.
  absl::Status UnloadModel(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ModelSummary> ListModels() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ModelDetail> GetModel(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);

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
  absl::StatusOr<FetchResult> Fetch(const FetchParams& params) ABSL_LOCKS_EXCLUDED(mu_);
  // Fetch, if the request's table is cached (a lookup and a lease, no
  // materialization: cheap enough for a gRPC callback thread); nullopt when
  // it is not, or when only Fetch can tell what is wrong with the request.
  std::optional<absl::StatusOr<FetchResult>> TryFetchCached(const FetchParams& params)
      ABSL_LOCKS_EXCLUDED(mu_);

  struct VerifyResult {
    uint64_t tensors = 0;
    uint64_t bytes = 0;
  };
  // Recomputes every stored tensor's digest: DATA_LOSS naming mismatches.
  absl::StatusOr<VerifyResult> Verify(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
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
  absl::Status CheckCanRead(const std::string& model, const Principal& caller) const
      ABSL_LOCKS_EXCLUDED(mu_);
  const AccessPolicy& access() const { return access_; }
  // The GPUs found at start-up, or why none.
  const GpuInventory& gpus() const { return options_.gpus; }
  // A push into a client's memory answered OK (the data socket calls it).
  void RecordPush(uint64_t bytes) {
    pushes_.fetch_add(1);
    push_bytes_.fetch_add(bytes);
  }

  // Adapters. `strict`: keys the parser does not understand fail the load.
  // `readers`: a tenant-private adapter (see GenerationInfo::guards).
  // With peers (options().peers), the weights file is read as a one-file
  // checkpoint from `source` (LoadCheckpoint: storage, or peers holding the
  // same file) and its bytes stay resident while the adapter lives, so that
  // peers can take them in turn; without, it is read from storage.
  absl::StatusOr<AdapterSummary> LoadAdapter(const std::string& name, const std::string& path,
                                             const std::string& format, bool strict,
                                             const std::vector<std::string>& readers = {},
                                             LoadSource source = LoadSource::kStorage)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Models applying it keep their generations; the name becomes free.
  absl::Status UnloadAdapter(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<AdapterSummary> ListAdapters() const ABSL_LOCKS_EXCLUDED(mu_);
  // Sets `model`'s whole adapter stack (empty = back to the base) as a new
  // generation, atomically. expect_generation != 0 and != current: ABORTED.
  // Shape mismatches, unknown adapters or targets, bad strengths: an error
  // and the current generation untouched.
  absl::StatusOr<GenerationInfo> Apply(const std::string& model,
                                       const std::vector<AdapterRef>& stack,
                                       uint64_t expect_generation) ABSL_LOCKS_EXCLUDED(mu_);
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
                                              uint64_t number, const Digest& expect_content)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetGenerationFloor(const std::string& model, uint64_t floor)
      ABSL_LOCKS_EXCLUDED(mu_);
  // For a restore: the published weights saved as `path` (a file name of
  // the PublishedStore)
  // in place of the model's checkpoint tensors, with `stack` merged on
  // them, as generation `number` — published (and journaled, naming `path`
  // again) only if its identity is `expect_content`: DATA_LOSS otherwise,
  // and for a file whose tensors the model does not have as stored.
  absl::StatusOr<GenerationInfo> RestorePublish(const std::string& model, const std::string& path,
                                                const std::vector<AdapterRef>& stack,
                                                uint64_t number, const Digest& expect_content)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Null without options.state_dir.
  PublishedStore* published_store() { return published_store_.get(); }
  // Blocks until `model` has a generation > `after`, or `timeout` passes
  // (then nullopt). NOT_FOUND when the model is unloaded.
  absl::StatusOr<std::optional<GenerationInfo>> WaitForGeneration(const std::string& model,
                                                                  uint64_t after,
                                                                  absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);


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
  absl::StatusOr<PublishSessionInfo> BeginPublish(const PublishBeginParams& params)
      ABSL_LOCKS_EXCLUDED(mu_);
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
                                               absl::string_view data, bool in_place = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Zero-copy staging: a writable fd of the open session's staging memfd
  // (sealed against growing and shrinking), for a publisher on this node to
  // map, write in place and unmap (common/data_protocol.h, StageRequest).
  // From then on the commit seals the memfd with F_SEAL_WRITE: a publisher
  // that still maps it makes the session fail (FAILED_PRECONDITION); so
  // does one that sealed it itself (F_SEAL_SEAL), or punched pages out of
  // it (the commit finds fewer pages allocated than it handed out).
  // `token` as BeginPublish gave it (hex).
  absl::StatusOr<UniqueFd> StagePublish(const std::optional<Principal>& caller, uint64_t id,
                                        absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session's result: waits up to `wait` for its last byte and commit;
  // then FAILED_PRECONDITION naming the first tensor and bytes still
  // missing (the session stays open until its deadline), or the error that
  // ended it.
  absl::StatusOr<PublishResult> CommitPublish(const std::optional<Principal>& caller,
                                              uint64_t id, absl::string_view token,
                                              absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AbortPublish(const std::optional<Principal>& caller, uint64_t id,
                            absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);

  ServiceStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  LeaseTable* leases() { return &leases_; }
  // The host memory manager (--host-memory-bytes): what else allocates host
  // memory for clients (the data socket's exports) charges it here.
  HostMemoryManager* host_memory() { return &memory_; }
  // The checkpoints resident by their files (what a hand-over gives away).
  const ResidentCheckpoints& resident_checkpoints() const { return resident_; }
  uint64_t checkpoint_segment_bytes() const { return options_.checkpoint_segment_bytes; }
  const WeightServiceOptions& options() const { return options_; }

 private:
  static Digest ContentIdentity(const ContentMap& content);
  // A restored publish (RestorePublish): its weights replace the current
  // generation's published ones, and it is journaled as a publish.
  struct RestoredPublish {
    std::shared_ptr<const PublishedBase> base;
    std::string path;
    uint64_t bytes_shared = 0;  // held by another model already (FindResidentCopies)
  };
  // RestorePublish's phases: the saved file, read from the state
  // directory; where its bytes are shared from other models or packed;
  // its tensors checked against the model and placed.
  absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadPublishedFile(const std::string& path);
  struct RestoredSharing {
    std::vector<std::optional<HeldElsewhere>> copies;  // per saved tensor
    std::vector<uint64_t> packed_at;                   // in `packed`, per saved tensor
    SegmentPtr packed;  // the unshared tensors moved out of the file; null: kept there
    uint64_t bytes_shared = 0;
  };
  RestoredSharing ShareRestored(const Model& model, const std::vector<StoredTensor>& saved)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<PublishedBase>> RestoredBase(
      const Model& model, const std::string& path, const std::vector<StoredTensor>& saved,
      const RestoredSharing& sharing);
  absl::StatusOr<GenerationInfo> ApplyImpl(const std::string& model,
                                           const std::vector<AdapterRef>& stack,
                                           uint64_t expect_generation, uint64_t number_at_least,
                                           const Digest* expect_content,
                                           const RestoredPublish* restored = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ModelSummary> LoadModelImpl(const std::string& name, const std::string& path,
                                             const std::string& profile_json,
                                             const LoadProgressFn& progress,
                                             const std::vector<std::string>& readers,
                                             const RestoreExpect* expect,
                                             LoadSource source = LoadSource::kStorage)
      ABSL_LOCKS_EXCLUDED(mu_);
  // An adapter's weights file read as a one-file checkpoint from `source`
  // (with peers: AdapterLoadOptions::fetch), kept resident with the adapter;
  // empty when it is resident only as tensors shared with other models.
  absl::StatusOr<AdapterLoadOptions::FetchedBytes> FetchAdapterFile(const std::string& file,
                                                                    absl::string_view header,
                                                                    LoadSource source);
  // LoadModelImpl's model, before it is committed: its checkpoint read
  // (opened and confined to the model roots by LoadCheckpoint, file by
  // file), pinned, laid out and at generation 1. `shared`: the checkpoint
  // is another model's (the same files).
  absl::StatusOr<std::shared_ptr<Model>> BuildModel(const std::string& name,
                                                    const std::string& path,
                                                    std::shared_ptr<const Profile> profile,
                                                    ReaderList readers,
                                                    const LoadProgressFn& progress,
                                                    LoadSource source, bool* shared)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reads `path` as this daemon reads checkpoints (its memory, segment and
  // read sizes, threads, model roots, resident files and peers) from
  // `source`, and counts where the bytes came from. `shared_charge`,
  // `progress`, `donated`: as CheckpointLoadOptions'. `share_held` (model
  // loads): tensors whose bytes a public model holds already are shared
  // (CheckpointLoadOptions::find_held, FindResidentCopies).
  absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadCheckpoint(
      const std::string& path, LoadSource source, std::unique_ptr<MemoryCharge>* shared_charge,
      const LoadProgressFn& progress = nullptr, DonatedCheckpoints* donated = nullptr,
      std::vector<std::string>* opened_files = nullptr, bool share_held = false)
      ABSL_LOCKS_EXCLUDED(mu_, peer_counters_mu_);
  // FAILED_PRECONDITION unless every object still has its journaled
  // version and size (a restore of a URL load).
  absl::Status CheckSourceObjects(const std::vector<StateRecord::SourceObject>& objects) const;
  void CountLoadSources(const LoadSourceReport& report) ABSL_LOCKS_EXCLUDED(peer_counters_mu_);
  // The resident checkpoints read from files whose CheckpointKey is `key`
  // and that are unchanged since (all of them, or file `only_file`), the
  // newest first.
  std::vector<std::shared_ptr<const Checkpoint>> HeldCopies(const Digest& key,
                                                           int only_file = -1) const;
  // Whether a loaded model or adapter holding `c` admits `asker` as a reader.
  bool MayOfferToPeer(const Checkpoint& c, const Principal& asker) const ABSL_LOCKS_EXCLUDED(mu_);
  // One change of what is served, from its journal record to its
  // publication (ChangeCommitter::Commit): `check` (under mu_) may refuse
  // it, and then nothing is journaled; else the record gets the next seq
  // and reaches options_.on_state_change (the journal: durable when it
  // returns), and `publish` (under mu_; no other change ran meanwhile)
  // makes it visible.
  absl::Status CommitState(StateRecord& record, absl::FunctionRef<absl::Status()> check,
                           absl::FunctionRef<void()> publish) ABSL_LOCKS_EXCLUDED(mu_);

  WeightService(WeightServiceOptions options, ModelRoots roots);
  static ModelSummary Summarize(const Model& model);
  absl::StatusOr<std::shared_ptr<const Model>> FindModel(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A published tensor's entry, its metadata (TensorMetadataBytes) charged
  // to the budget for as long as the entry lives: RESOURCE_EXHAUSTED when
  // it does not fit.
  absl::StatusOr<std::shared_ptr<const StoredTensor>> ChargedPublished(StoredTensor t);
  static absl::StatusOr<std::shared_ptr<Generation>> BuildGeneration(
      const Model& model, uint64_t number, const std::vector<AdapterRef>& stack,
      std::vector<std::shared_ptr<const Adapter>> adapters,
      std::shared_ptr<const PublishedBase> published = nullptr);
  // Makes `gen` (built on `model`, numbered `number`) the model's current
  // generation, keeping the leased ones; the numbers no longer kept go to
  // `retired`. REQUIRES: models_ holds `model_name`.
  GenerationInfo InstallGeneration(const std::string& model_name, std::shared_ptr<Generation> gen,
                                   std::vector<uint64_t>* retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What clients are told of generation `gen` of `model`.
  static GenerationInfo InfoOf(const Model& model, const Generation& gen);
  // Digests the staged tensors and makes the generation (the write that
  // completed the session calls it).
  // `caller` made the call that committed it.
  absl::StatusOr<PublishResult> CommitStaged(PublishSession& session,
                                             const std::optional<Principal>& caller)
      ABSL_LOCKS_EXCLUDED(mu_);
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
      const PublishSession& session) const ABSL_LOCKS_EXCLUDED(mu_);
  // A publish that changes nothing: the current generation `cur` as the
  // result; ABORTED and `raced` when the model moved on meanwhile.
  absl::Status CurrentAsResult(const PublishSession& session,
                               const std::shared_ptr<const Generation>& cur,
                               PublishResult* result, bool* raced) ABSL_LOCKS_EXCLUDED(mu_);
  // Shares or stores the changed pieces of `diff` (FindResidentCopies,
  // PlanStore, CompactStored, StoredTensorsOf) and installs the generation
  // they make on `cur` (InstallPublished).
  absl::Status StorePublished(PublishSession& session, const Model& model,
                              const std::shared_ptr<const Generation>& cur,
                              const SegmentPtr& segment, PublishDiff& diff,
                              PublishResult* result, bool* raced)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Builds the generation of `published` on `cur` and commits it
  // (CommitState): journaled, installed, pinned and saved for restarts.
  // ABORTED and `raced` when another change won (the caller builds on it).
  absl::Status InstallPublished(const PublishSession& session, const Model& model,
                                const std::shared_ptr<const Generation>& cur,
                                std::shared_ptr<PublishedBase> published, PublishResult* result,
                                bool* raced) ABSL_LOCKS_EXCLUDED(mu_);
  // Records the result's guards on the session, counts and logs the publish.
  PublishResult FinishPublish(PublishSession& session, std::vector<ReadGuard> result_guards,
                              const CommitTimes& times, PublishResult result);
  // Where bytes can be shared instead of stored (CommitStaged,
  // RestorePublish, model loads). For each wanted run of bytes: a tensor
  // some loaded model holds now (a checkpoint tensor, served or not, or a
  // published one of its current generation) with the same digest and the
  // same bytes (memcmp), in host memory, such that
  //  - whoever reads the new holder could read its segment already:
  //    clients map whole segments, so the holder (with its current
  //    generation's guards) must be public or have exactly `scope`
  //    (ReadScope of the new holder's guards; "" admits public holders
  //    only); and
  //  - sharing pins no more than it saves: the segment is one the new
  //    generation holds anyway (`held`: buffer ids), or the runs shared
  //    from it make up at least half of it.
  // Empty where there is none. The model named `own` (if any) is looked
  // at first. (The holder is the model's name.)
  using ResidentCopy = HeldElsewhere;
  struct WantedBytes {
    Digest digest;
    const uint8_t* data = nullptr;
    uint64_t length = 0;
  };
  std::vector<std::optional<ResidentCopy>> FindResidentCopies(
      const std::string& own, const std::string& scope, absl::Span<const WantedBytes> wanted,
      const absl::flat_hash_set<uint64_t>& held) const ABSL_LOCKS_EXCLUDED(mu_);
  // FindResidentCopies' second rule over `copies` (one per `wanted`): drops
  // the copies from a segment outside `held` whose distinct runs taken make
  // up less than half of it. True when it dropped any.
  static bool DropCopiesUnderHalf(std::vector<std::optional<ResidentCopy>>& copies,
                                  absl::Span<const WantedBytes> wanted,
                                  const absl::flat_hash_set<uint64_t>& held);
  absl::StatusOr<float> Fp8Scale(const Served& served, const Generation& gen);
  // The housekeeper's jobs: lease expiry, pruning, publish expiry, the
  // staging reclaim and the materializer's sweep.
  std::vector<Housekeeper::Job> ReapJobs();
  // Drops generations that are neither current nor leased, and their cache.
  void PruneGenerations() ABSL_LOCKS_EXCLUDED(mu_);

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

  // Serializes the changes of what is served from their journal record
  // to their publication; its lock is taken before mu_.
  ChangeCommitter committer_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Model>> models_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> loading_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const Adapter>> adapters_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, AdapterSummary> adapter_info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, ReaderList> adapter_readers_ ABSL_GUARDED_BY(mu_);
  // The journal seq of each loaded adapter's load (apply records name it).
  absl::flat_hash_map<std::string, uint64_t> adapter_seq_ ABSL_GUARDED_BY(mu_);
  absl::CondVar generation_changed_;
  std::atomic<uint64_t> next_model_instance_{1};
  // Staging prepared ahead for a model's next publish
  // (options_.publish_staging_ahead; BeginPublish takes it).
  StagingReserve staging_;
  // Open publish sessions (publish/publish_service.h); commits call
  // CommitStaged.
  PublishService publish_;
  std::atomic<uint64_t> publish_count_{0};
  std::atomic<uint64_t> publish_bytes_{0};
  std::atomic<uint64_t> publish_ns_{0};

  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> pushes_{0};
  std::atomic<uint64_t> push_bytes_{0};
  std::atomic<uint64_t> fetches_{0};
  std::atomic<uint64_t> applies_{0};
  std::atomic<uint64_t> loads_{0};
  std::atomic<uint64_t> load_bytes_{0};
  mutable absl::Mutex peer_counters_mu_;
  uint64_t load_bytes_storage_ ABSL_GUARDED_BY(peer_counters_mu_) = 0;
  uint64_t load_bytes_peers_ ABSL_GUARDED_BY(peer_counters_mu_) = 0;
  uint64_t load_bytes_peers_discarded_ ABSL_GUARDED_BY(peer_counters_mu_) = 0;
  std::map<std::string, ServiceStats::PeerCounters> peer_transfers_
      ABSL_GUARDED_BY(peer_counters_mu_);
  std::atomic<uint64_t> bytes_sent_to_peers_{0};
  std::atomic<uint64_t> load_ns_{0};
  std::atomic<uint64_t> fetch_errors_{0};
  LatencyHistogram fetch_latency_shm_;
  LatencyHistogram fetch_latency_grpc_;
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
  // --pin-host-memory (pinner_): registers the segments of a loaded
  // checkpoint, or of a generation's published tensors, with CUDA.
  void PinCheckpoint(const std::string& model, const Checkpoint& checkpoint);
  void PinPublished(const std::string& model, const PublishedBase* published);
  // Generation `number` of `model` (0 = current), null if it is not kept.
  static std::shared_ptr<const Generation> GenerationOf(const Model& model, uint64_t number);

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
  // Does a lease still hold `gen`?
  static bool IsLeased(const Generation& gen) { return gen.lease_marker.use_count() > 1; }
  FetchTableCache fetch_cache_;

  // Runs the periodic jobs (ReapJobs); started last, stopped first.
  Housekeeper housekeeper_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_ENGINE_WEIGHT_SERVICE_H_
