// WeightService: adapters: loading, unloading and listing them, and applying adapter
// stacks as new generations.
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
  load.files = &files_;
  // The patches' fp32 factors count against --host-memory-bytes for as long
  // as the adapter lives (loaded, or kept by a generation that applied it).
  load.reserve = [this, &name](uint64_t bytes) -> absl::StatusOr<std::shared_ptr<const void>> {
    const std::string what = absl::StrCat("adapter \"", name, "\"");
    auto charge = memory_.Charge(bytes, what);
    if (!charge.ok()) return charge.status();
    return std::shared_ptr<const void>(std::move(*charge));
  };
  if (options_.peers != nullptr) {
    load.fetch = [this, source](const std::string& file, absl::string_view header) {
      return FetchAdapterFile(file, header, source);
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

absl::StatusOr<AdapterLoadOptions::FetchedBytes> WeightService::FetchAdapterFile(
    const std::string& file, absl::string_view header, LoadSource source) {
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

}  // namespace weightd
