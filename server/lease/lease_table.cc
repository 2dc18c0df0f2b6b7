#include "server/lease/lease_table.h"

#include <sys/random.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

LeaseToken RandomToken() {
  LeaseToken token;
  size_t done = 0;
  while (done < token.size()) {
    ssize_t n = ::getrandom(token.data() + done, token.size() - done, 0);
    if (n > 0) done += static_cast<size_t>(n);
  }
  return token;
}

bool TokenEquals(const LeaseToken& a, absl::string_view b) {
  if (b.size() != a.size()) return false;
  unsigned char diff = 0;  // constant time
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ static_cast<uint8_t>(b[i]);
  return diff == 0;
}

}  // namespace

LeaseGrant LeaseTable::Grant(LeaseContents contents) {
  LeaseGrant grant;
  grant.token = RandomToken();
  auto shared = std::make_shared<const LeaseContents>(std::move(contents));
  absl::MutexLock lock(&mu_);
  grant.id = next_id_++;
  leases_[grant.id] = Lease{grant.token, std::move(shared), 0, absl::Now() + idle_ttl_};
  return grant;
}

absl::StatusOr<LeaseTable::Lease*> LeaseTable::FindLocked(uint64_t id,
                                                          absl::string_view token) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return UnknownLocked(id);
  if (!TokenEquals(it->second.token, token)) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for lease ", id));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const LeaseContents>> LeaseTable::Use(
    uint64_t id, absl::string_view token) {
  absl::MutexLock lock(&mu_);
  auto lease = FindLocked(id, token);
  if (!lease.ok()) return lease.status();
  if ((*lease)->connection == 0) (*lease)->deadline = absl::Now() + idle_ttl_;
  return (*lease)->contents;
}

absl::StatusOr<std::shared_ptr<const LeaseContents>> LeaseTable::Peek(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return UnknownLocked(id);
  return it->second.contents;
}

absl::StatusOr<std::shared_ptr<const LeaseContents>> LeaseTable::Attach(
    uint64_t id, absl::string_view token, uint64_t connection, bool for_push) {
  absl::MutexLock lock(&mu_);
  auto lease = FindLocked(id, token);
  if (!lease.ok()) return lease.status();
  if (!for_push && (*lease)->contents->push_only) {
    return absl::FailedPreconditionError(absl::StrCat(
        "lease ", id, " was fetched for a push (defer_casts): its tensors are cast as they are "
        "pushed, so its segments are not attached; push it, or fetch without defer_casts"));
  }
  if ((*lease)->connection != 0 && (*lease)->connection != connection) {
    return absl::FailedPreconditionError(
        absl::StrCat("lease ", id, " is already attached to another connection"));
  }
  (*lease)->connection = connection;
  (*lease)->deadline = absl::InfiniteFuture();
  return (*lease)->contents;
}

absl::Status LeaseTable::UnknownLocked(uint64_t id) const {
  if (id > 0 && id < inherited_below_) {
    return absl::UnavailableError(absl::StrCat(
        "lease ", id, " was granted by the daemon this one took over from (hand-over); "
        "fetch again"));
  }
  return absl::NotFoundError(absl::StrCat("lease ", id, " is unknown or has ended"));
}

void LeaseTable::InheritIdsBelow(uint64_t predecessor_next) {
  absl::MutexLock lock(&mu_);
  inherited_below_ = std::max(inherited_below_, predecessor_next);
  next_id_ = std::max(next_id_, predecessor_next);
}

uint64_t LeaseTable::next_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

absl::Status LeaseTable::Release(uint64_t id, absl::string_view token) {
  std::vector<std::shared_ptr<const LeaseContents>> dropped;
  {
    absl::MutexLock lock(&mu_);
    if (id > 0 && id < inherited_below_ && !leases_.contains(id)) {
      return absl::OkStatus();  // the predecessor's: nothing held here
    }
    auto lease = FindLocked(id, token);
    if (!lease.ok()) return lease.status();
    dropped.push_back(std::move((*lease)->contents));
    leases_.erase(id);
  }
  Drop(std::move(dropped));
  return absl::OkStatus();
}

size_t LeaseTable::ReleaseConnection(uint64_t connection) {
  return EndWhere([connection](const Lease& l) { return l.connection == connection; });
}

size_t LeaseTable::Expire(absl::Time now) {
  return EndWhere([now](const Lease& l) { return l.deadline <= now; });
}

size_t LeaseTable::EndWhere(const std::function<bool(const Lease&)>& ends) {
  std::vector<std::shared_ptr<const LeaseContents>> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = leases_.begin(); it != leases_.end();) {
      auto cur = it++;
      if (ends(cur->second)) {
        dropped.push_back(std::move(cur->second.contents));
        leases_.erase(cur);
      }
    }
  }
  const size_t n = dropped.size();
  Drop(std::move(dropped));
  return n;
}

void LeaseTable::Drop(std::vector<std::shared_ptr<const LeaseContents>> dropped) {
  if (disposer_ == nullptr) return;  // freed here, as `dropped` goes
  for (std::shared_ptr<const LeaseContents>& contents : dropped) {
    if (contents == nullptr) continue;
    // What letting go would free: the segments only this lease still holds.
    // (A racing weak_ptr lock can only make the estimate high; the drop is
    // safe on either thread.)
    uint64_t bytes = 0;
    if (contents.use_count() == 1) {
      for (const BufferPtr& seg : contents->buffers) {
        if (seg != nullptr && seg.use_count() == 1) bytes += seg->size();
      }
    }
    disposer_->Dispose(std::move(contents), bytes);
  }
}

size_t LeaseTable::CountFor(absl::string_view model, uint64_t generation) const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, lease] : leases_) {
    if (lease.contents->model == model && lease.contents->generation == generation) ++n;
  }
  return n;
}

size_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

}  // namespace weightd
