#include "server/service/weight_service.h"

#include <sys/stat.h>

#include <algorithm>
#include <tuple>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/untrusted_text.h"
#include "server/adapter/lora_patch.h"
#include "server/profile/name_summary.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"

namespace weightd {
namespace {

constexpr size_t kMaxModelName = 128;

// What an adapter loaded with peers keeps of its weights file (Adapter::
// fetched): the one-file checkpoint holding its bytes, and the budget
// charge of a shared copy.
using AdapterFileBytes =
    std::pair<std::shared_ptr<const Checkpoint>, std::shared_ptr<MemoryCharge>>;

absl::Status ValidateModelName(const std::string& name) {
  if (name.empty() || name.size() > kMaxModelName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model name must be 1 to ", kMaxModelName, " characters, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (!(std::isalnum(c) || c == '.' || c == '_' || c == '-' || c == '/' || c == ':')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model name \"", absl::CHexEscape(name),
          "\" may hold only letters, digits and . _ - / :"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

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
      publish_slots_({options_.max_publish_sessions, options_.max_publish_sessions_per_caller}),
      staging_(StagingReserve::Options{
          .enabled = options_.publish_staging_ahead,
          .memory = &memory_,
          .still_loaded =
              [this](const std::string& name, uint64_t instance) {
                auto loaded = FindModel(name);
                return loaded.ok() && (*loaded)->instance == instance;
              }}) {
  if (options_.state_dir != nullptr) {
    published_store_ = std::make_unique<PublishedStore>(options_.state_dir);
  }
  reaper_ = std::thread([this] { ReapLoop(); });
}

WeightService::~WeightService() {
  staging_.Stop();
  stop_.Notify();
  if (reaper_.joinable()) reaper_.join();
}

void WeightService::ReapLoop() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    size_t expired = leases_.Expire(absl::Now());
    if (expired > 0) {
      LogEvent(LogLevel::kInfo, "lease_expired", {{"count", absl::StrCat(expired)}});
    }
    PruneGenerations();
    ExpirePublishes();
    // A model that stopped publishing does not keep a staging for good.
    staging_.Reclaim(absl::Minutes(10));
    materializer_.Sweep();
  }
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

Digest WeightService::ContentIdentity(const ContentMap& content) {
  std::vector<std::pair<absl::string_view, const Digest*>> entries;
  entries.reserve(content.size());
  for (const auto& [name, digest] : content) entries.emplace_back(name, &digest);
  std::sort(entries.begin(), entries.end());
  DigestBuilder b;
  for (const auto& [name, digest] : entries) {
    const uint64_t n = name.size();
    b.Update(&n, sizeof(n));
    b.Update(name.data(), name.size());
    b.Update(digest->bytes.data(), digest->bytes.size());
  }
  return b.Finish();
}

absl::Status WeightService::CommitState(StateRecord& record,
                                       absl::FunctionRef<absl::Status()> check,
                                       absl::FunctionRef<void()> publish) {
  absl::MutexLock state(&state_mu_);
  {
    absl::MutexLock lock(&mu_);
    WD_RETURN_IF_ERROR(check());
  }
  record.seq = ++state_seq_;
  if (options_.on_state_change) options_.on_state_change(record);
  absl::MutexLock lock(&mu_);
  publish();
  return absl::OkStatus();
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

absl::StatusOr<std::shared_ptr<Generation>> WeightService::BuildGeneration(
    const Model& model, uint64_t number, const std::vector<AdapterRef>& stack,
    std::vector<std::shared_ptr<const Adapter>> adapters,
    std::shared_ptr<const PublishedBase> published) {
  auto gen = std::make_shared<Generation>();
  gen->number = number;
  gen->stack = stack;
  gen->served = model.served;
  if (published != nullptr && !published->empty()) {
    // The published parts in place of the checkpoint's; an allow_new
    // tensor published becomes a one-part tensor of its own bytes.
    auto served = std::make_shared<std::vector<Served>>(*model.served);
    for (Served& s : *served) {
      if (s.parts.empty()) {
        auto it = published->find(s.plan.name);
        if (it == published->end()) continue;
        s.parts = {it->second.get()};
        s.plan.parts = {ServedPart{s.plan.name}};
        s.plan.part_rows = {s.plan.shape.empty() ? 1 : s.plan.shape[0]};
        continue;
      }
      for (const StoredTensor*& p : s.parts) {
        auto it = published->find(p->name);
        if (it != published->end()) p = it->second.get();
      }
    }
    gen->served = std::move(served);
    gen->published = std::move(published);
  }
  // Where each checkpoint name and single-part served name lands.
  absl::flat_hash_map<std::string, std::pair<const Served*, const StoredTensor*>> by_name;
  for (const Served& s : *gen->served) {
    for (const StoredTensor* p : s.parts) by_name.emplace(p->name, std::make_pair(&s, p));
    if (s.parts.size() == 1) by_name.emplace(s.plan.name, std::make_pair(&s, s.parts[0]));
  }
  std::vector<std::string> base_names;
  for (const StoredTensor& t : model.checkpoint->tensors()) base_names.push_back(t.name);
  absl::flat_hash_map<std::string, size_t> added_index;
  for (size_t a = 0; a < stack.size(); ++a) {
    const AdapterRef& ref = stack[a];
    const Adapter& adapter = *adapters[a];
    if (!std::isfinite(ref.strength)) {
      return absl::InvalidArgumentError(absl::StrCat("adapter \"", ref.name,
                                                     "\": strength must be finite"));
    }
    for (const AdapterEntry& entry : adapter.entries) {
      std::string target = entry.target;
      if (entry.needs_kohya_resolution) {
        auto resolved = ResolveKohyaTarget(target, base_names);
        if (!resolved.ok()) {
          // Like any target the model lacks: the request does not fit the
          // model (NOT_FOUND would read as "adapter not loaded").
          return absl::InvalidArgumentError(absl::StrCat(
              "adapter \"", ref.name, "\": ", resolved.status().message()));
        }
        target = *resolved;
      }
      std::vector<int64_t> want = entry.patch->shape();
      auto it = by_name.find(target);
      std::string key;
      std::string served_name;
      if (it != by_name.end()) {
        const StoredTensor* part = it->second.second;
        if (want != part->shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              "adapter \"", ref.name, "\": patch for \"", target, "\" has shape ",
              ShapeString(want), " but the parameter is ", ShapeString(part->shape)));
        }
        if (!IsFloating(part->dtype)) {
          return absl::InvalidArgumentError(absl::StrCat("adapter \"", ref.name, "\": \"", target,
                                                         "\" is not a floating tensor"));
        }
        key = part->name;
        served_name = it->second.first->plan.name;
      } else if (entry.patch->kind() == TensorPatch::Kind::kReplace) {
        // .set_weight may add a parameter the checkpoint lacks.
        auto [ai, inserted] = added_index.try_emplace(target, gen->added.size());
        if (inserted) {
          Served s;
          s.plan.name = target;
          s.plan.dtype = DType::kF32;
          s.plan.shape = want;
          s.plan.part_rows = {want.empty() ? 1 : want[0]};
          gen->added.push_back(std::move(s));
        } else if (gen->added[ai->second].plan.shape != want) {
          return absl::InvalidArgumentError(absl::StrCat("adapters disagree on the shape of new "
                                                         "parameter \"", target, "\""));
        }
        key = target;
        served_name = target;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "adapter \"", ref.name, "\" patches \"", target, "\", which model \"", model.name,
            "\" does not have"));
      }
      gen->patches[key].push_back(AppliedPatch{entry.patch, ref.strength});
      auto& by = gen->patched_by[served_name];
      if (by.empty() || by.back() != ref.name) by.push_back(ref.name);
    }
  }
  gen->adapters = std::move(adapters);
  // Content identity per served tensor, for --changed-since.
  auto content = std::make_shared<ContentMap>();
  for (const Served* s : ServedAt(model, *gen)) {
    DigestBuilder b;
    for (const StoredTensor* p : s->parts) b.Update(p->digest.bytes.data(), 16);
    std::vector<std::string> keys;
    for (const StoredTensor* p : s->parts) keys.push_back(p->name);
    if (s->parts.empty()) keys.push_back(s->plan.name);
    for (const std::string& k : keys) {
      auto pit = gen->patches.find(k);
      if (pit == gen->patches.end()) continue;
      for (const AppliedPatch& ap : pit->second) {
        std::string ck = ap.patch->CacheKey();
        b.Update(ck.data(), ck.size());
        b.Update(&ap.strength, sizeof(float));
      }
    }
    (*content)[s->plan.name] = b.Finish();
  }
  gen->identity = ContentIdentity(*content);
  gen->content = std::move(content);
  return gen;
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
  // Opened (and confined to the model roots) by LoadCheckpoint, file by file.
  const std::string& resolved = path;
  {
    absl::MutexLock lock(&mu_);
    if (models_.contains(name) || loading_.contains(name)) {
      return absl::AlreadyExistsError(absl::StrCat("model \"", name, "\" is already loaded"));
    }
    loading_.insert(name);
  }
  absl::Time start = absl::Now();
  bool shared = false;  // the checkpoint is another model's (the same files)
  auto build = [&]() -> absl::StatusOr<std::shared_ptr<Model>> {
    std::unique_ptr<MemoryCharge> shared_charge;
    auto model = std::make_shared<Model>();
    model->name = name;
    model->instance = next_model_instance_.fetch_add(1);
    model->path = resolved;
    model->profile = profile;
    model->readers = reader_list;
    // Over the memory budget, the unleased materializations (casts, shards,
    // merges; rebuilt on demand) make room first: they are in the memory
    // manager's reclaimer chain.
    auto checkpoint = ReadCheckpoint(resolved, source, &shared_charge, progress, options_.donated,
                                     &model->files, /*share_held=*/true);
    if (!checkpoint.ok()) return checkpoint.status();
    model->checkpoint = std::move(*checkpoint);
    shared = shared_charge != nullptr;
    model->metadata_charge = std::move(shared_charge);
    PinCheckpoint(name, *model->checkpoint);
    std::vector<SourceTensorInfo> sources;
    for (const StoredTensor& t : model->checkpoint->tensors()) {
      sources.push_back(SourceTensorInfo{t.name, t.dtype, t.shape});
    }
    ServedLayout layout;
    if (profile != nullptr) {
      auto mapped = profile->Map(sources);
      if (!mapped.ok()) return Annotate(mapped.status(), "applying the profile");
      layout = std::move(*mapped);
    } else {
      layout = Profile::Identity(sources);
    }
    auto served = std::make_shared<std::vector<Served>>();
    for (const ServedTensorPlan& plan : layout.tensors) {
      Served s;
      s.plan = plan;
      for (const ServedPart& part : plan.parts) {
        const StoredTensor* t = model->checkpoint->Find(part.source);
        if (t == nullptr) {
          return absl::InternalError(absl::StrCat("profile names unknown part ", part.source));
        }
        s.parts.push_back(t);
      }
      served->push_back(std::move(s));
    }
    model->served = std::move(served);
    model->layout = std::make_shared<const ServedLayout>(std::move(layout));
    WD_ASSIGN_OR_RETURN(auto gen, BuildGeneration(*model, 1, {}, {}));
    model->current = std::move(gen);
    model->history = {model->current};
    model->digests = {{1, model->current->content}};
    return model;
  };
  auto built = build();
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
            {"path", resolved},
            {"tensors", absl::StrCat(summary.tensor_count)},
            {"bytes", absl::StrCat(summary.total_bytes)},
            {"shared", shared ? "yes (its files were resident)" : "no"},
            {"seconds", absl::StrCat(secs)}});
  for (const std::string& line : summary.report) {
    LogEvent(LogLevel::kInfo, "load_report", {{"model", name}, {"line", line}});
  }
  return summary;
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
  EndPublishesOf(dropped->instance, absl::StrCat("model \"", name, "\" was unloaded"));
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

