// Restoring what a daemon served before its restart (--state-dir), from the
// plan its journal replays to (state_journal.h). Orchestration above the
// service (it drives WeightService's public restore calls), so it lives
// with the daemon's composition, not with the persistence in state/.
// Runs on the calling thread; the service is thread-safe, and serves other
// calls meanwhile.
#ifndef WEIGHTD_SERVER_DAEMON_RESTORE_H_
#define WEIGHTD_SERVER_DAEMON_RESTORE_H_

#include <cstddef>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server/engine/weight_service.h"
#include "server/state/state_journal.h"

namespace weightd {

struct RestoreReport {
  size_t entries = 0;   // models and adapters in the plan
  size_t restored = 0;  // of those, restored as they were
  // Entries not restored (or restored at another generation), with why:
  // "model load \"m\" (seq 3)" -> "its files changed since it was loaded".
  std::vector<std::pair<std::string, std::string>> skipped;
  std::set<std::string> skipped_names;  // models and adapters among them
  std::set<std::string> published_files;  // the saved publishes restored (file names)
  bool interrupted = false;             // `stop` said so: the rest not restored
};

// Models first (each at the stack and generation number it had; its bytes
// checked against the identity journaled when it was loaded and applied),
// then the adapters loaded at the end. A model or generation is published
// only if its bytes are the ones journaled. An entry that cannot be
// restored — a file gone or changed, a path now outside the roots, an
// adapter of its stack missing — is logged (restore_skipped), written to
// the journal's skipped.log and skipped. A model whose stack cannot be
// re-applied serves its base (the same bytes as its generation 1). Every
// restored model's next generation is numbered past every number it had,
// plus `floor_margin` (the caller passes a margin when the journal was
// damaged: a lost record may have held a higher number). `stop` is asked
// before each entry (a SIGTERM pending): true ends the restore there.
// Progress: restore_begin, restore_entry, restore_done.
RestoreReport RestoreState(WeightService& service, const RestorePlan& plan,
                           StateJournal* journal, const std::function<bool()>& stop = nullptr,
                           uint64_t floor_margin = 0);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_RESTORE_H_
