// AdapterService (adapter_service.h): adapters loaded, unloaded and
// listed, and adapter stacks applied as new generations.
#include "server/service/adapter_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/base/log.h"
#include "server/profile/name_summary.h"
#include "server/service/generations.h"
#include "server/state/state_journal.h"

namespace weightd {

absl::StatusOr<AdapterSummary> AdapterService::Load(const std::string& name,
                                                    const std::string& path,
                                                    const std::string& format, bool strict,
                                                    const std::vector<std::string>& readers,
                                                    LoadSource source) {
  WD_RETURN_IF_ERROR(ValidateModelName(name));
  WD_ASSIGN_OR_RETURN(ReaderList reader_list, ReaderList::Parse(readers));
  WD_ASSIGN_OR_RETURN(AdapterFormat fmt, ParseAdapterFormat(format.empty() ? "auto" : format));
  const std::string& resolved = path;
  if (options_.catalog->HasAdapter(name)) {
    return absl::AlreadyExistsError(absl::StrCat("adapter \"", name, "\" is already loaded"));
  }
  if (source == LoadSource::kPeers && !options_.has_peers) {
    return absl::FailedPreconditionError(
        "--source peers: this daemon has no peers (--peers, --peer-dns)");
  }
  AdapterLoadOptions load;
  load.files = options_.files;
  // The patches' fp32 factors count against --host-memory-bytes for as long
  // as the adapter lives (loaded, or kept by a generation that applied it).
  load.reserve = [this, &name](uint64_t bytes) -> absl::StatusOr<std::shared_ptr<const void>> {
    const std::string what = absl::StrCat("adapter \"", name, "\"");
    auto charge = options_.memory->Charge(bytes, what);
    if (!charge.ok()) return charge.status();
    return std::shared_ptr<const void>(std::move(*charge));
  };
  if (options_.has_peers) {
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
  Catalog& catalog = *options_.catalog;
  WD_RETURN_IF_ERROR(catalog.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        return catalog.HasAdapterLocked(name)
                   ? absl::AlreadyExistsError(
                         absl::StrCat("adapter \"", name, "\" is already loaded"))
                   : absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        catalog.AddAdapterLocked(name, *adapter, record.seq, info, std::move(reader_list));
      }));
  LogEvent(LogLevel::kInfo, "adapter_load",
           {{"adapter", name}, {"path", resolved}, {"format", info.format},
            {"targets", absl::StrCat(info.tensor_count)},
            {"ignored", absl::StrCat((*adapter)->ignored_keys.size())}});
  return info;
}

absl::StatusOr<AdapterLoadOptions::FetchedBytes> AdapterService::FetchAdapterFile(
    const std::string& file, absl::string_view header, LoadSource source) {
  std::unique_ptr<MemoryCharge> shared_charge;
  auto checkpoint = options_.models->ReadCheckpoint(file, source, &shared_charge);
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

absl::Status AdapterService::Unload(const std::string& name) {
  StateRecord record;
  record.kind = StateRecord::Kind::kAdapterUnload;
  record.name = name;
  Catalog& catalog = *options_.catalog;
  WD_RETURN_IF_ERROR(catalog.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        return catalog.HasAdapterLocked(name)
                   ? absl::OkStatus()
                   : absl::NotFoundError(
                         absl::StrCat("adapter ", QuoteForMessage(name), " is not loaded"));
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) { catalog.EraseAdapterLocked(name); }));
  LogEvent(LogLevel::kInfo, "adapter_unload", {{"adapter", name}});
  return absl::OkStatus();
}

std::vector<AdapterSummary> AdapterService::List() const { return options_.catalog->ListAdapters(); }

absl::StatusOr<GenerationInfo> AdapterService::Apply(const std::string& model_name,
                                                     const std::vector<AdapterRef>& stack,
                                                     uint64_t expect_generation) {
  return ApplyImpl(model_name, stack, expect_generation, 0, nullptr);
}

absl::StatusOr<GenerationInfo> AdapterService::RestoreApply(const std::string& model_name,
                                                            const std::vector<AdapterRef>& stack,
                                                            uint64_t number,
                                                            const Digest& expect_content) {
  return ApplyImpl(model_name, stack, 0, number, &expect_content);
}

