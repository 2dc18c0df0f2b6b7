// Pausing a listener's accept thread for a hand-over (server/state/handover.h):
// the successor accepts on the same listening socket meanwhile, so when
// Pause() returns this process accepts nothing more until Resume(). The
// accept thread polls the owner's eventfd `wake` beside the listen socket;
// Pause() and Resume() write it to break that poll. Thread-safe.
#ifndef WEIGHTD_SERVER_BASE_ACCEPT_PAUSE_H_
#define WEIGHTD_SERVER_BASE_ACCEPT_PAUSE_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

class AcceptPause {
 public:
  // `wake_fd`: the owner's eventfd, borrowed.
  explicit AcceptPause(int wake_fd) : wake_fd_(wake_fd) {}

  // Returns once the accept thread has seen the pause (no accept is in
  // progress from then on), or has exited. Idempotent.
  void Pause() ABSL_LOCKS_EXCLUDED(mu_);
  void Resume() ABSL_LOCKS_EXCLUDED(mu_);

  // The accept thread, before each poll: whether to accept now (records
  // that it saw a pause).
  bool AcceptAllowed() ABSL_LOCKS_EXCLUDED(mu_);
  // The accept thread, when it returns.
  void Exited() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Wake() const;

  const int wake_fd_;
  absl::Mutex mu_;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // the thread saw paused_
  bool exited_ ABSL_GUARDED_BY(mu_) = false;  // the thread has returned
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_BASE_ACCEPT_PAUSE_H_
