// WeightService: the publish commit (weight_service.h, "Publishing new base
// weights"): the phases of publish/publish_commit.h, run in order, and the
// ones that read or change the catalog (ResidentCopies::Find, Catalog::Commit).
// Sessions are publish/publish_service.h's. Locks: CommitStaged is called
// with no lock held; it takes a session's mu alone, and committer ->
// Catalog::mu_ (Catalog::Commit).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/fault_guard.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"
#include "common/untrusted_text.h"
#include "server/publish/publish_commit.h"
#include "server/engine/weight_service.h"
#include "server/service/generations.h"

namespace weightd {

// The publish calls, forwarded to the session service.
absl::StatusOr<PublishSessionInfo> WeightService::BeginPublish(const PublishBeginParams& params) {
  return publish_.Begin(params);
}

absl::StatusOr<PublishProgress> WeightService::WritePublish(
    const std::optional<Principal>& caller, uint64_t id, absl::string_view token,
    absl::Span<const PublishRun> runs, absl::string_view data, bool in_place) {
  return publish_.Write(caller, id, token, runs, data, in_place);
}

absl::StatusOr<UniqueFd> WeightService::StagePublish(const std::optional<Principal>& caller,
                                                     uint64_t id, absl::string_view token) {
  return publish_.Stage(caller, id, token);
}

absl::StatusOr<PublishResult> WeightService::CommitPublish(const std::optional<Principal>& caller,
                                                           uint64_t id, absl::string_view token,
                                                           absl::Duration wait) {
  return publish_.Commit(caller, id, token, wait);
}

absl::Status WeightService::AbortPublish(const std::optional<Principal>& caller, uint64_t id,
                                         absl::string_view token) {
  return publish_.Abort(caller, id, token);
}

absl::StatusOr<WeightService::PublishResult> WeightService::CommitStaged(
    PublishSession& session, const std::optional<Principal>& caller) {
  std::unique_ptr<Segment> staged;
  bool handed_out = false;
  {
    absl::MutexLock lock(&session.mu);
    staged = std::move(session.staging);
    handed_out = session.handed_out;
  }
  if (staged == nullptr) return absl::InternalError("publish session lost its staging memory");
  CommitTimes times;
  times.start = absl::Now();
  WD_ASSIGN_OR_RETURN(const SegmentPtr segment, SealStaging(std::move(staged), handed_out));
  times.sealed = absl::Now();
  // The model as the session found it, and each spec's served tensor.
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, FindSessionModel(session));
  WD_ASSIGN_OR_RETURN(std::vector<StagedPiece> pieces, PiecesOf(session, *model));
  WD_RETURN_IF_ERROR(DigestPieces(pieces, *segment, options_.worker_threads, session));
  times.digested = absl::Now();
  for (int attempt = 0;; ++attempt) {
    WD_ASSIGN_OR_RETURN(model, FindSessionModel(session));
    const std::shared_ptr<const Generation> cur = model->current;
    // The new generation keeps the stack of the one it builds on: its
    // committer must be able to read that one (an adapter applied since
    // the session began may be private).
    const std::vector<ReadGuard> result_guards = GuardsOf(*model, *cur);
    if (caller.has_value()) WD_RETURN_IF_ERROR(access_.CheckRead(*caller, result_guards));
    if (session.expect_generation != 0 && cur->number != session.expect_generation) {
      return absl::AbortedError(absl::StrCat("model \"", session.model, "\" is at generation ",
                                             cur->number, ", not ", session.expect_generation,
                                             "; nothing published"));
    }
    PublishDiff diff = DiffPieces(pieces, *model, *cur);
    PublishResult result;
    result.tensors = session.specs.size();
    result.changed = diff.changed_specs;
    result.bytes = session.bytes_total;
    bool raced = false;
    absl::Status installed =
        diff.changed_specs == 0
            ? CurrentAsResult(session, cur, &result, &raced)
            : StorePublished(session, *model, cur, segment, diff, &result, &raced);
    if (raced && attempt < 5) continue;
    WD_RETURN_IF_ERROR(installed);
    return FinishPublish(session, result_guards, times, std::move(result));
  }
}

