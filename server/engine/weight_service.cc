#include "server/engine/weight_service.h"

#include <sys/stat.h>

#include <algorithm>
#include <tuple>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/log.h"
#include "common/untrusted_text.h"
#include "server/adapter/lora_patch.h"
#include "server/profile/name_summary.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

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
      committer_(options_.on_state_change, &mu_),
      staging_(StagingReserve::Options{
          .enabled = options_.publish_staging_ahead,
          .memory = &memory_,
          .still_loaded =
              [this](const std::string& name, uint64_t instance) {
                auto loaded = FindModel(name);
                return loaded.ok() && (*loaded)->instance == instance;
              }}),
      publish_(PublishService::Options{
          .memory = &memory_,
          .access = &access_,
          .staging = &staging_,
          .limits = {options_.max_publish_sessions, options_.max_publish_sessions_per_caller},
          .idle_timeout = options_.publish_idle_timeout,
          .find_model = [this](const std::string& name) { return FindModel(name); },
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
      {"prune_generations", [this] { PruneGenerations(); }},
      {"expire_publishes", [this] { publish_.Expire(); }},
      // A model that stopped publishing does not keep a staging for good.
      {"reclaim_staging", [this] { staging_.Reclaim(absl::Minutes(10)); }},
      {"materializer_sweep", [this] { materializer_.Sweep(); }},
  };
}

absl::Status WeightService::CheckCanRead(const std::string& model_name,
                                         const Principal& caller) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(model_name));
  return access_.CheckRead(caller, GuardsOf(*model, *model->current));
}

absl::Status WeightService::CheckLeaseUse(uint64_t lease_id, const Principal& caller) const {
  auto contents = leases_.Peek(lease_id);
  // An unknown lease is the use's own NOT_FOUND, after the token check.
  if (!contents.ok() || (*contents)->owner == nullptr) return absl::OkStatus();
  return access_.CheckLeaseUse(caller, lease_id, *(*contents)->owner);
}

ModelSummary WeightService::Summarize(const Model& model) {
  ModelSummary s;
  s.name = model.name;
  s.path = model.path;
  s.generation = model.current->number;
  s.tensor_count = model.served->size() + model.current->added.size();
  s.total_bytes = model.checkpoint->total_bytes();
  s.page_bytes = model.checkpoint->page_bytes();
  // Its own files (an identical copy it shares lists another's).
  s.files = model.files.empty() ? model.checkpoint->files() : model.files;
  for (const AdapterRef& r : model.current->stack) s.adapters.push_back(absl::StrCat(r.name, ":", r.strength));
  s.report = model.layout->report.Summary();
  s.readers = model.readers.ToStrings();
  s.guards = GuardsOf(model, *model.current);
  s.content = model.current->identity;
  return s;
}

absl::Status WeightService::CommitState(StateRecord& record,
                                       absl::FunctionRef<absl::Status()> check,
                                       absl::FunctionRef<void()> publish) {
  return committer_.Commit(record, check, publish);
}

absl::StatusOr<std::shared_ptr<const Model>> WeightService::FindModel(
    const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(absl::StrCat("model ", QuoteForMessage(name), " is not loaded"));
  }
  return it->second;
}

absl::StatusOr<ModelSummary> WeightService::LoadModel(const std::string& name,
                                                      const std::string& path,
                                                      const std::string& profile_json,
                                                      const LoadProgressFn& progress,
                                                      const std::vector<std::string>& readers,
                                                      LoadSource source) {
  return LoadModelImpl(name, path, profile_json, progress, readers, nullptr, source);
}

absl::StatusOr<ModelSummary> WeightService::RestoreLoadModel(
    const std::string& name, const std::string& path, const std::string& profile_json,
    const std::vector<std::string>& readers, const RestoreExpect& expect,
    const LoadProgressFn& progress) {
  return LoadModelImpl(name, path, profile_json, progress, readers, &expect);
}

