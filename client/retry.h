// The C++ client's retry loop (ClientOptions::retry_deadline): a call is
// made again while it fails with one of the policy's retry codes
// (kRetryCodes: UNAVAILABLE — daemon down, draining, restarting on the same
// sockets — and the CANCELLED a draining daemon answers calls that arrive on
// an open connection before any handler runs; the client cancels none of
// the calls it retries itself), after an exponential backoff with +-jitter,
// until the deadline has passed. Stateless but for a per-thread random
// source; thread-safe.
#ifndef WEIGHTD_CLIENT_RETRY_H_
#define WEIGHTD_CLIENT_RETRY_H_

#include <algorithm>
#include <random>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client_policy.h"

namespace weightd {

// Whether `s` fails with one of kRetryCodes.
inline bool Retryable(const absl::Status& s) {
  return std::find(std::begin(kRetryCodes), std::end(kRetryCodes), s.code()) !=
         std::end(kRetryCodes);
}

namespace retry_internal {
inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace retry_internal

// attempt(), again while it fails Retryable() and `deadline` has not
// passed; zero or less: once. Giving up turns the last failure into
// UNAVAILABLE "<message> (gave up after N attempts in T)".
template <typename F>
auto Retrying(absl::Duration deadline, F attempt) -> decltype(attempt()) {
  auto result = attempt();
  if (deadline <= absl::ZeroDuration()) return result;
  const absl::Time start = absl::Now();
  const absl::Time end = start + deadline;
  thread_local std::minstd_rand rng(std::random_device{}());
  std::uniform_real_distribution<double> jitter(1 - kRetryJitter, 1 + kRetryJitter);
  double backoff = kRetryInitialBackoffS;
  int tries = 1;
  while (Retryable(retry_internal::StatusOf(result))) {
    absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) {
      absl::Status s = retry_internal::StatusOf(result);
      return absl::UnavailableError(absl::StrCat(s.message(), " (gave up after ", tries,
                                                 " attempts in ",
                                                 absl::FormatDuration(absl::Now() - start), ")"));
    }
    absl::SleepFor(std::min(left, absl::Seconds(backoff * jitter(rng))));
    backoff = std::min(backoff * kRetryMultiplier, kRetryMaxBackoffS);
    result = attempt();
    ++tries;
  }
  return result;
}

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_RETRY_H_
