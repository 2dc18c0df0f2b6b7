#include "server/service/weight_service.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr size_t kMaxModelName = 128;

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

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<WeightService>> WeightService::Create(
    WeightServiceOptions options) {
  WD_ASSIGN_OR_RETURN(ModelRoots roots, ModelRoots::Create(options.model_roots));
  return std::unique_ptr<WeightService>(new WeightService(std::move(options), std::move(roots)));
}

WeightService::WeightService(WeightServiceOptions options, ModelRoots roots)
    : options_(std::move(options)),
      roots_(std::move(roots)),
      account_(std::make_shared<MemoryAccount>(options_.host_memory_bytes)),
      materializer_(Materializer::Options{account_, options_.worker_threads}),
      leases_(options_.lease_idle_ttl) {
  reaper_ = std::thread([this] { ReapLoop(); });
}

WeightService::~WeightService() {
  stop_.Notify();
  if (reaper_.joinable()) reaper_.join();
}

void WeightService::ReapLoop() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    size_t expired = leases_.Expire(absl::Now());
    if (expired > 0) {
      LogEvent(LogLevel::kInfo, "lease_expired", {{"count", absl::StrCat(expired)}});
    }
    materializer_.Sweep();
  }
}

ModelSummary WeightService::Summarize(const Model& model) {
  ModelSummary s;
  s.name = model.name;
  s.path = model.path;
  s.generation = model.generation;
  s.tensor_count = model.checkpoint->tensors().size();
  s.total_bytes = model.checkpoint->total_bytes();
  s.files = model.checkpoint->files();
  return s;
}

absl::StatusOr<ModelSummary> WeightService::LoadModel(const std::string& name,
                                                      const std::string& path,
                                                      const std::string& profile_json,
                                                      const LoadProgressFn& progress) {
  WD_RETURN_IF_ERROR(ValidateModelName(name));
  if (!profile_json.empty()) {
    return absl::UnimplementedError("model profiles are not supported by this daemon yet");
  }
  WD_ASSIGN_OR_RETURN(std::string resolved, roots_.Resolve(path));
  {
    absl::MutexLock lock(&mu_);
    if (models_.contains(name) || loading_.contains(name)) {
      return absl::AlreadyExistsError(absl::StrCat("model \"", name, "\" is already loaded"));
    }
    loading_.insert(name);
  }
  absl::Time start = absl::Now();
  CheckpointLoadOptions opts;
  opts.account = account_;
  opts.read_threads = options_.worker_threads;
  opts.progress = progress;
  opts.resolve_file = [this](const std::string& p) { return roots_.Resolve(p); };
  auto checkpoint = LoadCheckpoint(resolved, opts);
  absl::MutexLock lock(&mu_);
  loading_.erase(name);
  if (!checkpoint.ok()) {
    LogEvent(LogLevel::kWarning, "load_failed",
             {{"model", name}, {"path", path}, {"error", checkpoint.status().ToString()}});
    return Annotate(checkpoint.status(), absl::StrCat("loading model \"", name, "\""));
  }
  auto model = std::make_shared<Model>();
  model->name = name;
  model->path = resolved;
  model->checkpoint = std::move(*checkpoint);
  ModelSummary summary = Summarize(*model);
  models_[name] = std::move(model);
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  LogEvent(LogLevel::kInfo, "load",
           {{"model", name},
            {"path", resolved},
            {"tensors", absl::StrCat(summary.tensor_count)},
            {"bytes", absl::StrCat(summary.total_bytes)},
            {"seconds", absl::StrCat(secs)}});
  return summary;
}

absl::Status WeightService::UnloadModel(const std::string& name) {
  std::shared_ptr<const Model> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model \"", name, "\" is not loaded"));
    }
    dropped = std::move(it->second);
    models_.erase(it);
  }
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
  std::shared_ptr<const Model> model;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(name);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model \"", name, "\" is not loaded"));
    }
    model = it->second;
  }
  ModelDetail detail;
  detail.summary = Summarize(*model);
  for (const StoredTensor& t : model->checkpoint->tensors()) {
    detail.tensors.push_back(TensorSummary{t.name, t.dtype, t.shape, t.digest});
  }
  return detail;
}

