// PublishSession: one publish session's state machine and byte coverage
// (WeightService's publish calls, weight_service.h "Publishing new base
// weights"). The session stages its tensors in one segment of its own;
// writers record the runs they land (AddRunsLocked), copy without the lock
// into disjoint ranges, and the write that lands the last byte moves it to
// kCommitting; it ends kDone (with its result) or kFailed (with why), and
// an ended session gives back its slot at once and its memory once no copy
// is in progress.
//
// Thread-safe through its own leaf lock `mu`, taken alone: never while
// holding a service lock, and no service lock is taken while it is held.
// The fields under "Constant once shared" are set by the one thread that
// builds the session before it is registered (id included), and read
// without the lock from then on; `specs`, `layout` and `base` are cleared
// only by DropLocked, which runs when no copy is in progress.
//
// Owns: its staging segment (until the commit takes it or it ends), its
// coverage and their budget charges, and its open-session slot.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_SESSION_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"
#include "server/publish/publish_plan.h"
#include "server/publish/publish_slots.h"
#include "server/publish/publish_types.h"
#include "server/auth/access_control.h"

namespace weightd {

class PublishSession {
 public:
  enum class State { kOpen, kCommitting, kDone, kFailed };

  // "publish session <id> of model \"<model>\"", for messages.
  std::string Describe() const;
  // Ends the session with `why`: nothing of it becomes visible; its memory
  // goes once no copy is in progress.
  void FailLocked(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // What an ended session (done or failed) gives back: its slot at once,
  // its memory once no copy is in progress (DropLocked). What stays while
  // it lingers (kEndedSessionLinger) is its result or failure.
  void EndedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Frees an ended session's memory: the staging (unless the commit took
  // it), the coverage, the specs and layout and their charges. REQUIRES:
  // ended, and no copy in progress (copies read `layout` and `base` without
  // the lock; specs and layout are read without it only by those and by
  // the commit, which no one else ends).
  void DropLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The status of a call on a session that is no longer open.
  absl::Status NotOpenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // NotOpenLocked(), and a session past its deadline, or idle past its
  // idle timeout, fails now.
  absl::Status CheckOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Fails an open session past its deadline or idle too long.
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // "tensor \"x\" bytes [a, b)" of the first byte still missing.
  std::string FirstMissingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Records `runs` of a write carrying `data_size` bytes (their lengths
  // add up to `total`, or `overflow`ed) as landing, and counts the write in
  // progress; a write that lies about its bytes ends the session.
  absl::Status AddRunsLocked(absl::Span<const PublishRun> runs, uint64_t data_size,
                             uint64_t total, bool overflow, bool in_place)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Why a guarded access of the staging at `offset` failed.
  absl::Status StagingFault(uint64_t offset) const;

  // Constant once shared.
  uint64_t id = 0;
  std::string token;
  std::string model;
  // The model instance the session began on: a model unloaded and loaded
  // again under the same name meanwhile is another one (Model::instance).
  uint64_t model_instance = 0;
  // The model's own readers (fixed for the instance): every call on the
  // session checks its caller against them (FindPublish).
  std::vector<ReadGuard> model_guards;
  uint64_t expect_generation = 0;
  uint64_t base_generation = 0;
  std::vector<PublishTensorSpec> specs;
  PublishLayout layout;
  uint64_t bytes_total = 0;
  absl::Time start;
  absl::Time deadline;
  absl::Duration idle_timeout;  // zero: none
  uint8_t* base = nullptr;  // the staging segment's writable mapping
  uint64_t staging_bytes = 0;
  uint64_t page_bytes = 4096;  // of the staging's pages, for messages
  // Its open-session slot (PublishSlots), held until it ends, under
  // `caller_key`; its specs and layout, charged to the budget for its life.
  PublishSlots* slots = nullptr;
  std::string caller_key;
  // The budget its coverage's ranges are charged to as they grow.
  std::shared_ptr<MemoryAccount> account;

  // Own synchronization.
  absl::Mutex mu;  // a per-session leaf lock
  absl::CondVar changed;

  // Protected by mu.
  std::unique_ptr<MemoryCharge> metadata ABSL_GUARDED_BY(mu);
  std::unique_ptr<Segment> staging ABSL_GUARDED_BY(mu);  // until commit or failure
  std::vector<RangeCoverage> coverage ABSL_GUARDED_BY(mu);
  // Ranges the coverage holds, and the bytes charged for them (a high-water
  // mark with room for the runs being added).
  uint64_t coverage_ranges ABSL_GUARDED_BY(mu) = 0;
  uint64_t coverage_charged ABSL_GUARDED_BY(mu) = 0;
  uint64_t landed ABSL_GUARDED_BY(mu) = 0;  // bytes copied in
  // The staging memfd was handed out writable (StagePublish): the commit
  // must prove no one maps it any more (Segment::SealExclusive).
  bool handed_out ABSL_GUARDED_BY(mu) = false;
  int writers ABSL_GUARDED_BY(mu) = 0;      // copies in progress
  int waiters ABSL_GUARDED_BY(mu) = 0;      // CommitPublish calls waiting for it
  absl::Time last_active ABSL_GUARDED_BY(mu);  // of the last write, stage or commit call
  bool holds_slot ABSL_GUARDED_BY(mu) = false;
  State state ABSL_GUARDED_BY(mu) = State::kOpen;
  absl::Status failure ABSL_GUARDED_BY(mu);
  std::optional<PublishResult> result ABSL_GUARDED_BY(mu);
  // Who may be told the result: the guards of the generation it made.
  std::vector<ReadGuard> result_guards ABSL_GUARDED_BY(mu);
  absl::Time ended ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_SESSION_H_