namespace {

// The served layout of `checkpoint`: the profile's mapping, or identity.
absl::StatusOr<ServedLayout> LayoutOf(const Profile* profile, const Checkpoint& checkpoint) {
  std::vector<SourceTensorInfo> sources;
  for (const StoredTensor& t : checkpoint.tensors()) {
    sources.push_back(SourceTensorInfo{t.name, t.dtype, t.shape});
  }
  if (profile == nullptr) return Profile::Identity(sources);
  auto mapped = profile->Map(sources);
  if (!mapped.ok()) return Annotate(mapped.status(), "applying the profile");
  return *std::move(mapped);
}

// The served tensors of `layout`, their parts in `checkpoint`.
absl::StatusOr<std::shared_ptr<std::vector<Served>>> ServedOf(const Checkpoint& checkpoint,
                                                              const ServedLayout& layout) {
  auto served = std::make_shared<std::vector<Served>>();
  for (const ServedTensorPlan& plan : layout.tensors) {
    Served s;
    s.plan = plan;
    for (const ServedPart& part : plan.parts) {
      const StoredTensor* t = checkpoint.Find(part.source);
      if (t == nullptr) {
        return absl::InternalError(absl::StrCat("profile names unknown part ", part.source));
      }
      s.parts.push_back(t);
    }
    served->push_back(std::move(s));
  }
  return served;
}

}  // namespace

absl::StatusOr<ModelSummary> WeightService::LoadModelImpl(
    const std::string& name, const std::string& path, const std::string& profile_json,
    const LoadProgressFn& progress, const std::vector<std::string>& readers,
    const RestoreExpect* expect, LoadSource source) {
  WD_RETURN_IF_ERROR(ValidateModelName(name));
  WD_ASSIGN_OR_RETURN(ReaderList reader_list, ReaderList::Parse(readers));
  std::shared_ptr<const Profile> profile;
  if (!profile_json.empty()) {
    auto parsed = Profile::Parse(profile_json);
    if (!parsed.ok()) return Annotate(parsed.status(), "profile");
    profile = std::make_shared<const Profile>(std::move(*parsed));
  }
  if (expect != nullptr) WD_RETURN_IF_ERROR(CheckSourceObjects(expect->objects));
  {
    absl::MutexLock lock(&mu_);
    if (models_.contains(name) || loading_.contains(name)) {
      return absl::AlreadyExistsError(absl::StrCat("model \"", name, "\" is already loaded"));
    }
    loading_.insert(name);
  }
  absl::Time start = absl::Now();
  bool shared = false;  // the checkpoint is another model's (the same files)
  auto built = BuildModel(name, path, profile, reader_list, progress, source, &shared);
  if (built.ok() && expect != nullptr && (*built)->current->identity != expect->content) {
    built = absl::DataLossError(
        "its files changed since it was loaded (the served content differs); not served");
  }
  if (built.ok() && expect != nullptr) (*built)->generation_floor = expect->generation_floor;
  if (!built.ok()) {
    {
      absl::MutexLock lock(&mu_);
      loading_.erase(name);
    }
    LogEvent(LogLevel::kWarning, "load_failed",
             {{"model", name}, {"path", path}, {"error", built.status().ToString()}});
    return Annotate(built.status(), absl::StrCat("loading model \"", name, "\""));
  }
  ModelSummary summary = Summarize(**built);
  StateRecord record;
  record.kind = StateRecord::Kind::kModelLoad;
  record.name = name;
  record.path = path;
  record.profile_json = profile_json;
  record.readers = readers;
  record.generation = 1;
  if (LooksLikeUrl(path)) {
    // The objects this load opened, at the versions it read. A checkpoint
    // shared with another URL's identical bytes describes that URL's
    // objects: then this load's own are asked for again (a restore checks
    // the content identity as well, so a version that moved in between is
    // caught there).
    const Checkpoint& c = *(*built)->checkpoint;
    if (c.files() == (*built)->files) {
      for (const CheckpointFileInfo& f : c.file_info()) {
        record.objects.push_back({f.path, f.version, f.id.size});
      }
    } else {
      for (const std::string& url : (*built)->files) {
        absl::StatusOr<OpenedFile> now = files_.Open(url);
        if (now.ok()) {
          record.objects.push_back({url, now->version, static_cast<uint64_t>(now->st.st_size)});
        }
      }
    }
  }
  record.content = summary.content.Hex();
  // Nothing to check: the name is reserved in loading_.
  (void)CommitState(
      record, [] { return absl::OkStatus(); },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        loading_.erase(name);
        models_[name] = std::move(*built);
      });
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  loads_.fetch_add(1);
  if (!shared) {  // bytes read and the time it took: a shared load read nothing
    load_bytes_.fetch_add(summary.total_bytes);
    load_ns_.fetch_add(static_cast<uint64_t>(secs * 1e9));
  }
  LogEvent(LogLevel::kInfo, "load",
           {{"model", name},
            {"path", path},
            {"tensors", absl::StrCat(summary.tensor_count)},
            {"bytes", absl::StrCat(summary.total_bytes)},
            {"shared", shared ? "yes (its files were resident)" : "no"},
            {"seconds", absl::StrCat(secs)}});
  for (const std::string& line : summary.report) {
    LogEvent(LogLevel::kInfo, "load_report", {{"model", name}, {"line", line}});
  }
  return summary;
}

