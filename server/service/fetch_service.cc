// FetchService (fetch_service.h): fetches, from a request to a lease on a
// materialized table (cached tables first), the grpc-transport Read,
// Release and their counters.
#include "server/service/fetch_service.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/base/log.h"
#include "server/service/generations.h"

namespace weightd {

void FetchService::RecordFetch(const FetchParams& params, bool ok, absl::Time start) {
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  if (!ok) {
    fetch_errors_.fetch_add(1);
  } else if (params.transport == TransportKind::kGrpc) {
    fetch_latency_grpc_.Record(secs);
  } else {
    fetch_latency_shm_.Record(secs);
  }
}

absl::StatusOr<FetchResult> FetchService::Fetch(const FetchParams& params) {
  absl::Time start = absl::Now();
  auto result = FetchImpl(params);
  RecordFetch(params, result.ok(), start);
  return result;
}

absl::StatusOr<FetchResult> FetchService::FetchImpl(const FetchParams& params) {
  if (params.transport == TransportKind::kCuda) {
    return absl::UnimplementedError("the cuda transport is not built into this daemon");
  }
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, options_.catalog->FindModel(params.model));
  // Nothing about a model, not even its current generation, is said to a
  // caller who may not read it.
  if (params.caller.has_value()) {
    WD_RETURN_IF_ERROR(options_.access->CheckRead(*params.caller, ModelGuards(*model)));
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
    WD_RETURN_IF_ERROR(options_.access->CheckRead(*params.caller, guards));
  }
  return PlanAndMaterialize(params, *model, gen, std::move(cache_key), std::move(guards));
}

absl::StatusOr<FetchResult> FetchService::PlanAndMaterialize(
    const FetchParams& params, const Model& model_ref,
    const std::shared_ptr<const Generation>& gen, std::string cache_key,
    std::vector<ReadGuard> guards) {
  const Model* model = &model_ref;
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const ContentMap> since, ChangedSince(*model, params));
  WD_RETURN_IF_ERROR(params.mesh.Validate());
  FetchPlanOptions plan_options;
  plan_options.mesh = params.mesh;
  WD_ASSIGN_OR_RETURN(
      plan_options.defaults,
      ResolveDefaultPlacements(params.mesh, params.placements,
                               model->profile != nullptr ? model->profile->default_placements()
                                                         : std::nullopt));
  plan_options.dtype = params.dtype;

  WD_ASSIGN_OR_RETURN(std::vector<const Served*> selected,
                      SelectServed(*model, *gen, since.get(), params));
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
  std::vector<std::optional<DType>> cast_on_push(items.size());
  std::vector<std::shared_ptr<const PushMerge>> merge_on_push(items.size());
  if (params.defer_casts) DeferToPush(params.defer_merges, items, cast_on_push, merge_on_push);
  WD_ASSIGN_OR_RETURN(std::vector<MaterializedTensor> served,
                      options_.materializer->Materialize(
                          items, absl::StrCat(params.model, "#", gen->number), ReadScope(guards)));

  std::vector<BufferPtr> buffers;
  std::shared_ptr<FetchTable> table =
      BuildTable(*gen, items, tables, served, cast_on_push, merge_on_push, &buffers);
  // A table whose ranges carry merges holds their patches: not kept by the
  // cache, which must never hold memory past its generation (its entries
  // are dropped only when next looked at).
  const bool holds_patches =
      std::any_of(merge_on_push.begin(), merge_on_push.end(),
                  [](const std::shared_ptr<const PushMerge>& m) { return m != nullptr; });
  if (!holds_patches) fetch_cache_.Store(std::move(cache_key), gen, table, buffers, guards);
  return GrantFetch(params, *gen, std::move(table), std::move(buffers), std::move(guards));
}

absl::StatusOr<std::shared_ptr<const ContentMap>> FetchService::ChangedSince(
    const Model& model, const FetchParams& params) {
  std::shared_ptr<const ContentMap> since;
  if (params.changed_since != 0) {
    for (const auto& [number, content] : model.digests) {
      if (number == params.changed_since) since = content;
    }
    if (since == nullptr) {
      return absl::NotFoundError(absl::StrCat("generation ", params.changed_since, " of model \"",
                                              params.model, "\" is unknown (current is ",
                                              model.current->number, ")"));
    }
  }
  return since;
}

absl::StatusOr<std::vector<const Served*>> FetchService::SelectServed(
    const Model& model, const Generation& gen, const ContentMap* since, const FetchParams& params) {
  // Select the served tensors: by name, then what changed since.
  std::vector<const Served*> all = ServedAt(model, gen);
  std::vector<std::string> all_names;
  all_names.reserve(all.size());
  for (const Served* s : all) all_names.push_back(s->plan.name);
  WD_ASSIGN_OR_RETURN(std::vector<size_t> picked,
                      SelectByName(all_names, params.names, params.model));
  std::vector<const Served*> selected;
  for (size_t i : picked) {
    const Served* s = all[i];
    if (since != nullptr) {
      auto now = gen.content->find(s->plan.name);
      auto then = since->find(s->plan.name);
      if (then != since->end() && now != gen.content->end() && now->second == then->second) {
        continue;
      }
    }
    selected.push_back(s);
  }

  return selected;
}

