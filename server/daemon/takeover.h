// The successor's side of a hand-over (--take-over; the conversation is in
// handover.h): begin it, check that what the running daemon hands over is
// what this daemon was told to serve (the same --state-dir, the same
// sockets), lend its listening sockets and checkpoints to this daemon's
// parts, restore before serving, confirm that this daemon serves exactly
// what the predecessor serves, and complete the switch.
//
// Not thread-safe; owned by the main thread (Daemon). Owns the
// conversation until Started() and the donated checkpoints for its life:
// the service borrows them (WeightServiceOptions::donated), so a TakeOver
// must outlive the service.
#ifndef WEIGHTD_SERVER_DAEMON_TAKEOVER_H_
#define WEIGHTD_SERVER_DAEMON_TAKEOVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/fd.h"
#include "server/daemon/daemon_flags.h"
#include "server/daemon/handover.h"
#include "server/daemon/restore.h"
#include "server/engine/weight_service.h"
#include "server/state/state_dir.h"
#include "server/state/state_journal.h"
#include "server/store/checkpoint.h"

namespace weightd {

// Lease ids the predecessor's calls in flight at the switch may still
// grant past the number it reported.
inline constexpr uint64_t kLeaseIdMargin = 1u << 16;

class TakeOver {
 public:
  // Begins a hand-over from the daemon offering one at `at` (BEGIN, then
  // its manifest and fds). Null when none offers one there (take_over_none
  // logged: the daemon starts as usual). The predecessor's refusal as it
  // came (HandoverClient::Begin); FAILED_PRECONDITION when it journals in
  // another directory than `state_dir` or serves other sockets than
  // `flags` name (a different --socket would advertise paths nobody
  // serves). Logs take_over_begin.
  static absl::StatusOr<std::unique_ptr<TakeOver>> Begin(const HandoverSocket& at,
                                                         const StateDir& state_dir,
                                                         const DaemonFlags& flags);

  // Lends the predecessor's listening sockets and checkpoints to the parts
  // (flags->grpc, flags->data: owned by those servers once they start;
  // flags->service.donated: borrowed from this object). Once.
  void LendTo(DaemonFlags* flags);
  // The predecessor's hand-over socket, already listening: this daemon
  // serves its own successor on it. Once (any time, Started() included).
  UniqueFd TakeHandoverListenFd();
  // The predecessor's host when it is not this one (a pod this daemon
  // replaced: it does not hand back to it); "" otherwise.
  const std::string& from_host() const { return from_host_; }

  // The journal's state, restored before this daemon serves (RestoreState;
  // the predecessor serves meanwhile), its checkpoints adopted, not read.
  // Logs take_over_restored unless interrupted.
  RestoreReport Restore(WeightService& service, const RestorePlan& plan, StateJournal* journal,
                        const std::function<bool()>& stop, uint64_t floor_margin);
  // After the restore and the preloads: drops the checkpoints no model took
  // (take_over_unused), then CheckRestoredAll and CheckServesAsPredecessor
  // (startup.h).
  absl::Status Confirm(const WeightService& service, const RestoreReport& restored);
  // READY, then GO: the predecessor stops serving; this daemon's lease ids
  // continue past its (and kLeaseIdMargin).
  absl::Status Ready(WeightService& service);
  // STARTED, then DONE: the predecessor exits and the conversation ends.
  // UNAVAILABLE when it did not confirm (it may be serving again: this
  // daemon must exit, leaving the socket files).
  absl::Status Started();

 private:
  TakeOver(std::unique_ptr<HandoverClient> client, AdoptVerify verify);
  // The sockets handed over are the ones `flags` name.
  absl::Status CheckSockets(const DaemonFlags& flags) const;

  // Owned by the main thread.
  std::unique_ptr<HandoverClient> client_;  // the conversation; null after Started()
  std::unique_ptr<DonatedCheckpoints> donated_;
  UniqueFd handover_listen_fd_;  // until TakeHandoverListenFd()
  std::string from_host_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_TAKEOVER_H_