absl::StatusOr<std::shared_ptr<Model>> WeightService::BuildModel(
    const std::string& name, const std::string& path, std::shared_ptr<const Profile> profile,
    ReaderList readers, const LoadProgressFn& progress, LoadSource source, bool* shared) {
  std::unique_ptr<MemoryCharge> shared_charge;
  auto model = std::make_shared<Model>();
  model->name = name;
  model->instance = next_model_instance_.fetch_add(1);
  model->path = path;
  model->profile = profile;
  model->readers = std::move(readers);
  // Over the memory budget, the unleased materializations (casts, shards,
  // merges; rebuilt on demand) make room first: they are in the memory
  // manager's reclaimer chain.
  auto checkpoint = ReadCheckpoint(path, source, &shared_charge, progress, options_.donated,
                                   &model->files, /*share_held=*/true);
  if (!checkpoint.ok()) return checkpoint.status();
  model->checkpoint = std::move(*checkpoint);
  *shared = shared_charge != nullptr;
  model->metadata_charge = std::move(shared_charge);
  PinCheckpoint(name, *model->checkpoint);
  WD_ASSIGN_OR_RETURN(ServedLayout layout, LayoutOf(profile.get(), *model->checkpoint));
  WD_ASSIGN_OR_RETURN(auto served, ServedOf(*model->checkpoint, layout));
  model->served = std::move(served);
  model->layout = std::make_shared<const ServedLayout>(std::move(layout));
  WD_ASSIGN_OR_RETURN(auto gen, BuildGeneration(*model, 1, {}, {}));
  model->current = std::move(gen);
  model->history = {model->current};
  model->digests = {{1, model->current->content}};
  return model;
}

absl::Status WeightService::UnloadModel(const std::string& name) {
  std::shared_ptr<const Model> dropped;
  StateRecord unload_record;
  unload_record.kind = StateRecord::Kind::kModelUnload;
  unload_record.name = name;
  WD_RETURN_IF_ERROR(CommitState(
      unload_record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return models_.contains(name)
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("model ", QuoteForMessage(name), " is not loaded"));
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = models_.find(name);
        dropped = std::move(it->second);
        models_.erase(it);
        generation_changed_.SignalAll();
      }));
  for (const auto& g : dropped->history) materializer_.RetireTag(absl::StrCat(name, "#", g->number));
  publish_.EndSessionsOf(dropped->instance, absl::StrCat("model \"", name, "\" was unloaded"));
  if (published_store_ != nullptr) published_store_->Forget(name);
  dropped.reset();
  materializer_.Sweep();
  LogEvent(LogLevel::kInfo, "unload", {{"model", name}});
  return absl::OkStatus();
}

std::vector<ModelSummary> WeightService::ListModels() const {
  std::vector<ModelSummary> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, model] : models_) out.push_back(Summarize(*model));
  std::sort(out.begin(), out.end(),
            [](const ModelSummary& a, const ModelSummary& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<ModelDetail> WeightService::GetModel(const std::string& name) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(name));
  ModelDetail detail;
  detail.summary = Summarize(*model);
  const Generation& gen = *model->current;
  for (const Served* s : ServedAt(*model, gen)) {
    TensorSummary t;
    t.name = s->plan.name;
    t.dtype = s->plan.quantize_fp8 ? DType::kF8E4M3 : s->plan.dtype_override.value_or(s->plan.dtype);
    t.shape = s->plan.shape;
    auto c = gen.content->find(t.name);
    if (c != gen.content->end()) t.digest = c->second;
    for (const StoredTensor* p : s->parts) t.sources.push_back(p->name);
    auto by = gen.patched_by.find(t.name);
    if (by != gen.patched_by.end()) t.patched_by = by->second;
    detail.tensors.push_back(std::move(t));
  }
  return detail;
}