absl::StatusOr<std::shared_ptr<const Model>> WeightService::FindSessionModel(
    const PublishSession& session) const {
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, catalog_.FindModel(session.model));
  if (model->instance != session.model_instance) {
    return absl::AbortedError(absl::StrCat("model \"", session.model,
                                           "\" was unloaded during the publish; nothing published"));
  }
  return model;
}

absl::Status WeightService::CurrentAsResult(const PublishSession& session,
                                            const std::shared_ptr<const Generation>& cur,
                                            PublishResult* result, bool* raced) {
  // Nothing differs: no new generation.
  auto now = catalog_.FindModel(session.model);
  if (!now.ok() || (*now)->current != cur) {
    *raced = true;
    return absl::AbortedError(
        absl::StrCat("model \"", session.model, "\" kept changing during the publish; retry"));
  }
  result->generation = InfoOf(**now, *cur);
  return absl::OkStatus();
}

absl::Status WeightService::StorePublished(PublishSession& session, const Model& model,
                                           const std::shared_ptr<const Generation>& cur,
                                           const SegmentPtr& segment, PublishDiff& diff,
                                           PublishResult* result, bool* raced) {
  // Changed bytes that some loaded model holds already (the same publish
  // sent to another profile of the base, a tensor of another checkpoint)
  // are shared instead of stored again; so are repeats within this
  // publish (PlanStore).
  const std::vector<const StagedPiece*>& fresh = diff.fresh;
  std::vector<std::optional<ResidentCopy>> resident(fresh.size());
  absl::flat_hash_set<uint64_t> held;  // what the new generation holds anyway
  if (!fresh.empty()) {
    held = HeldBuffers(model, *diff.published, fresh);
    std::vector<WantedBytes> wanted;
    wanted.reserve(fresh.size());
    for (const StagedPiece* p : fresh) {
      wanted.push_back(WantedBytes{p->digest, segment->data() + p->offset, p->length});
    }
    resident = copies_.Find(model.name, ReadScope(ModelGuards(model)), wanted, held);
  }
  const StorePlan plan = PlanStore(fresh, resident, segment->data());
  const StoredRuns stored = CompactStored(fresh, resident, plan, segment, session.bytes_total,
                                          held, memory_, options_.worker_threads);
  for (StoredTensor& t : StoredTensorsOf(session, fresh, resident, plan, stored, segment, result)) {
    const std::string key = t.name;
    WD_ASSIGN_OR_RETURN((*diff.published)[key], ChargedPublished(std::move(t)));
  }
  return InstallPublished(session, model, cur, std::move(diff.published), result, raced);
}