absl::StatusOr<float> WeightService::Fp8Scale(const Served& served, const Generation& gen) {
  {
    absl::MutexLock lock(&gen.scale_mu);
    auto it = gen.fp8_scales.find(served.plan.name);
    if (it != gen.fp8_scales.end()) return it->second;
  }
  std::vector<PartSlice> slices;
  for (const StoredTensor* p : served.parts) {
    PartSlice s;
    s.stored = p;
    s.dtype = p->dtype;
    s.shape = p->shape;
    s.box.offset.assign(p->shape.size(), 0);
    s.box.shape = p->shape;
    auto pit = gen.patches.find(p->name);
    if (pit != gen.patches.end()) s.patches = pit->second;
    slices.push_back(std::move(s));
  }
  WD_ASSIGN_OR_RETURN(float amax, AbsMax(slices));
  // amax / 448 (DESIGN §4); an all-zero tensor gets scale 1 so that x / scale
  // stays defined.
  float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
  absl::MutexLock lock(&gen.scale_mu);
  gen.fp8_scales[served.plan.name] = scale;
  return scale;
}

void WeightService::RecordFetch(const FetchParams& params, bool ok, absl::Time start) {
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  if (!ok) {
    fetch_errors_.fetch_add(1);
  } else if (params.transport == TransportKind::kGrpc) {
    fetch_latency_grpc_.Record(secs);
  } else {
    fetch_latency_shm_.Record(secs);
  }
}

