#include "server/daemon/startup.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fd.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"
#include "server/gpu/cuda_push_writer.h"

namespace weightd {

StartPlan PlanStart(bool taking_over, size_t restore_entries, const std::string& state_dir,
                    bool serve_during_restore) {
  StartPlan plan;
  const bool restoring = restore_entries > 0;
  if (taking_over) {
    plan.mode = StartMode::kTakeOver;
  } else if (restoring) {
    plan.mode = StartMode::kRestore;
    const absl::Status why = absl::UnavailableError(
        absl::StrCat("weightd is restoring its state from ", state_dir,
                     " (--state-dir); retry when health says SERVING"));
    // Loads, unloads and applies wait for the restore in any case (they
    // would race with it); with --serve-during-restore the rest is served.
    plan.changes_closed_at_start = why;
    if (!serve_during_restore) plan.closed_at_start = why;
  }
  return plan;
}

uint64_t RestoreFloorMargin(const StateJournal* journal) {
  return journal == nullptr || journal->previous().problems.empty() ? 0 : kDamagedJournalMargin;
}

PreloadAction DecidePreload(const Preload& preload, bool served, const RestoreReport& restored) {
  if (served) return PreloadAction::kSkipRestored;
  if (restored.skipped_names.contains(preload.name)) return PreloadAction::kSkipRefused;
  return PreloadAction::kLoad;
}

absl::Status RunPreloads(WeightService& service, const std::vector<Preload>& preloads,
                         const RestoreReport& restored) {
  for (const Preload& p : preloads) {
    switch (DecidePreload(p, service.GetModel(p.name).ok(), restored)) {
      case PreloadAction::kSkipRestored:
        LogEvent(LogLevel::kInfo, "preload_skipped",
                 {{"model", p.name}, {"reason", "restored from --state-dir"}});
        continue;
      case PreloadAction::kSkipRefused:
        LogEvent(LogLevel::kWarning, "preload_skipped",
                 {{"model", p.name},
                  {"reason", "the restore skipped its journal entry (restore_skipped)"}});
        continue;
      case PreloadAction::kLoad:
        break;
    }
    std::string profile;
    if (!p.profile.empty()) {
      WD_ASSIGN_OR_RETURN(profile, ReadFileToString(p.profile, kMaxProfileBytes));
    }
    auto loaded = service.LoadModel(p.name, p.path, profile, nullptr);
    if (!loaded.ok()) return loaded.status();
  }
  return absl::OkStatus();
}

void KeepPublished(WeightService& service, const std::set<std::string>& names) {
  PublishedStore* store = service.published_store();
  if (store == nullptr) return;
  store->KeepOnly(names);
}

std::vector<HandoverModel> ServedModels(const WeightService& service) {
  std::vector<HandoverModel> out;
  for (const ModelSummary& m : service.ListModels()) {
    out.push_back({m.name, m.generation, m.content.Hex()});
  }
  std::sort(out.begin(), out.end(),
            [](const HandoverModel& a, const HandoverModel& b) { return a.name < b.name; });
  return out;
}

absl::Status CheckRestoredAll(const RestoreReport& restored) {
  if (restored.skipped_names.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--take-over: the restore skipped ", absl::StrJoin(restored.skipped_names, ", "),
      " (restore_skipped in the log); the running daemon serves on"));
}

absl::Status CheckServesAsPredecessor(const std::vector<HandoverModel>& mine,
                                      const std::vector<HandoverModel>& theirs) {
  if (mine == theirs) return absl::OkStatus();
  auto show = [](const std::vector<HandoverModel>& v) {
    std::vector<std::string> out;
    for (const HandoverModel& m : v) {
      out.push_back(absl::StrCat(m.name, "@", m.generation, ":", m.content.substr(0, 12)));
    }
    return absl::StrJoin(out, " ");
  };
  return absl::FailedPreconditionError(absl::StrCat("--take-over: restored [", show(mine),
                                                    "] but the running daemon serves [",
                                                    show(theirs), "]; it serves on"));
}

absl::Status CheckNoDaemonServes(const std::string& socket, bool take_over,
                                 const std::string& handover_socket) {
  // Someone accepts connections on the socket: a daemon serves there.
  if (!ConnectUnix(socket).ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "a daemon already serves on ", socket,
      take_over
          ? absl::StrCat(" and offers no hand-over at ", handover_socket,
                         " (it is still restoring, runs with another or no --state-dir, or "
                         "predates hand-overs); retry later, or stop it first")
          : "; stop it first, or start this one with --take-over"));
}

void ConnectDataSocket(WeightService* service, DataServer::Options* data) {
  WeightService* svc = service;
  data->authorize = [svc](const PeerIdentity& peer) {
    return svc->access().AdmitPeer(Principal::UnixPeer(peer));
  };
  data->authorize_attach = [svc](const PeerIdentity& peer, uint64_t lease_id) {
    return svc->CheckLeaseUse(lease_id, Principal::UnixPeer(peer));
  };
  data->on_push = [svc](uint64_t bytes) { svc->RecordPush(bytes); };
  data->stage = [svc](const PeerIdentity& peer, uint64_t session,
                      absl::string_view token) -> absl::StatusOr<UniqueFd> {
    // Writing a publish's bytes is publishing: admins only, as on gRPC
    // (and readers of the model: StagePublish checks).
    const Principal caller = Principal::UnixPeer(peer);
    WD_RETURN_IF_ERROR(svc->access().CheckAdmin(caller, "publish weights"));
    return svc->StagePublish(caller, session, absl::BytesToHexString(token));
  };
  data->push_writers = {std::make_shared<CudaPushWriter>(&svc->gpus())};
  data->host_memory = svc->host_memory();
}

}  // namespace weightd
