#include "server/publish/publish_session.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "common/status_macros.h"

namespace weightd {

std::string PublishSession::Describe() const {
  return absl::StrCat("publish session ", id, " of model \"", model, "\"");
}

void PublishSession::FailLocked(absl::Status why) {
  if (state == State::kDone || state == State::kFailed) return;
  state = State::kFailed;
  failure = std::move(why);
  ended = absl::Now();
  EndedLocked();
  changed.SignalAll();
  LogEvent(LogLevel::kWarning, "publish_failed",
           {{"model", model}, {"session", absl::StrCat(id)}, {"error", failure.ToString()}});
}

void PublishSession::EndedLocked() {
  if (holds_slot) slots->Release(caller_key);
  holds_slot = false;
  if (writers == 0) DropLocked();
}

void PublishSession::DropLocked() {
  staging.reset();
  coverage.clear();
  coverage.shrink_to_fit();
  coverage_ranges = 0;
  if (coverage_charged > 0) account->Return(coverage_charged);
  coverage_charged = 0;
  specs.clear();
  specs.shrink_to_fit();
  layout = PublishLayout();
  metadata.reset();
}

absl::Status PublishSession::NotOpenLocked() const {
  switch (state) {
    case State::kOpen:
      return absl::OkStatus();
    case State::kCommitting:
      return absl::FailedPreconditionError(
          absl::StrCat(Describe(), " has every byte and is being committed"));
    case State::kDone:
      return absl::FailedPreconditionError(absl::StrCat(
          Describe(), " is complete (generation ", result->generation.generation, ")"));
    case State::kFailed:
      return absl::Status(failure.code(),
                          absl::StrCat(Describe(), " ended: ", failure.message()));
  }
  return absl::InternalError("unknown session state");
}

absl::Status PublishSession::CheckOpenLocked() {
  WD_RETURN_IF_ERROR(NotOpenLocked());
  ExpireLocked(absl::Now());
  return NotOpenLocked();
}

void PublishSession::ExpireLocked(absl::Time now) {
  if (state != State::kOpen) return;
  if (now > deadline) {
    FailLocked(absl::DeadlineExceededError(absl::StrCat(
        "not complete by its deadline; missing ", FirstMissingLocked(),
        "; nothing was published")));
  } else if (idle_timeout > absl::ZeroDuration() && writers == 0 && waiters == 0 &&
             now - last_active > idle_timeout) {
    FailLocked(absl::DeadlineExceededError(absl::StrCat(
        "idle for over ", absl::FormatDuration(idle_timeout),
        " (no write, stage or waiting commit; --publish-idle-seconds); missing ",
        FirstMissingLocked(), "; nothing was published")));
  }
}

std::string PublishSession::FirstMissingLocked() const {
  for (size_t i = 0; i < coverage.size(); ++i) {
    auto gap = coverage[i].FirstGap();
    if (gap.has_value()) {
      return absl::StrCat("tensor \"", specs[i].name, "\" bytes [", gap->first, ", ",
                          gap->second, ")");
    }
  }
  return "nothing";
}

absl::Status PublishSession::AddRunsLocked(absl::Span<const PublishRun> runs,
                                           uint64_t data_size, uint64_t total, bool overflow,
                                           bool in_place) {
  absl::Status bad;
  if (in_place) {
    if (!handed_out) {
      // Not the publisher lying: nothing was written. The session stays open.
      return absl::FailedPreconditionError(absl::StrCat(
          Describe(), ": runs declared written in place, but no writer has taken its "
          "staging memfd (a StageRequest on the data socket)"));
    }
    if (data_size != 0 || overflow) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "a write declared in place carries ", data_size, " bytes of data"));
    }
  } else if (overflow || total != data_size) {
    bad = absl::InvalidArgumentError(absl::StrCat("a write's runs add up to ", total,
                                                  " bytes but it carries ", data_size));
  }
  for (size_t i = 0; i < runs.size() && bad.ok(); ++i) {
    const PublishRun& r = runs[i];
    if (r.tensor >= specs.size()) {
      bad = absl::InvalidArgumentError(absl::StrCat("a write names tensor index ", r.tensor,
                                                    "; the session has ", specs.size()));
      break;
    }
    RangeCoverage& c = coverage[r.tensor];
    const size_t before = c.ranges();
    absl::Status added = c.Add(r.offset, r.length);
    coverage_ranges = coverage_ranges + c.ranges() - before;
    if (!added.ok()) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("tensor \"", specs[r.tensor].name, "\": ", added.message()));
    }
  }
  if (!bad.ok()) {
    // What was written is not trusted.
    FailLocked(bad);
    return NotOpenLocked();
  }
  ++writers;
  return absl::OkStatus();
}

absl::Status PublishSession::StagingFault(uint64_t offset) const {
  return absl::FailedPreconditionError(absl::StrCat(
      "staging page at offset ", offset / page_bytes * page_bytes,
      " could not be faulted in: a writer of its memfd punched it out, or the huge-page "
      "pool is exhausted; nothing was published"));
}

}  // namespace weightd