absl::Status WeightService::InstallPublished(const PublishSession& session, const Model& model,
                                             const std::shared_ptr<const Generation>& cur,
                                             std::shared_ptr<PublishedBase> published,
                                             PublishResult* result, bool* raced) {
  WD_ASSIGN_OR_RETURN(const uint64_t number,
                      NextGenerationNumber(session.model, cur->number, model.generation_floor));
  WD_ASSIGN_OR_RETURN(std::shared_ptr<Generation> gen,
                      BuildGeneration(model, number, cur->stack, cur->adapters,
                                      std::move(published)));
  gen->adapter_guards = cur->adapter_guards;
  StateRecord record;
  record.kind = StateRecord::Kind::kPublish;
  record.name = session.model;
  record.generation = number;
  record.content = gen->identity.Hex();
  for (const AdapterRef& r : cur->stack) record.stack.emplace_back(r.name, r.strength);
  if (published_store_ != nullptr) record.path = published_store_->FileName(session.model, number);
  std::vector<uint64_t> retired;
  // Another apply or publish winning the race is built on (`raced`; a
  // publish with expect_generation is refused by the caller instead).
  WD_RETURN_IF_ERROR(catalog_.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog_.mu()) {
        std::shared_ptr<const Model> now = catalog_.ModelLocked(session.model);
        if (now == nullptr || now->instance != session.model_instance) {
          return absl::AbortedError(absl::StrCat("model \"", session.model,
                                                 "\" was unloaded during the publish"));
        }
        if (now->current != cur || number < now->generation_floor) {
          *raced = true;
          return absl::AbortedError(absl::StrCat(
              "model \"", session.model, "\" changed while the publish was committed"));
        }
        // Which load of each stack adapter the generation merged (a
        // restore loads those again).
        record.stack_seqs.clear();
        for (const AdapterRef& r : cur->stack) {
          record.stack_seqs.push_back(catalog_.AdapterSeqLocked(r.name));
        }
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog_.mu()) {
        result->generation = catalog_.InstallGenerationLocked(session.model, gen, &retired);
      }));
  for (uint64_t g : retired) materializer_.RetireTag(absl::StrCat(session.model, "#", g));
  PinPublished(session.model, gen->published.get());
  if (published_store_ != nullptr) {
    // Saved for restarts in the background (the journal names the file).
    std::vector<std::shared_ptr<const StoredTensor>> tensors;
    if (gen->published != nullptr) {  // null: every part is the checkpoint's again
      for (const auto& [key, t] : *gen->published) tensors.push_back(t);
    }
    std::sort(tensors.begin(), tensors.end(),
              [](const auto& a, const auto& b) { return a->name < b->name; });
    published_store_->Save(session.model, number, std::move(tensors));
  }
  return absl::OkStatus();
}

