// ModelService (model_service.h): model loads, restores, unloads, lists,
// descriptions and verification, and the daemon's checkpoint reads.
#include "server/service/model_service.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/base/log.h"
#include "server/profile/name_summary.h"
#include "server/service/generations.h"
#include "server/source/source_url.h"

namespace weightd {

ModelService::ModelService(Options options) : options_(std::move(options)) {}

ModelSummary ModelService::Summarize(const Model& model) {
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

namespace {

// How long an unload waits for the load it cancelled to end (the reads in
// flight end within a second: chunk boundaries, the sources' transfer
// callback).
constexpr absl::Duration kLoadCancelWait = absl::Seconds(30);

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

absl::StatusOr<ModelSummary> ModelService::Load(
    const std::string& name, const std::string& path, const std::string& profile_json,
    const LoadProgressFn& progress, const std::vector<std::string>& readers,
    const RestoreExpect* expect, LoadSource source, std::shared_ptr<Cancellation> cancel) {
  WD_RETURN_IF_ERROR(ValidateModelName(name));
  WD_ASSIGN_OR_RETURN(ReaderList reader_list, ReaderList::Parse(readers));
  std::shared_ptr<const Profile> profile;
  if (!profile_json.empty()) {
    auto parsed = Profile::Parse(profile_json);
    if (!parsed.ok()) return Annotate(parsed.status(), "profile");
    profile = std::make_shared<const Profile>(std::move(*parsed));
  }
  if (expect != nullptr) WD_RETURN_IF_ERROR(CheckSourceObjects(expect->objects));
  if (cancel == nullptr) cancel = std::make_shared<Cancellation>();
  WD_RETURN_IF_ERROR(options_.catalog->ReserveLoad(name, cancel));
  absl::Time start = absl::Now();
  bool shared = false;  // the checkpoint is another model's (the same files)
  auto built = BuildModel(name, path, profile, reader_list, progress, source, *cancel, &shared);
  // The last point a cancel ends it; one after this sees it loaded.
  if (built.ok() && cancel->cancelled()) built = cancel->status();
  if (built.ok() && expect != nullptr && (*built)->current->identity != expect->content) {
    built = absl::DataLossError(
        "its files changed since it was loaded (the served content differs); not served");
  }
  if (built.ok() && expect != nullptr) (*built)->generation_floor = expect->generation_floor;
  if (!built.ok()) {
    options_.catalog->CancelLoad(name);
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
  if (LooksLikeUrl(path)) record.objects = ObjectsOf(**built);
  record.content = summary.content.Hex();
  // Nothing to check: the name is reserved in loading_.
  Catalog& catalog = *options_.catalog;
  (void)catalog.Commit(
      record, [] { return absl::OkStatus(); },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        catalog.PublishLoadedLocked(name, std::move(*built));
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

absl::StatusOr<std::shared_ptr<Model>> ModelService::BuildModel(
    const std::string& name, const std::string& path, std::shared_ptr<const Profile> profile,
    ReaderList readers, const LoadProgressFn& progress, LoadSource source,
    const Cancellation& cancel, bool* shared) {
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
                                   &model->files, /*share_held=*/true, &cancel, &model->readers);
  if (!checkpoint.ok()) return checkpoint.status();
  model->checkpoint = std::move(*checkpoint);
  *shared = shared_charge != nullptr;
  model->metadata_charge = std::move(shared_charge);
  if (options_.on_loaded) options_.on_loaded(name, *model->checkpoint);
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

absl::Status ModelService::Unload(const std::string& name) {
  // A load of the name still running ends first (CANCELLED for its
  // caller), with what it allocated freed; one that finished meanwhile is
  // unloaded as any other.
  WD_ASSIGN_OR_RETURN(bool was_loading,
                      options_.catalog->CancelLoading(name, "the model was unloaded while loading",
                                                      kLoadCancelWait));
  if (was_loading && !options_.catalog->FindModel(name).ok()) {
    LogEvent(LogLevel::kInfo, "unload", {{"model", name}, {"what", "its load was cancelled"}});
    return absl::OkStatus();
  }
  std::shared_ptr<const Model> dropped;
  StateRecord unload_record;
  unload_record.kind = StateRecord::Kind::kModelUnload;
  unload_record.name = name;
  Catalog& catalog = *options_.catalog;
  WD_RETURN_IF_ERROR(catalog.Commit(
      unload_record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        return catalog.ModelLocked(name) != nullptr
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("model ", QuoteForMessage(name), " is not loaded"));
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        dropped = catalog.EraseModelLocked(name);
      }));
  for (const auto& g : dropped->history) {
    options_.materializer->RetireTag(absl::StrCat(name, "#", g->number));
  }
  if (options_.on_unloaded) options_.on_unloaded(*dropped);
  dropped.reset();
  options_.materializer->Sweep();
  LogEvent(LogLevel::kInfo, "unload", {{"model", name}});
  return absl::OkStatus();
}

std::vector<ModelSummary> ModelService::List() const {
  std::vector<ModelSummary> out;
  for (const auto& model : options_.catalog->Models()) out.push_back(Summarize(*model));
  std::sort(out.begin(), out.end(),
            [](const ModelSummary& a, const ModelSummary& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<ModelDetail> ModelService::Get(const std::string& name) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, options_.catalog->FindModel(name));
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

absl::StatusOr<ModelService::VerifyResult> ModelService::Verify(const std::string& name) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, options_.catalog->FindModel(name));
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

absl::StatusOr<std::shared_ptr<const Checkpoint>> ModelService::ReadCheckpoint(
    const std::string& path, LoadSource source, std::unique_ptr<MemoryCharge>* shared_charge,
    const LoadProgressFn& progress, DonatedCheckpoints* donated,
    std::vector<std::string>* opened_files, bool share_held, const Cancellation* cancel,
    const ReaderList* offer_while_loading) {
  CheckpointLoadOptions opts;
  opts.memory = options_.memory;
  opts.segment_target_bytes = options_.checkpoint_segment_bytes;
  opts.read_threads = options_.worker_threads;
  opts.read_chunk_bytes = options_.read_chunk_bytes;
  if (LooksLikeUrl(path)) {  // ranged GETs: more of them in flight than disk reads
    opts.read_threads = options_.source_streams;
    opts.read_chunk_bytes = options_.source_chunk_bytes;
  }
  opts.progress = progress;
  opts.files = options_.files;
  opts.resident = options_.resident;
  opts.shared_charge = shared_charge;
  opts.donated = donated;
  opts.peers = options_.peers;
  opts.source = source;
  opts.peer_streams = options_.peer_streams;
  opts.peer_verify = options_.peer_verify;
  opts.opened_files = opened_files;
  opts.cancel = cancel;
  opts.offer_while_loading = offer_while_loading;
  if (share_held) {
    // A checkpoint is shared by every model that loads its files, whatever
    // their readers: only public holders' bytes may stand in its tensors.
    opts.find_held = [this](const Checkpoint& c) {
      std::vector<ResidentCopies::WantedBytes> wanted;
      wanted.reserve(c.tensors().size());
      for (const StoredTensor& t : c.tensors()) {
        wanted.push_back(ResidentCopies::WantedBytes{t.digest, t.host_data(), t.length});
      }
      return options_.copies->Find("", "", wanted, /*held=*/{});
    };
  }
  LoadSourceReport report;
  opts.report = &report;
  auto checkpoint = LoadCheckpoint(path, opts);
  CountLoadSources(report);
  return checkpoint;
}

absl::Status ModelService::CheckSourceObjects(
    const std::vector<StateRecord::SourceObject>& objects) const {
  for (const StateRecord::SourceObject& o : objects) {
    absl::StatusOr<OpenedFile> now = options_.files->Open(o.url);
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

std::vector<StateRecord::SourceObject> ModelService::ObjectsOf(const Model& model) const {
  // A checkpoint shared with another URL's identical bytes describes that
  // URL's objects: then this load's own are asked for again (a restore
  // checks the content identity as well, so a version that moved in
  // between is caught there).
  std::vector<StateRecord::SourceObject> out;
  const Checkpoint& c = *model.checkpoint;
  if (c.files() == model.files) {
    for (const CheckpointFileInfo& f : c.file_info()) out.push_back({f.path, f.version, f.id.size});
    return out;
  }
  for (const std::string& url : model.files) {
    absl::StatusOr<OpenedFile> now = options_.files->Open(url);
    if (now.ok()) out.push_back({url, now->version, static_cast<uint64_t>(now->st.st_size)});
  }
  return out;
}

void ModelService::CountLoadSources(const LoadSourceReport& report) {
  absl::MutexLock lock(&mu_);
  load_bytes_storage_ += report.storage_bytes;
  load_bytes_peers_ += report.peer_bytes;
  load_bytes_peers_discarded_ += report.peer_bytes_discarded;
  for (const auto& [peer, bytes] : report.by_peer) peer_transfers_[peer].bytes += bytes;
  for (const auto& [peer, n] : report.peer_failures) peer_transfers_[peer].failures += n;
}

absl::Status ModelService::CheckCanRead(const std::string& model_name,
                                        const Principal& caller) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, options_.catalog->FindModel(model_name));
  return options_.access->CheckRead(caller, GuardsOf(*model, *model->current));
}

absl::StatusOr<std::optional<GenerationInfo>> ModelService::WaitForGeneration(
    const std::string& model, uint64_t after, absl::Duration timeout) {
  return options_.catalog->WaitForGeneration(model, after, timeout);
}

LoadStats ModelService::Stats() const {
  LoadStats s;
  s.loads = loads_.load();
  s.load_bytes = load_bytes_.load();
  s.load_seconds = static_cast<double>(load_ns_.load()) / 1e9;
  absl::MutexLock lock(&mu_);
  s.load_bytes_storage = load_bytes_storage_;
  s.load_bytes_peers = load_bytes_peers_;
  s.load_bytes_peers_discarded = load_bytes_peers_discarded_;
  s.peer_transfers = peer_transfers_;
  return s;
}

}  // namespace weightd