std::shared_ptr<const Generation> WeightService::GenerationOf(const Model& model,
                                                                             uint64_t number) {
  if (number == 0) return model.current;
  for (const auto& g : model.history) {
    if (g->number == number) return g;
  }
  return nullptr;
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

absl::StatusOr<FetchResult> WeightService::Fetch(const FetchParams& params) {
  absl::Time start = absl::Now();
  auto result = FetchImpl(params);
  RecordFetch(params, result.ok(), start);
  return result;
}

absl::StatusOr<FetchResult> WeightService::FetchImpl(const FetchParams& params) {
  if (params.transport == TransportKind::kCuda) {
    return absl::UnimplementedError("the cuda transport is not built into this daemon");
  }
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(params.model));
  // Nothing about a model, not even its current generation, is said to a
  // caller who may not read it.
  if (params.caller.has_value()) {
    WD_RETURN_IF_ERROR(access_.CheckRead(*params.caller, ModelGuards(*model)));
  }
  std::shared_ptr<const Generation> gen = GenerationOf(*model, params.generation);
  if (gen == nullptr) {
    return absl::NotFoundError(absl::StrCat("generation ", params.generation, " of model \"",
                                            params.model, "\" is not available (current is ",
                                            model->current->number, ")"));
  }
  // A request served before on this generation: its table, if its segments
  // still live. The readers are checked on the generation actually served,
  // so an apply racing with the fetch cannot hand out a private generation.
  std::string cache_key = FetchCacheKey(params, gen->number);
  if (auto cached = FetchFromCache(params, cache_key, gen); cached.has_value()) {
    return *std::move(cached);
  }
  std::vector<ReadGuard> guards = GuardsOf(*model, *gen);
  if (params.caller.has_value()) {
    WD_RETURN_IF_ERROR(access_.CheckRead(*params.caller, guards));
  }
  std::shared_ptr<const ContentMap> since;
  if (params.changed_since != 0) {
    for (const auto& [number, content] : model->digests) {
      if (number == params.changed_since) since = content;
    }
    if (since == nullptr) {
      return absl::NotFoundError(absl::StrCat("generation ", params.changed_since, " of model \"",
                                              params.model, "\" is unknown (current is ",
                                              model->current->number, ")"));
    }
  }
  WD_RETURN_IF_ERROR(params.mesh.Validate());
  FetchPlanOptions plan_options;
  plan_options.mesh = params.mesh;
  WD_ASSIGN_OR_RETURN(
      plan_options.defaults,
      ResolveDefaultPlacements(params.mesh, params.placements,
                               model->profile != nullptr ? model->profile->default_placements()
                                                         : std::nullopt));
  plan_options.dtype = params.dtype;

  // Select the served tensors: by name, then what changed since.
  std::vector<const Served*> all = ServedAt(*model, *gen);
  std::vector<std::string> all_names;
  all_names.reserve(all.size());
  for (const Served* s : all) all_names.push_back(s->plan.name);
  WD_ASSIGN_OR_RETURN(std::vector<size_t> picked,
                      SelectByName(all_names, params.names, params.model));
  std::vector<const Served*> selected;
  for (size_t i : picked) {
    const Served* s = all[i];
    if (since != nullptr) {
      auto now = gen->content->find(s->plan.name);
      auto then = since->find(s->plan.name);
      if (then != since->end() && now != gen->content->end() && now->second == then->second) {
        continue;
      }
    }
    selected.push_back(s);
  }

  std::vector<PlannedTensor> planned;
  planned.reserve(selected.size());
  for (const Served* s : selected) planned.push_back(PlannedTensor{&s->plan, s->parts});
  plan_options.patches = [&gen](const std::string& key) {
    auto it = gen->patches.find(key);
    return it == gen->patches.end() ? std::vector<AppliedPatch>() : it->second;
  };
  plan_options.fp8_scale = [&](size_t index) { return Fp8Scale(*selected[index], *gen); };
  WD_ASSIGN_OR_RETURN(FetchPlan plan, PlanFetch(planned, plan_options));
  std::vector<MaterializeItem>& items = plan.items;
  std::vector<FetchedTensor>& tables = plan.tensors;
  // A lease for a push: a plain view but for its dtype is leased as its
  // stored bytes, cast by the push (the output dtype kept here).
  // With defer_merges, so is a patched tensor the push can merge element by
  // element (its patches then go with the lease, not into the item).
  std::vector<std::optional<DType>> cast_on_push(items.size());
  std::vector<std::shared_ptr<const PushMerge>> merge_on_push(items.size());
  if (params.defer_casts) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (params.defer_merges) merge_on_push[i] = MergeOnPush(items[i]);
      if (merge_on_push[i] == nullptr && !IsCastOfView(items[i])) continue;
      cast_on_push[i] = items[i].out_dtype;
      items[i].out_dtype = items[i].slices[0].stored->dtype;
      items[i].slices[0].patches.clear();
    }
  }
  WD_ASSIGN_OR_RETURN(std::vector<MaterializedTensor> served,
                      materializer_.Materialize(items, absl::StrCat(params.model, "#", gen->number),
                                                  ReadScope(guards)));

  auto table = std::make_shared<FetchTable>();
  table->generation = gen->number;
  table->weights_id = gen->identity.Hex();
  table->data_socket = options_.data_socket_path;
  table->data_socket_name = options_.data_socket_name;
  std::vector<BufferPtr> buffers;
  absl::flat_hash_map<uint64_t, uint32_t> segment_index;
  auto ranges = std::make_shared<std::vector<LeaseTensor>>();
  ranges->reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const MaterializedTensor& m = served[i];
    auto [it, inserted] = segment_index.try_emplace(m.buffer->id(), buffers.size());
    if (inserted) {
      buffers.push_back(m.buffer);
      table->segment_sizes.push_back(m.buffer->size());
    }
    FetchedTensor& ft = tables[i];
    ft.segment = it->second;
    ft.offset = m.offset;
    LeaseTensor range{ft.segment, ft.offset, m.length};
    if (cast_on_push[i].has_value()) {
      range.cast = true;
      range.src_dtype = items[i].out_dtype;
      range.dst_dtype = *cast_on_push[i];
      range.merge = merge_on_push[i];
      ft.cast_on_push = true;
    } else {
      ft.digest = m.digest;
    }
    ft.length = PushLength(range);
    ranges->push_back(range);
    table->bytes += ft.length;
    table->tensors.push_back(std::move(ft));
  }
  table->ranges = std::move(ranges);
  // A table whose ranges carry merges holds their patches: not kept by the
  // cache, which must never hold memory past its generation (its entries
  // are dropped only when next looked at).
  const bool holds_patches =
      std::any_of(merge_on_push.begin(), merge_on_push.end(),
                  [](const std::shared_ptr<const PushMerge>& m) { return m != nullptr; });
  if (!holds_patches) fetch_cache_.Store(std::move(cache_key), gen, table, buffers, guards);
  return GrantFetch(params, *gen, std::move(table), std::move(buffers), std::move(guards));
}

std::optional<absl::StatusOr<FetchResult>> WeightService::FetchFromCache(
    const FetchParams& params, const std::string& key,
    const std::shared_ptr<const Generation>& gen) {
  std::optional<FetchTableCache::Hit> hit = fetch_cache_.Lookup(key, gen);
  if (!hit.has_value()) return std::nullopt;
  if (params.caller.has_value()) {
    if (absl::Status s = access_.CheckRead(*params.caller, hit->guards); !s.ok()) return s;
  }
  return GrantFetch(params, *gen, std::move(hit->table), std::move(hit->buffers),
                    std::move(hit->guards));
}

