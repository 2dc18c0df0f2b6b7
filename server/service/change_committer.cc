#include "server/service/change_committer.h"

#include <utility>

#include "common/status_macros.h"

namespace weightd {

ChangeCommitter::ChangeCommitter(Sink sink, absl::Mutex* catalog_mu)
    : sink_(std::move(sink)), catalog_mu_(catalog_mu) {}

absl::Status ChangeCommitter::Commit(StateRecord& record,
                                     absl::FunctionRef<absl::Status()> check,
                                     absl::FunctionRef<void()> publish) {
  absl::MutexLock state(&mu_);
  {
    absl::MutexLock lock(catalog_mu_);
    WD_RETURN_IF_ERROR(check());
  }
  record.seq = ++seq_;
  if (sink_) sink_(record);
  absl::MutexLock lock(catalog_mu_);
  publish();
  return absl::OkStatus();
}

uint64_t ChangeCommitter::last_seq() const {
  absl::MutexLock lock(&mu_);
  return seq_;
}

}  // namespace weightd
