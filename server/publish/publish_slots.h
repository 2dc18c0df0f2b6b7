// Caps on open publish sessions (--max-publish-sessions,
// --max-publish-sessions-per-caller): each open session holds a memfd, a
// mapping and its staging memory until it ends, so one caller must not be
// able to open them without bound and take the daemon's file descriptors
// from everyone else.
//
// A session takes a slot for its caller when it begins and gives it back
// when it ends (committed, failed, aborted, expired). Thread-safe; its lock
// is a leaf (nothing else is taken under it), so slots may be given back
// under a session's own lock.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_SLOTS_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_SLOTS_H_

#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

class PublishSlots {
 public:
  struct Limits {
    size_t total = 64;       // open sessions in all; 0 = no cap
    size_t per_caller = 8;   // open sessions of one caller; 0 = no cap
  };
  explicit PublishSlots(Limits limits) : limits_(limits) {}

  // Takes a slot for `caller` (a key naming it; "" = the daemon itself,
  // under the total cap only). RESOURCE_EXHAUSTED when it would pass a cap,
  // naming the cap, `who` (the caller, in words) and the flag that raises
  // it; nothing is taken then.
  absl::Status Acquire(const std::string& caller, absl::string_view who)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back a slot Acquire took for `caller`.
  void Release(const std::string& caller) ABSL_LOCKS_EXCLUDED(mu_);

  size_t open() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t open_by(const std::string& caller) const ABSL_LOCKS_EXCLUDED(mu_);
  const Limits& limits() const { return limits_; }

 private:
  const Limits limits_;
  mutable absl::Mutex mu_;
  size_t open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, size_t> by_caller_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_SLOTS_H_