std::optional<absl::StatusOr<FetchResult>> WeightService::TryFetchCached(
    const FetchParams& params) {
  if (params.transport == TransportKind::kCuda) return std::nullopt;
  absl::Time start = absl::Now();
  auto model = FindModel(params.model);
  if (!model.ok()) return std::nullopt;  // Fetch gives the error
  std::shared_ptr<const Generation> gen = GenerationOf(**model, params.generation);
  if (gen == nullptr) return std::nullopt;
  auto result = FetchFromCache(params, FetchCacheKey(params, gen->number), gen);
  if (!result.has_value()) return std::nullopt;
  RecordFetch(params, result->ok(), start);
  return result;
}

std::string WeightService::FetchCacheKey(const FetchParams& params, uint64_t generation) {
  // Length-prefixed, so no two requests share a key.
  std::string key;
  auto put = [&key](uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  auto put_str = [&](absl::string_view v) {
    put(v.size());
    key.append(v.data(), v.size());
  };
  put_str(params.model);
  put(generation);
  put(params.mesh.shape.size());
  for (int64_t d : params.mesh.shape) put(static_cast<uint64_t>(d));
  put(params.mesh.coord.size());
  for (int64_t c : params.mesh.coord) put(static_cast<uint64_t>(c));
  if (params.placements.has_value()) {
    put(params.placements->size());
    for (const Placement& p : *params.placements) put(static_cast<uint64_t>(p.shard_dim));
  } else {
    put(~uint64_t{0});
  }
  put(params.dtype.has_value() ? static_cast<uint64_t>(*params.dtype) : ~uint64_t{0});
  put(params.changed_since);
  put((params.defer_casts ? 1 : 0) | (params.defer_merges ? 2 : 0));
  put(params.names.size());
  for (const std::string& n : params.names) put_str(n);
  return key;
}

FetchResult WeightService::GrantFetch(const FetchParams& params, const Generation& gen,
                                      std::shared_ptr<const FetchTable> table,
                                      std::vector<BufferPtr> buffers,
                                      std::vector<ReadGuard> guards) {
  FetchResult result;
  LeaseContents lease;
  lease.model = params.model;
  lease.generation = table->generation;
  lease.hold = gen.lease_marker;
  lease.buffers = std::move(buffers);
  lease.bytes = table->bytes;
  lease.tensors = table->ranges;
  lease.push_only = params.defer_casts;
  if (params.caller.has_value()) {
    lease.owner = std::make_shared<const LeaseOwner>(LeaseOwner{*params.caller, std::move(guards)});
  }
  bytes_served_.fetch_add(table->bytes);
  fetches_.fetch_add(1);
  result.lease = leases_.Grant(std::move(lease));
  if (LogEnabled(LogLevel::kDebug)) {
    LogEvent(LogLevel::kDebug, "lease_grant",
             {{"lease", absl::StrCat(result.lease.id)}, {"model", params.model},
              {"generation", absl::StrCat(table->generation)},
              {"tensors", absl::StrCat(table->tensors.size())},
              {"bytes", absl::StrCat(table->bytes)}});
  }
  result.table = std::move(table);
  return result;
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

absl::StatusOr<AdapterSummary> WeightService::LoadAdapter(const std::string& name,
                                                          const std::string& path,
                                                          const std::string& format,
                                                          bool strict,
                                                          const std::vector<std::string>& readers,
                                                          LoadSource source) {
  WD_RETURN_IF_ERROR(ValidateModelName(name));
  WD_ASSIGN_OR_RETURN(ReaderList reader_list, ReaderList::Parse(readers));
  WD_ASSIGN_OR_RETURN(AdapterFormat fmt, ParseAdapterFormat(format.empty() ? "auto" : format));
  const std::string& resolved = path;
  {
    absl::MutexLock lock(&mu_);
    if (adapters_.contains(name)) {
      return absl::AlreadyExistsError(absl::StrCat("adapter \"", name, "\" is already loaded"));
    }
  }
  if (source == LoadSource::kPeers && options_.peers == nullptr) {
    return absl::FailedPreconditionError(
        "--source peers: this daemon has no peers (--peers, --peer-dns)");
  }
  AdapterLoadOptions load;
  load.files = &roots_;
  // The patches' fp32 factors count against --host-memory-bytes for as long
  // as the adapter lives (loaded, or kept by a generation that applied it).
  load.reserve = [this, &name](uint64_t bytes) -> absl::StatusOr<std::shared_ptr<const void>> {
    const std::string what = absl::StrCat("adapter \"", name, "\"");
    auto charge = memory_.Charge(bytes, what);
    if (!charge.ok()) return charge.status();
    return std::shared_ptr<const void>(std::move(*charge));
  };
  if (options_.peers != nullptr) {
    load.fetch = [this, source](const std::string& file, absl::string_view header)
        -> absl::StatusOr<AdapterLoadOptions::FetchedBytes> {
      std::unique_ptr<MemoryCharge> shared_charge;
      auto checkpoint = ReadCheckpoint(file, source, &shared_charge);
      if (!checkpoint.ok()) return checkpoint.status();
      const std::shared_ptr<const Checkpoint>& c = *checkpoint;
      if (c->bytes_held_elsewhere() > 0) {
        // Resident as a checkpoint whose tensors share other holders' bytes
        // (ShareHeldTensors): its data section is not held whole, so the
        // adapter reads the file itself (not with --source peers).
        if (source == LoadSource::kPeers) {
          return absl::FailedPreconditionError(absl::StrCat(
              file, " is resident here as a model's checkpoint that shares tensors with other "
                    "models, not as whole files; load the adapter with --source auto or storage"));
        }
        return AdapterLoadOptions::FetchedBytes{};
      }
      if (c->file_info().size() != 1 ||
          c->file_info()[0].id.header != DigestBytes(header.data(), header.size())) {
        return absl::DataLossError(absl::StrCat(file, " changed while it was being loaded"));
      }
      const CheckpointFileInfo& f = c->file_info()[0];
      AdapterLoadOptions::FetchedBytes out;
      out.data = c->host_segments().empty()
                     ? nullptr
                     : c->host_segments()[f.segment]->host_data() + f.segment_offset;
      out.length = f.data_length;
      out.keep = std::make_shared<AdapterFileBytes>(
          c, std::shared_ptr<MemoryCharge>(std::move(shared_charge)));
      return out;
    };
  }
  auto adapter = ::weightd::LoadAdapter(resolved, fmt, load);
  if (!adapter.ok()) return Annotate(adapter.status(), absl::StrCat("loading adapter \"", name, "\""));
  AdapterSummary info;
  info.name = name;
  info.path = resolved;
  info.format = std::string(AdapterFormatName((*adapter)->format));
  info.tensor_count = (*adapter)->entries.size();
  info.bytes = (*adapter)->bytes;
  info.ignored = SummarizeNames((*adapter)->ignored_keys);
  info.readers = reader_list.ToStrings();
  if (strict && !(*adapter)->ignored_keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter \"", name, "\": ", (*adapter)->ignored_keys.size(), " keys not understood: ",
        absl::StrJoin(info.ignored, "; ")));
  }
  StateRecord record;
  record.kind = StateRecord::Kind::kAdapterLoad;
  record.name = name;
  record.path = path;
  record.readers = readers;
  record.format = format;
  record.strict = strict;
  WD_RETURN_IF_ERROR(CommitState(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return adapters_.contains(name)
                   ? absl::AlreadyExistsError(
                         absl::StrCat("adapter \"", name, "\" is already loaded"))
                   : absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        adapters_.emplace(name, *adapter);
        adapter_seq_[name] = record.seq;
        adapter_info_[name] = info;
        adapter_readers_[name] = std::move(reader_list);
      }));
  LogEvent(LogLevel::kInfo, "adapter_load",
           {{"adapter", name}, {"path", resolved}, {"format", info.format},
            {"targets", absl::StrCat(info.tensor_count)},
            {"ignored", absl::StrCat((*adapter)->ignored_keys.size())}});
  return info;
}

