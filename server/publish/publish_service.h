// PublishService: runs publish sessions (weight_service.h, "Publishing new
// base weights"): begin (checks, caps, staging), write, stage (the staging
// memfd handed out for writing in place), commit (waiting for the last
// byte), abort, expiry, and the end of a model's sessions when it is
// unloaded. The commit itself — digests, diff, install — is the service's
// (Options::commit; publish_commit.h holds its phases).
//
// Thread-safe. Lock order: the catalog's lock (Catalog::mu_) ->
// PublishService::mu_; a session's own lock (PublishSession::mu) is taken
// alone, never with either, and Options::commit is called with none held.
//
// Owns: the sessions (open, and ended ones lingering for their result),
// the open-session slots, and the staging counters.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_SERVICE_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/fd.h"
#include "server/memory/host_memory.h"
#include "server/publish/publish_session.h"
#include "server/publish/publish_slots.h"
#include "server/publish/publish_types.h"
#include "server/publish/staging_reserve.h"
#include "server/auth/access_control.h"
#include "server/service/model.h"

namespace weightd {

class PublishService {
 public:
  struct Options {
    HostMemoryManager* memory = nullptr;  // borrowed
    const AccessPolicy* access = nullptr;  // borrowed
    StagingReserve* staging = nullptr;     // borrowed
    PublishSlots::Limits limits;
    // --publish-idle-seconds (zero: only the deadline ends a session).
    absl::Duration idle_timeout = absl::Minutes(5);
    // The model loaded as `name` now: NOT_FOUND when none.
    std::function<absl::StatusOr<std::shared_ptr<const Model>>(const std::string& name)>
        find_model;
    // Digests the staged tensors of a session whose every byte landed and
    // makes the generation (WeightService::CommitStaged); `caller` made the
    // call that committed it. Called with no lock held.
    std::function<absl::StatusOr<PublishResult>(PublishSession& session,
                                                const std::optional<Principal>& caller)>
        commit;
  };
  explicit PublishService(Options options);
  PublishService(const PublishService&) = delete;
  PublishService& operator=(const PublishService&) = delete;

  // WeightService::BeginPublish, WritePublish, StagePublish, CommitPublish
  // and AbortPublish: the contracts are written there.
  absl::StatusOr<PublishSessionInfo> Begin(const PublishBeginParams& params)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PublishProgress> Write(const std::optional<Principal>& caller, uint64_t id,
                                        absl::string_view token,
                                        absl::Span<const PublishRun> runs,
                                        absl::string_view data, bool in_place)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<UniqueFd> Stage(const std::optional<Principal>& caller, uint64_t id,
                                 absl::string_view token) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PublishResult> Commit(const std::optional<Principal>& caller, uint64_t id,
                                       absl::string_view token, absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Abort(const std::optional<Principal>& caller, uint64_t id,
                     absl::string_view token) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the sessions past their deadline or idle past the idle timeout,
  // and forgets those ended long enough ago (housekeeping calls it).
  void Expire() ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the open sessions of model instance `instance` (unload), and
  // drops its prepared staging.
  void EndSessionsOf(uint64_t instance, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Sessions not yet committed or ended.
  uint64_t OpenSessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Sessions begun on staging prepared ahead / allocated at begin.
  uint64_t staging_prepared() const { return staging_prepared_.load(); }
  uint64_t staging_allocated() const { return staging_allocated_.load(); }

 private:
  // What Begin learns of the specs: the bytes to write, the metadata to
  // charge, and the specs the profile shards part by part.
  struct SpecCheck {
    uint64_t bytes = 0;
    uint64_t metadata_bytes = 0;
    std::vector<std::string> per_part;
  };
  // Each spec must be a base tensor the model's generation `cur` serves,
  // as it stores it.
  static absl::StatusOr<SpecCheck> CheckSpecs(const Model& model, const Generation& cur,
                                              const PublishBeginParams& params);
  // The staging segment for `layout`: prepared ahead (`*took_ahead`) or
  // allocated now, faulted in.
  absl::StatusOr<std::unique_ptr<Segment>> AllocateStaging(const Model& model,
                                                           const PublishBeginParams& params,
                                                           uint64_t bytes, bool* took_ahead);
  // The session, for a caller with its token who may read its model.
  absl::StatusOr<std::shared_ptr<PublishSession>> Find(const std::optional<Principal>& caller,
                                                       uint64_t id, absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the commit for the session (kCommitting, every byte landed) and
  // records its end: kDone with the result, or failed.
  absl::StatusOr<PublishResult> CommitAndRecord(PublishSession& session,
                                                const std::optional<Principal>& caller);
  // The sessions, open or ended, as a list the caller may lock one by one.
  std::vector<std::shared_ptr<PublishSession>> Sessions() const ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  PublishSlots slots_;  // open sessions per caller and in all (a leaf lock of its own)
  std::atomic<uint64_t> staging_prepared_{0};
  std::atomic<uint64_t> staging_allocated_{0};

  // Protected by mu_.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<PublishSession>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_SERVICE_H_