void FetchService::DeferToPush(bool defer_merges, std::vector<MaterializeItem>& items,
                                std::vector<std::optional<DType>>& cast_on_push,
                                std::vector<std::shared_ptr<const PushMerge>>& merge_on_push) {
  // A lease for a push: a plain view but for its dtype is leased as its
  // stored bytes, cast by the push (the output dtype kept here).
  // With defer_merges, so is a patched tensor the push can merge element by
  // element (its patches then go with the lease, not into the item).
  for (size_t i = 0; i < items.size(); ++i) {
    if (defer_merges) merge_on_push[i] = MergeOnPush(items[i]);
    if (merge_on_push[i] == nullptr && !IsCastOfView(items[i])) continue;
    cast_on_push[i] = items[i].out_dtype;
    items[i].out_dtype = items[i].slices[0].stored->dtype;
    items[i].slices[0].patches.clear();
  }
}

std::shared_ptr<FetchTable> FetchService::BuildTable(
    const Generation& gen, const std::vector<MaterializeItem>& items,
    std::vector<FetchedTensor>& tables, const std::vector<MaterializedTensor>& served,
    const std::vector<std::optional<DType>>& cast_on_push,
    const std::vector<std::shared_ptr<const PushMerge>>& merge_on_push,
    std::vector<BufferPtr>* buffers) const {
  auto table = std::make_shared<FetchTable>();
  table->generation = gen.number;
  table->weights_id = gen.identity.Hex();
  table->data_socket = options_.data_socket_path;
  table->data_socket_name = options_.data_socket_name;
  absl::flat_hash_map<uint64_t, uint32_t> segment_index;
  auto ranges = std::make_shared<std::vector<LeaseTensor>>();
  ranges->reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const MaterializedTensor& m = served[i];
    auto [it, inserted] = segment_index.try_emplace(m.buffer->id(), buffers->size());
    if (inserted) {
      buffers->push_back(m.buffer);
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
  return table;
}

std::optional<absl::StatusOr<FetchResult>> FetchService::FetchFromCache(
    const FetchParams& params, const std::string& key,
    const std::shared_ptr<const Generation>& gen) {
  std::optional<FetchTableCache::Hit> hit = fetch_cache_.Lookup(key, gen);
  if (!hit.has_value()) return std::nullopt;
  if (params.caller.has_value()) {
    if (absl::Status s = options_.access->CheckRead(*params.caller, hit->guards); !s.ok()) {
      return s;
    }
  }
  return GrantFetch(params, *gen, std::move(hit->table), std::move(hit->buffers),
                    std::move(hit->guards));
}

std::optional<absl::StatusOr<FetchResult>> FetchService::TryFetchCached(
    const FetchParams& params) {
  if (params.transport == TransportKind::kCuda) return std::nullopt;
  absl::Time start = absl::Now();
  auto model = options_.catalog->FindModel(params.model);
  if (!model.ok()) return std::nullopt;  // Fetch gives the error
  std::shared_ptr<const Generation> gen = GenerationOf(**model, params.generation);
  if (gen == nullptr) return std::nullopt;
  auto result = FetchFromCache(params, FetchCacheKey(params, gen->number), gen);
  if (!result.has_value()) return std::nullopt;
  RecordFetch(params, result->ok(), start);
  return result;
}

std::string FetchService::FetchCacheKey(const FetchParams& params, uint64_t generation) {
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

FetchResult FetchService::GrantFetch(const FetchParams& params, const Generation& gen,
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
  result.lease = options_.leases->Grant(std::move(lease));
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

absl::StatusOr<ReadRange> FetchService::Read(uint64_t lease_id, absl::string_view token,
                                              uint32_t segment, uint64_t offset,
                                              uint64_t length, const Principal* caller) {
  if (caller != nullptr) WD_RETURN_IF_ERROR(CheckLeaseUse(lease_id, *caller));
  WD_ASSIGN_OR_RETURN(auto contents, options_.leases->Use(lease_id, token));
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

absl::Status FetchService::Release(uint64_t lease_id, absl::string_view token,
                                    const Principal* caller) {
  if (caller != nullptr) WD_RETURN_IF_ERROR(CheckLeaseUse(lease_id, *caller));
  WD_RETURN_IF_ERROR(options_.leases->Release(lease_id, token));
  LogEvent(LogLevel::kDebug, "lease_release", {{"lease", absl::StrCat(lease_id)}});
  PruneGenerations();
  options_.materializer->Sweep();
  return absl::OkStatus();
}

absl::Status FetchService::CheckLeaseUse(uint64_t lease_id, const Principal& caller) const {
  auto contents = options_.leases->Peek(lease_id);
  // An unknown lease is the use's own NOT_FOUND, after the token check.
  if (!contents.ok() || (*contents)->owner == nullptr) return absl::OkStatus();
  return options_.access->CheckLeaseUse(caller, lease_id, *(*contents)->owner);
}

void FetchService::PruneGenerations() {
  // The tags retire outside the catalog's lock.
  for (const std::string& tag : options_.catalog->PruneUnleased()) {
    options_.materializer->RetireTag(tag);
  }
}

FetchStats FetchService::Stats() const {
  FetchStats s;
  s.bytes_served = bytes_served_.load();
  s.bytes_read = bytes_read_.load();
  s.fetches = fetches_.load();
  s.fetch_errors = fetch_errors_.load();
  s.pushes = pushes_.load();
  s.push_bytes = push_bytes_.load();
  s.fetch_latency_shm = fetch_latency_shm_.Take();
  s.fetch_latency_grpc = fetch_latency_grpc_.Take();
  return s;
}

}  // namespace weightd