absl::Status WeightService::UnloadAdapter(const std::string& name) {
  StateRecord record;
  record.kind = StateRecord::Kind::kAdapterUnload;
  record.name = name;
  WD_RETURN_IF_ERROR(CommitState(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return adapters_.contains(name)
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("adapter ", QuoteForMessage(name), " is not loaded"));
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        adapters_.erase(name);
        adapter_seq_.erase(name);
        adapter_info_.erase(name);
        adapter_readers_.erase(name);
      }));
  LogEvent(LogLevel::kInfo, "adapter_unload", {{"adapter", name}});
  return absl::OkStatus();
}

std::vector<AdapterSummary> WeightService::ListAdapters() const {
  std::vector<AdapterSummary> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, info] : adapter_info_) out.push_back(info);
  std::sort(out.begin(), out.end(),
            [](const AdapterSummary& a, const AdapterSummary& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<GenerationInfo> WeightService::Apply(const std::string& model_name,
                                                    const std::vector<AdapterRef>& stack,
                                                    uint64_t expect_generation) {
  return ApplyImpl(model_name, stack, expect_generation, 0, nullptr);
}

absl::StatusOr<GenerationInfo> WeightService::RestoreApply(const std::string& model_name,
                                                           const std::vector<AdapterRef>& stack,
                                                           uint64_t number,
                                                           const Digest& expect_content) {
  return ApplyImpl(model_name, stack, 0, number, &expect_content);
}

absl::StatusOr<std::shared_ptr<const StoredTensor>> WeightService::ChargedPublished(
    StoredTensor t) {
  struct Charged {
    StoredTensor tensor;
    std::unique_ptr<MemoryCharge> charge;
  };
  WD_ASSIGN_OR_RETURN(std::unique_ptr<MemoryCharge> charge,
                      memory_.Charge(TensorMetadataBytes(t.name, t.shape.size()),
                                     absl::StrCat("metadata of published tensor \"", t.name, "\"")));
  auto held = std::make_shared<Charged>(Charged{std::move(t), std::move(charge)});
  return std::shared_ptr<const StoredTensor>(held, &held->tensor);
}

absl::StatusOr<GenerationInfo> WeightService::RestorePublish(const std::string& model_name,
                                                             const std::string& file_name,
                                                             const std::vector<AdapterRef>& stack,
                                                             uint64_t number,
                                                             const Digest& expect_content) {
  if (file_name.empty()) {
    return absl::NotFoundError("its weights were not saved (no --state-dir when it was published)");
  }
  if (published_store_ == nullptr) {
    return absl::FailedPreconditionError("published weights are restored with --state-dir only");
  }
  WD_ASSIGN_OR_RETURN(const std::string path, published_store_->PathOf(file_name));
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindModel(model_name));
  CheckpointLoadOptions load;
  load.memory = &memory_;
  load.read_threads = std::max(1, options_.worker_threads);
  // Read relative to the state directory, never through a link.
  auto reader = published_store_->Reader();
  if (reader.ok()) load.files = reader->get();
  auto file = reader.ok() ? LoadCheckpoint(path, load)
                          : absl::StatusOr<std::shared_ptr<const Checkpoint>>(reader.status());
  if (!file.ok()) {
    if (absl::IsNotFound(file.status())) {
      return absl::NotFoundError(absl::StrCat(
          "its weights were not saved before the daemon stopped (", path, " is missing)"));
    }
    return file.status();
  }
  // Each saved tensor must stand where the model keeps one: a checkpoint
  // part, or a profile's allow_new tensor, with its dtype and shape.
  absl::flat_hash_map<absl::string_view, const ServedTensorPlan*> new_tensors;
  for (const Served& s : *model->served) {
    if (s.parts.empty()) new_tensors.emplace(s.plan.name, &s.plan);
  }
  // Bytes another model holds already (the same publish sent to it and
  // restored before this one) are shared again, as at the publish; the rest
  // moves to a segment of its size when that frees over 1/8 of the file's.
  const std::vector<StoredTensor>& saved = (*file)->tensors();
  std::vector<std::optional<ResidentCopy>> copies(saved.size());
  std::vector<uint64_t> packed_at(saved.size(), 0);
  SegmentPtr packed;
  uint64_t bytes_shared = 0;
  {
    std::vector<WantedBytes> wanted;
    uint64_t total = 0;
    for (const StoredTensor& t : saved) {
      if (t.host_data() == nullptr) return absl::InternalError("a restored tensor is not in host memory");
      wanted.push_back(WantedBytes{t.digest, t.host_data(), t.length});
      total += t.length;
    }
    absl::flat_hash_set<uint64_t> held;
    for (const StoredTensor& t : model->checkpoint->tensors()) {
      if (t.buffer != nullptr) held.insert(t.buffer->id());
    }
    copies = FindResidentCopies(model->name, ReadScope(ModelGuards(*model)), wanted, held);
    uint64_t rest = 0;
    size_t rest_count = 0;  // tensors to keep (some may be empty)
    bool any_shared = false;
    for (size_t i = 0; i < saved.size(); ++i) {
      if (copies[i].has_value()) {
        any_shared = true;
      } else {
        packed_at[i] = rest;
        rest += (saved[i].length + 63) / 64 * 64;
        ++rest_count;
      }
    }
    if (any_shared && rest_count > 0 && rest + total / 8 < total) {
      HostMemoryManager::AllocateOptions alloc;
      alloc.purpose = "publish";
      alloc.prefault = false;  // the copy faults the pages in (as CommitStaged's)
      auto segment = memory_.Allocate(std::max<uint64_t>(rest, 64), alloc);
      if (segment.ok()) {
        std::vector<CopyRun> runs;
        for (size_t i = 0; i < saved.size(); ++i) {
          if (copies[i].has_value()) continue;
          runs.push_back(CopyRun{(*segment)->mutable_data() + packed_at[i], saved[i].host_data(),
                                 saved[i].length});
        }
        if (ParallelCopy(runs, options_.worker_threads).ok() &&
            (*segment)->Seal(/*populate=*/false).ok()) {
          packed = SegmentPtr(std::move(*segment));
        }
      }
      // No room for the copy: the file's segments are kept as they are.
    }
    if (packed == nullptr) {
      // A file segment kept for an unshared tensor holds its neighbours'
      // bytes too: sharing those from a segment this model would not hold
      // otherwise saves nothing and keeps that segment alive.
      // Dropping some copies can leave a holder segment with less than
      // half of it taken (FindResidentCopies' rule), which frees more of
      // the file's: repeated until nothing changes.
      for (bool changed = true; changed;) {
        changed = false;
        absl::flat_hash_set<uint64_t> kept_segments;
        for (size_t i = 0; i < saved.size(); ++i) {
          if (!copies[i].has_value()) kept_segments.insert(saved[i].buffer->id());
        }
        for (size_t i = 0; i < saved.size(); ++i) {
          if (copies[i].has_value() && !held.contains(copies[i]->buffer->id()) &&
              kept_segments.contains(saved[i].buffer->id())) {
            copies[i].reset();
            changed = true;
          }
        }
        if (DropCopiesUnderHalf(copies, wanted, held)) changed = true;
      }
    }
    for (size_t i = 0; i < saved.size(); ++i) {
      if (copies[i].has_value()) bytes_shared += saved[i].length;
    }
  }
  auto published = std::make_shared<PublishedBase>();
  for (size_t i = 0; i < saved.size(); ++i) {
    const StoredTensor& t = saved[i];
    DType dtype;
    std::vector<int64_t> shape;
    if (const StoredTensor* original = model->checkpoint->Find(t.name)) {
      dtype = original->dtype;
      shape = original->shape;
    } else if (auto it = new_tensors.find(t.name); it != new_tensors.end()) {
      dtype = it->second->dtype;
      shape = it->second->shape;
    } else {
      return absl::DataLossError(absl::StrCat(path, " holds tensor \"", t.name,
                                              "\", which model \"", model_name, "\" does not have"));
    }
    if (t.dtype != dtype || t.shape != shape) {
      return absl::DataLossError(absl::StrCat(path, ": tensor \"", t.name, "\" is ",
                                              DTypeName(t.dtype), " ", ShapeString(t.shape),
                                              "; the model stores ", DTypeName(dtype), " ",
                                              ShapeString(shape)));
    }
    StoredTensor kept = t;  // shares the file's segments
    kept.file = absl::StrCat("(published, restored from ", path, ")");
    if (copies[i].has_value()) {
      kept.buffer = copies[i]->buffer;
      kept.offset = copies[i]->offset;
      absl::StrAppend(&kept.file, "; bytes shared with model \"", copies[i]->holder, "\"");
    } else if (packed != nullptr) {
      kept.buffer = packed;
      kept.offset = packed_at[i];
    }
    WD_ASSIGN_OR_RETURN((*published)[t.name], ChargedPublished(std::move(kept)));
  }
  PinPublished(model_name, published.get());
  RestoredPublish restored{std::move(published), file_name, bytes_shared};
  return ApplyImpl(model_name, stack, 0, number, &expect_content, &restored);
}

absl::Status WeightService::SetGenerationFloor(const std::string& model_name, uint64_t floor) {
  StateRecord record;
  record.kind = StateRecord::Kind::kFloor;
  record.name = model_name;
  return CommitState(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = models_.find(model_name);
        if (it == models_.end()) {
          return absl::NotFoundError(
              absl::StrCat("model ", QuoteForMessage(model_name), " is not loaded"));
        }
        // One past the largest number: no generation left (never wraps).
        if (floor > kMaxGeneration + 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "generation floor ", floor, " for model ", QuoteForMessage(model_name),
              " is past the largest generation number a model may have (", kMaxGeneration,
              ")"));
        }
        record.generation = std::max(it->second->generation_floor, floor);
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = models_.find(model_name);
        auto next = std::make_shared<Model>(*it->second);
        next->generation_floor = record.generation;
        it->second = std::move(next);
      });
}

