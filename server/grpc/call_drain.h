// Graceful shutdown of the gRPC service: counts the calls in flight so that
// SIGTERM can wait for them, and refuses new ones with UNAVAILABLE once the
// drain has begun (clients retry those against a restarted daemon).
//
// gRPC's own Server::Shutdown(deadline) also waits for every idle client
// connection to be closed by its client, which an idle Python channel does
// only seconds later; so the daemon waits for its calls here and then shuts
// the server down with an expired deadline, closing the idle connections.
#ifndef WEIGHTD_SERVER_GRPC_CALL_DRAIN_H_
#define WEIGHTD_SERVER_GRPC_CALL_DRAIN_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightd {

class CallDrain {
 public:
  // One call in flight, from Enter() until it is destroyed. Move-only.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept : drain_(other.drain_), change_(other.change_) {
      other.drain_ = nullptr;
    }
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Reset(); }
    void Reset();
    bool held() const { return drain_ != nullptr; }

   private:
    friend class CallDrain;
    Hold(CallDrain* drain, bool change) : drain_(drain), change_(change) {}
    CallDrain* drain_ = nullptr;
    bool change_ = false;
  };

  // A hold on a new call, or UNAVAILABLE once BeginDrain() has been called.
  // `change`: the call changes what is served (loads, unloads, applies);
  // refused while SetChangesClosed holds a status.
  absl::StatusOr<Hold> Enter(bool change = false) ABSL_LOCKS_EXCLUDED(mu_);
  // UNAVAILABLE once draining, else OK: for calls that finish at once.
  absl::Status CheckOpen() const ABSL_LOCKS_EXCLUDED(mu_);
  // From now on Enter() and CheckOpen() refuse. Idempotent.
  void BeginDrain() ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const ABSL_LOCKS_EXCLUDED(mu_);
  // While `closed` is not OK, Enter() and CheckOpen() refuse with it (the
  // daemon restoring its state); OK reopens. Draining takes precedence.
  void SetClosed(absl::Status closed) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for calls that change what is served only.
  void SetChangesClosed(absl::Status closed) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no hold is left or `deadline` passes; returns how many are
  // left (0 = drained).
  int64_t WaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t in_flight() const ABSL_LOCKS_EXCLUDED(mu_);
  // As WaitIdle, for the calls that change what is served (a hand-over
  // closes changes, then waits for these before it describes the state).
  int64_t WaitChangesIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  static absl::Status DrainingError();

 private:
  void Exit(bool change) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  absl::Status changes_closed_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t changes_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_CALL_DRAIN_H_
