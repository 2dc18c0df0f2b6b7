// ChangeCommitter: serializes every change of what is served (loads,
// unloads, applies, publishes, adapter loads and unloads, floors) from its
// journal record to its publication: the journal's order is the order
// clients saw the changes in, and no client sees a change that a crash
// could lose. Fetches never take its lock.
//
// Thread-safe. Its lock is taken before the catalog's (Catalog::mu_,
// which it borrows): ChangeCommitter::mu_ -> catalog mu -> publish sessions'.
//
// Owns: the journal sequence number and the sink records go to.
#ifndef WEIGHTD_SERVER_SERVICE_CHANGE_COMMITTER_H_
#define WEIGHTD_SERVER_SERVICE_CHANGE_COMMITTER_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/state/state_journal.h"

namespace weightd {

class ChangeCommitter {
 public:
  // Called with every committed record, in seq order, before the change is
  // published, with this committer's lock held and the catalog's not (the
  // journal: durable when it returns). Failures are the sink's to report;
  // the change stands. Null: records are only numbered.
  using Sink = std::function<void(const StateRecord&)>;
  // `catalog_mu`: the lock `check` and `publish` run under. Borrowed.
  ChangeCommitter(Sink sink, absl::Mutex* catalog_mu);
  ChangeCommitter(const ChangeCommitter&) = delete;
  ChangeCommitter& operator=(const ChangeCommitter&) = delete;

  // One change: `check` (under the catalog lock) may refuse it, and then
  // nothing is journaled and no seq is used; else `record` gets the next
  // seq and reaches the sink, and `publish` (under the catalog lock; no
  // other change ran meanwhile) makes it visible.
  absl::Status Commit(StateRecord& record, absl::FunctionRef<absl::Status()> check,
                      absl::FunctionRef<void()> publish) ABSL_LOCKS_EXCLUDED(mu_);
  // The seq of the last committed change (0: none yet).
  uint64_t last_seq() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Constant after construction.
  const Sink sink_;
  absl::Mutex* const catalog_mu_;

  // Protected by mu_.
  mutable absl::Mutex mu_;
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_CHANGE_COMMITTER_H_