absl::StatusOr<GenerationInfo> WeightService::ApplyImpl(const std::string& model_name,
                                                        const std::vector<AdapterRef>& stack,
                                                        uint64_t expect_generation,
                                                        uint64_t number_at_least,
                                                        const Digest* expect_content,
                                                        const RestoredPublish* restored) {
  std::shared_ptr<const Model> model;
  std::vector<std::shared_ptr<const Adapter>> adapters;
  std::vector<ReadGuard> adapter_guards;
  StateRecord apply_record;
  apply_record.kind = restored != nullptr ? StateRecord::Kind::kPublish : StateRecord::Kind::kApply;
  apply_record.name = model_name;
  if (restored != nullptr) apply_record.path = restored->path;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model_name);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model ", QuoteForMessage(model_name), " is not loaded"));
    }
    model = it->second;
    for (const AdapterRef& ref : stack) {
      auto a = adapters_.find(ref.name);
      if (a == adapters_.end()) {
        return absl::NotFoundError(absl::StrCat("adapter ", QuoteForMessage(ref.name), " is not loaded"));
      }
      adapters.push_back(a->second);
      // Which load of the adapter this apply merges (the journal names it).
      auto seq = adapter_seq_.find(ref.name);
      apply_record.stack_seqs.push_back(seq == adapter_seq_.end() ? 0 : seq->second);
      auto r = adapter_readers_.find(ref.name);
      bool listed = std::any_of(adapter_guards.begin(), adapter_guards.end(),
                                [&](const ReadGuard& g) { return g.what == ref.name; });
      if (r != adapter_readers_.end() && !r->second.empty() && !listed) {
        adapter_guards.push_back(ReadGuard{ref.name, r->second});
      }
    }
    for (ReadGuard& g : adapter_guards) g.what = absl::StrCat("adapter \"", g.what, "\"");
  }
  if (expect_generation != 0 && expect_generation != model->current->number) {
    return absl::AbortedError(absl::StrCat("model \"", model_name, "\" is at generation ",
                                           model->current->number, ", not ", expect_generation));
  }
  // Built outside the lock; published only if nobody moved the model on.
  // A restore re-applies under the number the generation had, below the
  // floor it set for whatever comes next.
  WD_ASSIGN_OR_RETURN(
      const uint64_t number,
      NextGenerationNumber(model_name, model->current->number,
                           number_at_least != 0 ? number_at_least : model->generation_floor));
  WD_ASSIGN_OR_RETURN(std::shared_ptr<Generation> gen,
                      BuildGeneration(*model, number, stack, std::move(adapters),
                                      restored != nullptr ? restored->base
                                                          : model->current->published));
  gen->adapter_guards = std::move(adapter_guards);
  if (expect_content != nullptr && gen->identity != *expect_content) {
    return absl::DataLossError(
        restored != nullptr
            ? absl::StrCat("the published weights in ", restored->path, " (",
                           published_store_->dir(), ")",
                           " with the stack merge to other bytes than were published")
            : "the stack merges to other bytes than before (an adapter file changed?)");
  }
  for (const AdapterRef& r : stack) apply_record.stack.emplace_back(r.name, r.strength);
  apply_record.generation = number;
  apply_record.content = gen->identity.Hex();
  std::vector<uint64_t> retired;
  GenerationInfo info;
  WD_RETURN_IF_ERROR(CommitState(
      apply_record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = models_.find(model_name);
        // Only another apply (or unload/reload) loses us the race; a prune
        // of old generations leaves `current` as it was. A floor raised
        // meanwhile (a restore) is above the number picked: retry too.
        if (it == models_.end() || it->second->current != model->current ||
            (number_at_least == 0 && number < it->second->generation_floor)) {
          return absl::AbortedError(absl::StrCat(
              "model \"", model_name, "\" changed while the apply was prepared; retry"));
        }
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        info = InstallGeneration(model_name, gen, &retired);
      }));
  applies_.fetch_add(1);
  for (uint64_t g : retired) materializer_.RetireTag(absl::StrCat(model_name, "#", g));
  std::vector<std::pair<std::string, std::string>> fields = {{"model", model_name},
                                  {"generation", absl::StrCat(number)},
                                  {"adapters", absl::StrJoin(info.adapters, ",")}};
  if (restored != nullptr) fields.push_back({"bytes_shared", absl::StrCat(restored->bytes_shared)});
  LogEvent(LogLevel::kInfo, restored != nullptr ? "publish_restored" : "apply", fields);
  return info;
}