WeightService::PublishResult WeightService::FinishPublish(PublishSession& session,
                                                          std::vector<ReadGuard> result_guards,
                                                          const CommitTimes& times,
                                                          PublishResult result) {
  {
    absl::MutexLock lock(&session.mu);
    session.result_guards = std::move(result_guards);
  }
  publish_count_.fetch_add(1);
  publish_bytes_.fetch_add(session.bytes_total);
  const absl::Duration took = absl::Now() - session.start;
  publish_ns_.fetch_add(static_cast<uint64_t>(absl::ToInt64Nanoseconds(took)));
  LogEvent(LogLevel::kInfo, "publish",
           {{"model", session.model},
            {"session", absl::StrCat(session.id)},
            {"generation", absl::StrCat(result.generation.generation)},
            {"tensors", absl::StrCat(result.tensors)},
            {"changed", absl::StrCat(result.changed)},
            {"bytes", absl::StrCat(result.bytes)},
            {"bytes_stored", absl::StrCat(result.bytes_stored)},
            {"bytes_shared", absl::StrCat(result.bytes_shared)},
            {"shared_with", absl::StrJoin(result.shared_with, ",")},
            {"seconds", absl::StrCat(absl::ToDoubleSeconds(took))},
            // Of which the commit, from the last byte: sealing, digests, the rest.
            {"seal_seconds", absl::StrCat(absl::ToDoubleSeconds(times.sealed - times.start))},
            {"digest_seconds", absl::StrCat(absl::ToDoubleSeconds(times.digested - times.sealed))},
            {"commit_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - times.start))}});
  return result;
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
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, catalog_.FindModel(model_name));
  WD_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> file, ReadPublishedFile(path));
  const std::vector<StoredTensor>& saved = file->tensors();
  for (const StoredTensor& t : saved) {
    if (t.host_data() == nullptr) return absl::InternalError("a restored tensor is not in host memory");
  }
  const RestoredSharing sharing = ShareRestored(*model, saved);
  WD_ASSIGN_OR_RETURN(std::shared_ptr<PublishedBase> published,
                      RestoredBase(*model, path, saved, sharing));
  PinPublished(model_name, published.get());
  AdapterService::RestoredPublish restored{std::move(published), file_name,
                                           sharing.bytes_shared, published_store_->dir()};
  return adapters_.RestorePublished(model_name, stack, number, expect_content, restored);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> WeightService::ReadPublishedFile(
    const std::string& path) {
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
  return file;
}

namespace {

// ShareRestored without a packed segment: a file segment kept for an
// unshared tensor holds its neighbours' bytes too: sharing those from a
// segment this model would not hold otherwise saves nothing and keeps that
// segment alive. Dropping some copies can leave a holder segment with less
// than half of it taken (ResidentCopies' rule), which frees more of the
// file's: repeated until nothing changes.
void KeepFileSegmentsWhole(const std::vector<StoredTensor>& saved,
                           absl::Span<const ResidentCopies::WantedBytes> wanted,
                           const absl::flat_hash_set<uint64_t>& held,
                           std::vector<std::optional<HeldElsewhere>>& copies) {
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
    if (ResidentCopies::DropCopiesUnderHalf(copies, wanted, held)) changed = true;
  }
}

}  // namespace

WeightService::RestoredSharing WeightService::ShareRestored(const Model& model,
                                                             const std::vector<StoredTensor>& saved) {
  // Bytes another model holds already (the same publish sent to it and
  // restored before this one) are shared again, as at the publish; the rest
  // moves to a segment of its size when that frees over 1/8 of the file's.
  RestoredSharing out;
  std::vector<std::optional<ResidentCopy>>& copies = out.copies;
  std::vector<uint64_t>& packed_at = out.packed_at;
  SegmentPtr& packed = out.packed;
  uint64_t& bytes_shared = out.bytes_shared;
  copies.resize(saved.size());
  packed_at.assign(saved.size(), 0);
  std::vector<WantedBytes> wanted;
  uint64_t total = 0;
  for (const StoredTensor& t : saved) {
    wanted.push_back(WantedBytes{t.digest, t.host_data(), t.length});
    total += t.length;
  }
  absl::flat_hash_set<uint64_t> held;
  for (const StoredTensor& t : model.checkpoint->tensors()) {
    if (t.buffer != nullptr) held.insert(t.buffer->id());
  }
  copies = copies_.Find(model.name, ReadScope(ModelGuards(model)), wanted, held);
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
  if (packed == nullptr) KeepFileSegmentsWhole(saved, wanted, held, copies);
  for (size_t i = 0; i < saved.size(); ++i) {
    if (copies[i].has_value()) bytes_shared += saved[i].length;
  }
  return out;
}

absl::StatusOr<std::shared_ptr<PublishedBase>> WeightService::RestoredBase(
    const Model& model, const std::string& path, const std::vector<StoredTensor>& saved,
    const RestoredSharing& sharing) {
  // Each saved tensor must stand where the model keeps one: a checkpoint
  // part, or a profile's allow_new tensor, with its dtype and shape.
  absl::flat_hash_map<absl::string_view, const ServedTensorPlan*> new_tensors;
  for (const Served& s : *model.served) {
    if (s.parts.empty()) new_tensors.emplace(s.plan.name, &s.plan);
  }
  const std::vector<std::optional<ResidentCopy>>& copies = sharing.copies;
  auto published = std::make_shared<PublishedBase>();
  for (size_t i = 0; i < saved.size(); ++i) {
    const StoredTensor& t = saved[i];
    DType dtype;
    std::vector<int64_t> shape;
    if (const StoredTensor* original = model.checkpoint->Find(t.name)) {
      dtype = original->dtype;
      shape = original->shape;
    } else if (auto it = new_tensors.find(t.name); it != new_tensors.end()) {
      dtype = it->second->dtype;
      shape = it->second->shape;
    } else {
      return absl::DataLossError(absl::StrCat(path, " holds tensor \"", t.name,
                                              "\", which model \"", model.name, "\" does not have"));
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
    } else if (sharing.packed != nullptr) {
      kept.buffer = sharing.packed;
      kept.offset = sharing.packed_at[i];
    }
    WD_ASSIGN_OR_RETURN((*published)[t.name], ChargedPublished(std::move(kept)));
  }
  return published;
}

}  // namespace weightd