void WeightService::PinCheckpoint(const std::string& model, const Checkpoint& checkpoint) {
  pinner_.Pin(model, "checkpoint", checkpoint.host_segments());
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

absl::StatusOr<WeightService::VerifyResult> WeightService::Verify(const std::string& name) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(name));
  VerifyResult r;
  std::vector<std::string> bad;
  std::vector<const StoredTensor*> stored;
  for (const StoredTensor& t : model->checkpoint->tensors()) stored.push_back(&t);
  for (const auto& g : model->history) {
    if (g->published == nullptr) continue;
    for (const auto& [key, t] : *g->published) stored.push_back(t.get());
  }
  std::sort(stored.begin(), stored.end());
  stored.erase(std::unique(stored.begin(), stored.end()), stored.end());
  for (const StoredTensor* tp : stored) {
    const StoredTensor& t = *tp;
    if (t.buffer->kind() != MemoryKind::kHost) {
      return absl::UnimplementedError(absl::StrCat(
          "model \"", name, "\": tensor \"", t.name, "\" is in ",
          MemoryKindName(t.buffer->kind()), " memory; verify reads host memory only"));
    }
    if (DigestBytes(t.host_data(), t.length) != t.digest) bad.push_back(t.name);
    ++r.tensors;
    r.bytes += t.length;
  }
  if (!bad.empty()) {
    return absl::DataLossError(absl::StrCat("model \"", name, "\": ", bad.size(),
                                            " tensor(s) no longer match their digest: ",
                                            absl::StrJoin(SummarizeNames(bad), "; ")));
  }
  return r;
}

absl::Status WeightService::CheckSourceObjects(
    const std::vector<StateRecord::SourceObject>& objects) const {
  for (const StateRecord::SourceObject& o : objects) {
    absl::StatusOr<OpenedFile> now = files_.Open(o.url);
    if (!now.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "object ", QuoteForMessage(o.url), " cannot be checked against its journaled version: ",
          now.status().ToString()));
    }
    if (now->version != o.version || static_cast<uint64_t>(now->st.st_size) != o.size) {
      return absl::FailedPreconditionError(absl::StrCat(
          "object ", QuoteForMessage(o.url), " changed since it was loaded (ETag ", o.version,
          " -> ", now->version, ", size ", o.size, " -> ", now->st.st_size, "); not restored"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> WeightService::ReadCheckpoint(
    const std::string& path, LoadSource source, std::unique_ptr<MemoryCharge>* shared_charge,
    const LoadProgressFn& progress, DonatedCheckpoints* donated,
    std::vector<std::string>* opened_files, bool share_held) {
  CheckpointLoadOptions opts;
  opts.memory = &memory_;
  opts.segment_target_bytes = options_.checkpoint_segment_bytes;
  opts.read_threads = options_.worker_threads;
  opts.read_chunk_bytes = options_.read_chunk_bytes;
  if (LooksLikeUrl(path)) {  // ranged GETs: more of them in flight than disk reads
    opts.read_threads = options_.source_streams;
    opts.read_chunk_bytes = options_.source_chunk_bytes;
  }
  opts.progress = progress;
  opts.files = &files_;
  opts.resident = &resident_;
  opts.shared_charge = shared_charge;
  opts.donated = donated;
  opts.peers = options_.peers;
  opts.source = source;
  opts.peer_streams = options_.peer_streams;
  opts.peer_verify = options_.peer_verify;
  opts.opened_files = opened_files;
  if (share_held) {
    // A checkpoint is shared by every model that loads its files, whatever
    // their readers: only public holders' bytes may stand in its tensors.
    opts.find_held = [this](const Checkpoint& c) {
      std::vector<WantedBytes> wanted;
      wanted.reserve(c.tensors().size());
      for (const StoredTensor& t : c.tensors()) {
        wanted.push_back(WantedBytes{t.digest, t.host_data(), t.length});
      }
      return FindResidentCopies("", "", wanted, /*held=*/{});
    };
  }
  LoadSourceReport report;
  opts.report = &report;
  auto checkpoint = LoadCheckpoint(path, opts);
  CountLoadSources(report);
  return checkpoint;
}

void WeightService::CountLoadSources(const LoadSourceReport& report) {
  absl::MutexLock lock(&peer_counters_mu_);
  load_bytes_storage_ += report.storage_bytes;
  load_bytes_peers_ += report.peer_bytes;
  load_bytes_peers_discarded_ += report.peer_bytes_discarded;
  for (const auto& [peer, bytes] : report.by_peer) peer_transfers_[peer].bytes += bytes;
  for (const auto& [peer, n] : report.peer_failures) peer_transfers_[peer].failures += n;
}

}  // namespace weightd
