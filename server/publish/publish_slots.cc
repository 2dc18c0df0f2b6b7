#include "server/publish/publish_slots.h"

#include "absl/strings/str_cat.h"

namespace weightd {

absl::Status PublishSlots::Acquire(const std::string& caller, absl::string_view who) {
  absl::MutexLock lock(&mu_);
  if (limits_.total != 0 && open_ >= limits_.total) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon holds ", open_, " open publish sessions, the most it allows "
        "(--max-publish-sessions); commit or abort one, wait for one to end, or raise the flag"));
  }
  if (!caller.empty() && limits_.per_caller != 0) {
    auto it = by_caller_.find(caller);
    const size_t mine = it == by_caller_.end() ? 0 : it->second;
    if (mine >= limits_.per_caller) {
      return absl::ResourceExhaustedError(absl::StrCat(
          who, " holds ", mine, " open publish sessions, the most one caller may "
          "(--max-publish-sessions-per-caller); commit or abort one, or raise the flag"));
    }
  }
  ++open_;
  if (!caller.empty()) ++by_caller_[caller];
  return absl::OkStatus();
}

void PublishSlots::Release(const std::string& caller) {
  absl::MutexLock lock(&mu_);
  if (open_ > 0) --open_;
  if (caller.empty()) return;
  auto it = by_caller_.find(caller);
  if (it == by_caller_.end()) return;
  if (--it->second == 0) by_caller_.erase(it);
}

size_t PublishSlots::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

size_t PublishSlots::open_by(const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  auto it = by_caller_.find(caller);
  return it == by_caller_.end() ? 0 : it->second;
}

}  // namespace weightd