GenerationInfo WeightService::InstallGeneration(const std::string& model_name,
                                                std::shared_ptr<Generation> gen,
                                                std::vector<uint64_t>* retired) {
  auto it = models_.find(model_name);
  const std::shared_ptr<const Model> model = it->second;
  auto next = std::make_shared<Model>(*model);
  next->current = gen;
  next->history.clear();
  for (const auto& g : model->history) {
    if (IsLeased(*g)) {
      next->history.push_back(g);
    } else {
      retired->push_back(g->number);
    }
  }
  next->history.push_back(gen);
  next->digests.emplace_back(gen->number, gen->content);
  if (next->digests.size() > kDigestHistory) next->digests.erase(next->digests.begin());
  it->second = next;
  generation_changed_.SignalAll();
  return InfoOf(*next, *gen);
}

GenerationInfo WeightService::InfoOf(const Model& model, const Generation& gen) {
  GenerationInfo info;
  info.model = model.name;
  info.generation = gen.number;
  for (const AdapterRef& r : gen.stack) {
    info.adapters.push_back(absl::StrCat(r.name, ":", r.strength));
  }
  info.guards = GuardsOf(model, gen);
  info.content = gen.identity;
  return info;
}

void WeightService::PruneGenerations() {
  std::vector<std::string> retired;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, model] : models_) {
      bool prune = false;
      for (const auto& g : model->history) {
        if (g != model->current && !IsLeased(*g)) prune = true;
      }
      if (!prune) continue;
      auto next = std::make_shared<Model>(*model);
      next->history.clear();
      for (const auto& g : model->history) {
        if (g == model->current || IsLeased(*g)) {
          next->history.push_back(g);
        } else {
          retired.push_back(absl::StrCat(name, "#", g->number));
        }
      }
      model = next;
    }
  }
  for (const std::string& tag : retired) materializer_.RetireTag(tag);
}

absl::StatusOr<std::optional<GenerationInfo>> WeightService::WaitForGeneration(
    const std::string& model_name, uint64_t after, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    auto it = models_.find(model_name);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model ", QuoteForMessage(model_name), " is not loaded"));
    }
    const Generation& gen = *it->second->current;
    if (gen.number > after) return std::optional<GenerationInfo>(InfoOf(*it->second, gen));
    if (generation_changed_.WaitWithDeadline(&mu_, deadline)) {
      return std::optional<GenerationInfo>();
    }
  }
}

absl::StatusOr<ReadRange> WeightService::Read(uint64_t lease_id, absl::string_view token,
                                              uint32_t segment, uint64_t offset,
                                              uint64_t length, const Principal* caller) {
  if (caller != nullptr) WD_RETURN_IF_ERROR(CheckLeaseUse(lease_id, *caller));
  WD_ASSIGN_OR_RETURN(auto contents, leases_.Use(lease_id, token));
  if (contents->push_only) {
    return absl::FailedPreconditionError(absl::StrCat(
        "lease ", lease_id, " was fetched for a push (defer_casts): its tensors are cast as "
        "they are pushed, so its segments are not streamed; fetch without defer_casts to Read"));
  }
  if (segment >= contents->buffers.size()) {
    return absl::OutOfRangeError(absl::StrCat("lease ", lease_id, " has ",
                                              contents->buffers.size(),
                                              " segments; there is no segment ", segment));
  }
  const BufferPtr& seg = contents->buffers[segment];
  if (seg->host_data() == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "segment ", segment, " of lease ", lease_id, " is in ", MemoryKindName(seg->kind()),
        " memory; Read streams host memory only"));
  }
  if (offset > seg->size() || (length != 0 && length > seg->size() - offset)) {
    return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", length,
                                              ") is outside segment ", segment, " of ",
                                              seg->size(), " bytes"));
  }
  if (length == 0) length = seg->size() - offset;
  bytes_read_.fetch_add(length);
  return ReadRange{seg, offset, length};
}

