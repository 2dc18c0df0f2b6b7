// StagingReserve: staging prepared ahead for a model's next publish
// (--publish-staging-ahead). After a model's publish commits, a segment of
// the size it staged is allocated and faulted in on the reserve's own
// thread (the stager), while the budget has room for it without evicting
// anything; a session of that size takes it at begin. The memory manager
// takes the prepared segments back first when short (a reclaimer at the
// warm reserve's rank), and the service's housekeeping frees those unused
// for a while.
//
// Thread-safe. Its lock is a leaf: nothing else is taken while it is held
// (segments are allocated and freed outside it).
//
// Owns: the prepared segments, the stager thread and its reclaimer.
#ifndef WEIGHTD_SERVER_PUBLISH_STAGING_RESERVE_H_
#define WEIGHTD_SERVER_PUBLISH_STAGING_RESERVE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"

namespace weightd {

class StagingReserve {
 public:
  struct Options {
    // False: nothing is ever prepared (no thread, no reclaimer).
    bool enabled = true;
    // Where the segments are allocated and charged. Borrowed; outlives the
    // reserve.
    HostMemoryManager* memory = nullptr;
    // Whether model `name` instance `instance` is still loaded: nothing is
    // prepared for a model unloaded since its publish. Called on the
    // stager thread with no lock held.
    std::function<bool(const std::string& name, uint64_t instance)> still_loaded;
  };
  explicit StagingReserve(Options options);
  // Stop().
  ~StagingReserve();
  StagingReserve(const StagingReserve&) = delete;
  StagingReserve& operator=(const StagingReserve&) = delete;

  // Asks the stager for a segment of `bytes` for `instance`'s next publish
  // (of model `model`); another size wanted before frees the one prepared.
  void Want(const std::string& model, uint64_t instance, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The prepared segment for `instance` if it is `bytes` long, else null
  // (one of another size is freed). One the stager is faulting in now is
  // waited for, up to 10 seconds (a trainer that publishes again at once),
  // rather than allocated a second time. The stager prepares the next one
  // after the session commits (Want).
  std::unique_ptr<Segment> Take(uint64_t instance, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `instance` (its model was unloaded), freeing what was prepared.
  void Drop(uint64_t instance) ABSL_LOCKS_EXCLUDED(mu_);
  // Frees the prepared segments unused for `idle` or more (the memory
  // manager's reclaimer: all of them; housekeeping: those unused 10
  // minutes). Nothing is prepared again for them before their model's next
  // publish. Returns the bytes freed.
  uint64_t Reclaim(absl::Duration idle = absl::ZeroDuration()) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes prepared and waiting now.
  uint64_t Bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the stager, removes the reclaimer and frees everything prepared.
  // Idempotent; REQUIRES: no concurrent Want/Take afterwards.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Per model instance: the size its last publish staged and, once the
  // stager made it, a segment of that size, faulted in.
  struct Entry {
    std::string model;
    uint64_t bytes = 0;
    std::unique_ptr<Segment> segment;
    bool in_flight = false;  // the stager is allocating it now
    absl::Time ready_at;     // when the segment was made
  };
  void StagerLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the next entry that wants a segment in flight and tells which;
  // false when none does.
  bool NextWantedLocked(uint64_t* instance, uint64_t* bytes, std::string* model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Files what the stager made for `instance` (or drops it, when the entry
  // was taken, dropped or resized meanwhile).
  void FinishMaking(uint64_t instance, uint64_t bytes,
                    absl::StatusOr<std::unique_ptr<Segment>> segment) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  std::thread stager_;
  uint64_t reclaimer_ = 0;  // the memory manager's id for Reclaim; 0 = none

  // Protected by mu_.
  mutable absl::Mutex mu_;  // a leaf
  absl::CondVar wanted_;    // an entry wants a segment, or stop
  absl::CondVar ready_;     // an in-flight entry was made, dropped or failed
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_STAGING_RESERVE_H_