absl::StatusOr<GenerationInfo> AdapterService::RestorePublished(
    const std::string& model_name, const std::vector<AdapterRef>& stack, uint64_t number,
    const Digest& expect_content, const RestoredPublish& restored) {
  return ApplyImpl(model_name, stack, 0, number, &expect_content, &restored);
}

absl::Status AdapterService::SetGenerationFloor(const std::string& model_name, uint64_t floor) {
  StateRecord record;
  record.kind = StateRecord::Kind::kFloor;
  record.name = model_name;
  Catalog& catalog = *options_.catalog;
  return catalog.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        std::shared_ptr<const Model> model = catalog.ModelLocked(model_name);
        if (model == nullptr) {
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
        record.generation = std::max(model->generation_floor, floor);
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        auto next = std::make_shared<Model>(*catalog.ModelLocked(model_name));
        next->generation_floor = record.generation;
        catalog.ReplaceModelLocked(model_name, std::move(next));
      });
}

absl::StatusOr<GenerationInfo> AdapterService::ApplyImpl(const std::string& model_name,
                                                         const std::vector<AdapterRef>& stack,
                                                         uint64_t expect_generation,
                                                         uint64_t number_at_least,
                                                         const Digest* expect_content,
                                                         const RestoredPublish* restored) {
  StateRecord apply_record;
  apply_record.kind = restored != nullptr ? StateRecord::Kind::kPublish : StateRecord::Kind::kApply;
  apply_record.name = model_name;
  if (restored != nullptr) apply_record.path = restored->path;
  WD_ASSIGN_OR_RETURN(Catalog::StackOf resolved, options_.catalog->ResolveStack(model_name, stack));
  const std::shared_ptr<const Model> model = std::move(resolved.model);
  apply_record.stack_seqs = std::move(resolved.seqs);
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
                      BuildGeneration(*model, number, stack, std::move(resolved.adapters),
                                      restored != nullptr ? restored->base
                                                          : model->current->published));
  gen->adapter_guards = std::move(resolved.guards);
  if (expect_content != nullptr && gen->identity != *expect_content) {
    return absl::DataLossError(
        restored != nullptr
            ? absl::StrCat("the published weights in ", restored->path, " (",
                           restored->store_dir, ")",
                           " with the stack merge to other bytes than were published")
            : "the stack merges to other bytes than before (an adapter file changed?)");
  }
  for (const AdapterRef& r : stack) apply_record.stack.emplace_back(r.name, r.strength);
  apply_record.generation = number;
  apply_record.content = gen->identity.Hex();
  WD_ASSIGN_OR_RETURN(GenerationInfo info,
                      CommitApply(model_name, model, std::move(gen), number_at_least, apply_record));
  std::vector<std::pair<std::string, std::string>> fields = {{"model", model_name},
                                  {"generation", absl::StrCat(number)},
                                  {"adapters", absl::StrJoin(info.adapters, ",")}};
  if (restored != nullptr) fields.push_back({"bytes_shared", absl::StrCat(restored->bytes_shared)});
  LogEvent(LogLevel::kInfo, restored != nullptr ? "publish_restored" : "apply", fields);
  return info;
}

absl::StatusOr<GenerationInfo> AdapterService::CommitApply(
    const std::string& model_name, const std::shared_ptr<const Model>& model,
    std::shared_ptr<Generation> gen, uint64_t number_at_least, StateRecord& record) {
  const uint64_t number = gen->number;
  std::vector<uint64_t> retired;
  GenerationInfo info;
  Catalog& catalog = *options_.catalog;
  WD_RETURN_IF_ERROR(catalog.Commit(
      record,
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        std::shared_ptr<const Model> now = catalog.ModelLocked(model_name);
        // Only another apply (or unload/reload) loses us the race; a prune
        // of old generations leaves `current` as it was. A floor raised
        // meanwhile (a restore) is above the number picked: retry too.
        if (now == nullptr || now->current != model->current ||
            (number_at_least == 0 && number < now->generation_floor)) {
          return absl::AbortedError(absl::StrCat(
              "model \"", model_name, "\" changed while the apply was prepared; retry"));
        }
        return absl::OkStatus();
      },
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog.mu()) {
        info = catalog.InstallGenerationLocked(model_name, gen, &retired);
      }));
  applies_.fetch_add(1);
  for (uint64_t g : retired) options_.materializer->RetireTag(absl::StrCat(model_name, "#", g));
  return info;
}

}  // namespace weightd