absl::Status WeightService::Release(uint64_t lease_id, absl::string_view token,
                                    const Principal* caller) {
  if (caller != nullptr) WD_RETURN_IF_ERROR(CheckLeaseUse(lease_id, *caller));
  WD_RETURN_IF_ERROR(leases_.Release(lease_id, token));
  LogEvent(LogLevel::kDebug, "lease_release", {{"lease", absl::StrCat(lease_id)}});
  PruneGenerations();
  materializer_.Sweep();
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
  opts.progress = progress;
  opts.files = &roots_;
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

std::vector<std::shared_ptr<const Checkpoint>> WeightService::HeldCopies(const Digest& key,
                                                                         int only_file) const {
  // Only copies whose files are as they were when read: a file rewritten
  // since (the same names, sizes and headers: a fine-tune saved in place)
  // would offer peers stale bytes that agree with their digests.
  std::vector<std::shared_ptr<const Checkpoint>> out;
  for (std::shared_ptr<const Checkpoint>& c : resident_.FindByContent(key)) {
    bool unchanged = !c->file_info().empty();
    for (size_t i = 0; i < c->file_info().size() && unchanged; ++i) {
      if (only_file >= 0 && static_cast<size_t>(only_file) != i) continue;
      const CheckpointFileInfo& f = c->file_info()[i];
      struct stat st;
      unchanged = ::stat(f.path.c_str(), &st) == 0 &&
                  static_cast<uint64_t>(st.st_size) == f.id.size && st.st_dev == f.dev &&
                  st.st_ino == f.ino && st.st_mtim.tv_sec == f.mtime_sec &&
                  st.st_mtim.tv_nsec == f.mtime_nsec;
    }
    if (unchanged) out.push_back(std::move(c));
  }
  return out;
}

bool WeightService::MayOfferToPeer(const Checkpoint& c, const Principal& asker) const {
  // The same bytes under several holders: readable if any holder admits
  // the asker (a public one admits everyone). Only the loaded models and
  // adapters count: a copy kept alive by leases alone is not offered.
  absl::MutexLock lock(&mu_);
  for (const auto& [name, m] : models_) {
    if (m->checkpoint.get() != &c) continue;
    if (access_.CheckRead(asker, {ReadGuard{"", m->readers}}).ok()) return true;
  }
  for (const auto& [name, a] : adapters_) {
    const auto* kept = static_cast<const AdapterFileBytes*>(a->fetched.get());
    if (kept == nullptr || kept->first.get() != &c) continue;
    auto readers = adapter_readers_.find(name);
    const ReaderList none;
    if (access_.CheckRead(asker, {ReadGuard{"", readers != adapter_readers_.end()
                                                     ? readers->second
                                                     : none}})
            .ok()) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<PeerHolding> WeightService::FindHeld(const Digest& key,
                                                    const std::vector<CheckpointRange>& samples,
                                                    const std::vector<Digest>& sample_digests,
                                                    const Principal& asker) const {
  if (samples.size() != sample_digests.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        samples.size(), " samples but ", sample_digests.size(), " sample digests"));
  }
  if (samples.empty()) {
    return absl::InvalidArgumentError(
        "FindCheckpoint needs samples of the asker's bytes and their digests: they pick the copy");
  }
  // Only a copy the asker may read, and only the one whose bytes at the
  // samples are the asker's: not held, not readable and other bytes all
  // answer the same NOT_FOUND.
  for (const std::shared_ptr<const Checkpoint>& c : HeldCopies(key)) {
    if (!MayOfferToPeer(*c, asker)) continue;
    WD_ASSIGN_OR_RETURN(PeerHolding held, DescribeHolding(*c, samples));
    if (held.sample_digests == sample_digests) return held;
  }
  return absl::NotFoundError(absl::StrCat("no copy of checkpoint ", key.Hex(),
                                          " with the asker's bytes at its samples is held here"));
}

absl::StatusOr<ReadRange> WeightService::ReadHeld(const Digest& key, const Digest& copy,
                                                  const CheckpointRange& r,
                                                  const Principal& asker) {
  for (const std::shared_ptr<const Checkpoint>& c :
       HeldCopies(key, static_cast<int>(std::min<uint64_t>(r.file, INT32_MAX)))) {
    if (c->copy_id() != copy || !MayOfferToPeer(*c, asker)) continue;
    WD_ASSIGN_OR_RETURN(HeldBytes held, FindHeldBytes(*c, r, kMaxPeerRangeBytes));
    ReadRange out;
    out.buffer = std::move(held.buffer);
    out.offset = held.offset;
    out.length = r.length;
    bytes_sent_to_peers_.fetch_add(r.length);
    return out;
  }
  return absl::NotFoundError(absl::StrCat("copy ", copy.Hex().substr(0, 12), " of checkpoint ",
                                          key.Hex().substr(0, 12), " is not resident (any more)"));
}

ServiceStats WeightService::Stats() const {
  ServiceStats s;
  // The models as they are now (immutable; walked without the lock).
  std::vector<std::shared_ptr<const Model>> models;
  {
    absl::MutexLock lock(&mu_);
    models.reserve(models_.size());
    for (const auto& [name, model] : models_) models.push_back(model);
  }
  {
    s.models = models.size();
    absl::flat_hash_set<const Checkpoint*> held;
    absl::flat_hash_set<uint64_t> checkpoint_buffers;
    std::vector<const Checkpoint*> sharing;  // with tensors held elsewhere
    for (const auto& model : models) {
      s.checkpoint_bytes_logical += model->checkpoint->total_bytes();
      if (held.insert(model->checkpoint.get()).second) {
        // (Tensors shared from other holders count where they are held.)
        s.checkpoint_bytes_resident +=
            model->checkpoint->total_bytes() - model->checkpoint->bytes_held_elsewhere();
        for (const SegmentPtr& seg : model->checkpoint->host_segments()) {
          checkpoint_buffers.insert(seg->id());
        }
        if (model->checkpoint->bytes_held_elsewhere() > 0) {
          sharing.push_back(model->checkpoint.get());
        }
      }
    }
    absl::flat_hash_set<uint64_t> published_buffers;
    for (const auto& model : models) {
      if (model->current->published == nullptr) continue;
      for (const auto& [key, t] : *model->current->published) {
        s.published_bytes_logical += t->length;
        if (t->buffer == nullptr || checkpoint_buffers.contains(t->buffer->id())) continue;
        if (published_buffers.insert(t->buffer->id()).second) {
          s.published_bytes_resident += t->buffer->size();
        }
      }
    }
    // Shared tensors whose holder is gone (unloaded, its publish replaced)
    // are held by the checkpoints that share them: counted there, once.
    absl::flat_hash_set<std::pair<uint64_t, uint64_t>> orphans;  // (buffer id, offset)
    for (const Checkpoint* c : sharing) {
      for (const StoredTensor& t : c->tensors()) {
        if (t.buffer == nullptr) continue;
        const uint64_t id = t.buffer->id();
        if (checkpoint_buffers.contains(id) || published_buffers.contains(id)) continue;
        if (orphans.insert({id, t.offset}).second) s.checkpoint_bytes_resident += t.length;
      }
    }
  }
  const HostMemoryStats memory = memory_.stats();
  s.segments = memory.segments;
  s.bytes_resident = memory.used_bytes;
  s.memory_limit = memory.limit_bytes;
  s.reserve = memory.reserve;
  s.huge_pages = memory.huge_pages;
  std::copy(std::begin(memory.page_bytes), std::end(memory.page_bytes), std::begin(s.page_bytes));
  s.page_fallbacks = memory.page_fallbacks;
  s.host_pages = memory.host;
  s.materializer = materializer_.stats();
  s.leases_open = leases_.size();
  s.bytes_served = bytes_served_.load();
  s.bytes_read = bytes_read_.load();
  s.pinned_bytes = pinner_.pinned_bytes();
  s.pushes = pushes_.load();
  s.push_bytes = push_bytes_.load();
  s.publishes = publish_count_.load();
  s.publish_bytes = publish_bytes_.load();
  s.publish_seconds = static_cast<double>(publish_ns_.load()) / 1e9;
  s.publish_sessions = OpenPublishSessions();
  s.publish_staging_prepared = staging_prepared_.load();
  s.publish_staging_allocated = staging_allocated_.load();
  s.publish_staging_ahead_bytes = staging_.Bytes();
  s.fetches = fetches_.load();
  s.applies = applies_.load();
  s.loads = loads_.load();
  s.load_bytes = load_bytes_.load();
  s.load_seconds = static_cast<double>(load_ns_.load()) / 1e9;
  s.fetch_errors = fetch_errors_.load();
  s.fetch_latency_shm = fetch_latency_shm_.Take();
  s.fetch_latency_grpc = fetch_latency_grpc_.Take();
  {
    absl::MutexLock lock(&peer_counters_mu_);
    s.load_bytes_storage = load_bytes_storage_;
    s.load_bytes_peers = load_bytes_peers_;
    s.load_bytes_peers_discarded = load_bytes_peers_discarded_;
    s.peer_transfers = peer_transfers_;
  }
  s.bytes_sent_to_peers = bytes_sent_to_peers_.load();
  {
    absl::MutexLock lock(&mu_);
    s.adapters = adapters_.size();
  }
  return s;
}

}  // namespace weightd
