// The rules a daemon's start follows (docs/restarts.md), apart from the
// order it builds its parts in (daemon.h): how it starts (fresh, restoring
// its --state-dir, or taking over a running daemon), which --preload
// entries it loads, which saved published weights it keeps, whether a
// take-over's restore serves exactly what the predecessor serves, and who
// may use the data socket. Each piece decides or acts on the parts it is
// given, so most can be checked without a process (daemon_startup_test).
//
// Free functions; each is as thread-safe as the parts it is given.
#ifndef WEIGHTD_SERVER_DAEMON_STARTUP_H_
#define WEIGHTD_SERVER_DAEMON_STARTUP_H_

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/daemon/daemon_flags.h"
#include "server/daemon/handover.h"
#include "server/daemon/restore.h"
#include "server/engine/weight_service.h"
#include "server/state/state_journal.h"
#include "server/transport/data_server.h"

namespace weightd {

// Profiles are small JSON documents; anything larger is a mistake.
inline constexpr uint64_t kMaxProfileBytes = 64ull << 20;
// Added to restored models' next generation numbers when the journal had a
// damaged record (which may have held a higher number than any intact one).
inline constexpr uint64_t kDamagedJournalMargin = 1u << 20;

// How the daemon starts, and when what it served before comes back.
enum class StartMode {
  // Nothing to restore: preloads, then serve.
  kFresh,
  // The journal has entries: serve at once (calls refused UNAVAILABLE,
  // changes in any case, the rest unless --serve-during-restore), restore,
  // preloads, then open.
  kRestore,
  // A predecessor hands over: restore (adopting its checkpoints) and
  // preloads before serving on its sockets; it serves meanwhile.
  kTakeOver,
};
struct StartPlan {
  StartMode mode = StartMode::kFresh;
  // For the gRPC server (GrpcServerOptions): not OK while restoring.
  absl::Status closed_at_start;
  absl::Status changes_closed_at_start;
};
// `restore_entries`: RestorePlan::entries() of the journal (0 without
// --state-dir).
StartPlan PlanStart(bool taking_over, size_t restore_entries, const std::string& state_dir,
                    bool serve_during_restore);

// The restore's floor margin: kDamagedJournalMargin when the journal read
// had problems (a lost record may have held a higher number), else 0.
uint64_t RestoreFloorMargin(const StateJournal* journal);

// What becomes of one --preload. A name the restore brought back is not
// loaded again (the journal's entry is newer than the command line's); a
// name whose journal entry the restore refused (its files changed) is not
// loaded behind its back.
enum class PreloadAction { kLoad, kSkipRestored, kSkipRefused };
PreloadAction DecidePreload(const Preload& preload, bool served, const RestoreReport& restored);

// Loads every preload DecidePreload says to (preload_skipped logged for the
// others), reading its profile file first. The first error ends it.
absl::Status RunPreloads(WeightService& service, const std::vector<Preload>& preloads,
                         const RestoreReport& restored);

// Saved published weights no restored model serves are garbage: removes
// every saved file but `names` (the restore's published_files). Call before
// any change is served (nothing new is being saved yet). No-op without a
// published store.
void KeepPublished(WeightService& service, const std::set<std::string>& names);

// What a daemon serves, as a hand-over compares it: every model's name,
// generation and served content (weights_id), by name.
std::vector<HandoverModel> ServedModels(const WeightService& service);

// Only a successor serving exactly what the predecessor serves takes over
// (the predecessor serves on otherwise): FAILED_PRECONDITION when the
// restore skipped an entry, or when `mine` (ServedModels) differs from
// `theirs` (the predecessor's, by name), naming both.
absl::Status CheckRestoredAll(const RestoreReport& restored);
absl::Status CheckServesAsPredecessor(const std::vector<HandoverModel>& mine,
                                      const std::vector<HandoverModel>& theirs);

// Two daemons must not share sockets or a state directory: one already
// serving on the gRPC socket is refused (FAILED_PRECONDITION) before
// anything of it is touched, with what to do (`take_over`: the flag was
// given but nobody offered a hand-over at `handover_socket`).
absl::Status CheckNoDaemonServes(const std::string& socket, bool take_over,
                                 const std::string& handover_socket);

// The data socket's rules, from the service: who may connect (the access
// policy's Unix peers), attach a lease (its holder), stage a publish's bytes
// (admins: writing a publish's bytes is publishing), and where pushes are
// counted. `service` must outlive the data server.
void ConnectDataSocket(WeightService* service, DataServer::Options* data);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_STARTUP_H_