absl::StatusOr<FetchResult> WeightService::Fetch(const FetchParams& params) {
  if (params.transport == TransportKind::kCuda) {
    return absl::UnimplementedError("the cuda transport is not built into this daemon");
  }
  std::shared_ptr<const Model> model;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(params.model);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model \"", params.model, "\" is not loaded"));
    }
    model = it->second;
  }
  if (params.generation != 0 && params.generation != model->generation) {
    return absl::NotFoundError(absl::StrCat("generation ", params.generation, " of model \"",
                                            params.model, "\" is not available (current is ",
                                            model->generation, ")"));
  }
  WD_RETURN_IF_ERROR(params.mesh.Validate());
  std::vector<Placement> placements =
      params.placements.has_value() ? *params.placements : DefaultPlacements(params.mesh.shape.size());
  if (placements.size() != params.mesh.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "placements \"", PlacementsToString(placements), "\" name ", placements.size(),
        " mesh dims but the mesh has ", params.mesh.shape.size()));
  }
  // Select the tensors.
  std::vector<const StoredTensor*> selected;
  const Checkpoint& ckpt = *model->checkpoint;
  if (params.changed_since != 0 && params.changed_since != model->generation) {
    return absl::NotFoundError(absl::StrCat("generation ", params.changed_since, " of model \"",
                                            params.model, "\" is not available (current is ",
                                            model->generation, ")"));
  }
  if (params.changed_since == 0) {
    if (params.names.empty()) {
      for (const StoredTensor& t : ckpt.tensors()) selected.push_back(&t);
    } else {
      std::vector<std::string> unknown;
      for (const std::string& n : params.names) {
        const StoredTensor* t = ckpt.Find(n);
        if (t == nullptr) {
          unknown.push_back(n);
        } else {
          selected.push_back(t);
        }
      }
      if (!unknown.empty()) {
        return absl::NotFoundError(absl::StrCat("model \"", params.model,
                                                "\" has no tensor named ",
                                                absl::StrJoin(unknown, ", ")));
      }
    }
  }
  std::vector<MaterializeItem> items;
  items.reserve(selected.size());
  for (const StoredTensor* t : selected) {
    auto box = PlanShard(t->shape, params.mesh, placements);
    if (!box.ok()) {
      return Annotate(box.status(), absl::StrCat("tensor \"", t->name, "\" of shape ",
                                                 ShapeString(t->shape)));
    }
    DType out = t->dtype;
    if (params.dtype.has_value() && IsFloating(t->dtype)) out = *params.dtype;
    if (params.dtype.has_value() && !IsFloating(*params.dtype) && IsFloating(t->dtype) &&
        *params.dtype != t->dtype) {
      return absl::InvalidArgumentError(absl::StrCat("cannot serve float tensors as ",
                                                     DTypeName(*params.dtype)));
    }
    items.push_back(MaterializeItem{t, std::move(*box), out});
  }
  WD_ASSIGN_OR_RETURN(std::vector<ServedTensor> served, materializer_.Materialize(items));

  FetchResult result;
  result.generation = model->generation;
  result.data_socket = options_.data_socket_path;
  LeaseContents lease;
  lease.model = params.model;
  lease.generation = model->generation;
  absl::flat_hash_map<uint64_t, uint32_t> segment_index;
  for (size_t i = 0; i < items.size(); ++i) {
    const ServedTensor& s = served[i];
    auto [it, inserted] = segment_index.try_emplace(s.segment->id(), lease.segments.size());
    if (inserted) {
      lease.segments.push_back(s.segment);
      result.segment_sizes.push_back(s.segment->size());
    }
    FetchedTensor ft;
    ft.name = items[i].tensor->name;
    ft.dtype = items[i].out_dtype;
    ft.shape = items[i].box.shape;
    ft.global_shape = items[i].tensor->shape;
    ft.global_offset = items[i].box.offset;
    ft.segment = it->second;
    ft.offset = s.offset;
    ft.length = s.length;
    ft.digest = s.digest;
    lease.bytes += s.length;
    result.tensors.push_back(std::move(ft));
  }
  bytes_served_.fetch_add(lease.bytes);
  fetches_.fetch_add(1);
  result.lease = leases_.Grant(std::move(lease));
  return result;
}

absl::StatusOr<ReadRange> WeightService::Read(uint64_t lease_id, absl::string_view token,
                                              uint32_t segment, uint64_t offset,
                                              uint64_t length) {
  WD_ASSIGN_OR_RETURN(auto contents, leases_.Use(lease_id, token));
  if (segment >= contents->segments.size()) {
    return absl::OutOfRangeError(absl::StrCat("lease ", lease_id, " has ",
                                              contents->segments.size(),
                                              " segments; there is no segment ", segment));
  }
  const SegmentPtr& seg = contents->segments[segment];
  if (offset > seg->size() || (length != 0 && length > seg->size() - offset)) {
    return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", length,
                                              ") is outside segment ", segment, " of ",
                                              seg->size(), " bytes"));
  }
  if (length == 0) length = seg->size() - offset;
  return ReadRange{seg, offset, length};
}

absl::Status WeightService::Release(uint64_t lease_id, absl::string_view token) {
  WD_RETURN_IF_ERROR(leases_.Release(lease_id, token));
  materializer_.Sweep();
  return absl::OkStatus();
}

ServiceStats WeightService::Stats() const {
  ServiceStats s;
  {
    absl::MutexLock lock(&mu_);
    s.models = models_.size();
  }
  s.segments = account_->segments();
  s.bytes_resident = account_->used();
  s.memory_limit = account_->limit();
  s.materializer = materializer_.stats();
  s.leases_open = leases_.size();
  s.bytes_served = bytes_served_.load();
  s.fetches = fetches_.load();
  return s;
}

}  // namespace weightd
