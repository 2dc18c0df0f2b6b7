#include "server/push/export_cache.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {

ExportHold& ExportHold::operator=(ExportHold&& other) noexcept {
  if (this != &other) {
    Reset();
    cache_ = std::exchange(other.cache_, nullptr);
    entry_ = other.entry_;
    holder_ = other.holder_;
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

void ExportHold::Reset() {
  if (cache_ == nullptr) return;
  // The buffer may be freed by Release (a dead table's): drop our reference
  // first, so that the cache's is the last one.
  buffer_.reset();
  std::exchange(cache_, nullptr)->Release(entry_, holder_);
}

uint64_t ExportCache::EvictUnheldLocked(
    const std::string& device, uint64_t bytes, size_t buffers,
    std::vector<std::shared_ptr<const ExportedBuffer>>* dropped) {
  // Dead tables' buffers first (nobody can be handed them again), then the
  // least recently used.
  std::vector<std::map<uint64_t, Entry>::iterator> unheld;
  for (auto e = entries_.begin(); e != entries_.end(); ++e) {
    if (e->second.holds == 0 && (device.empty() || e->second.device == device)) {
      unheld.push_back(e);
    }
  }
  std::sort(unheld.begin(), unheld.end(), [](const auto& a, const auto& b) {
    const bool a_dead = a->second.table.expired(), b_dead = b->second.table.expired();
    if (a_dead != b_dead) return a_dead;
    return a->second.last_use < b->second.last_use;
  });
  uint64_t freed = 0;
  size_t removed = 0;
  for (auto& e : unheld) {
    if (freed >= bytes && removed >= buffers) break;
    ++removed;
    freed += e->second.buffer->size;
    dropped->push_back(std::move(e->second.buffer));
    entries_.erase(e);
    ++stats_.evictions;
  }
  return freed;
}

void ExportCache::DropDeadLocked(std::vector<std::shared_ptr<const ExportedBuffer>>* dropped) {
  for (auto e = entries_.begin(); e != entries_.end();) {
    if (e->second.holds == 0 && e->second.table.expired()) {
      dropped->push_back(std::move(e->second.buffer));
      e = entries_.erase(e);
    } else {
      ++e;
    }
  }
}

ExportCache::Usage ExportCache::UsageLocked(const ExportRequest& request) {
  // What the holder holds on this device now, each buffer once.
  Usage usage{.hit = entries_.end()};
  for (auto e = entries_.begin(); e != entries_.end(); ++e) {
    Entry& entry = e->second;
    const bool mine = entry.holders.count(request.holder) > 0;
    usage.mine_buffers += mine ? 1 : 0;
    if (entry.device != request.device) continue;
    usage.used += entry.buffer->size;
    if (mine) usage.mine_bytes += entry.buffer->size;
    if (entry.key == request.table.get() && entry.table.lock() == request.table) usage.hit = e;
  }
  return usage;
}

absl::Status ExportCache::CheckShareLocked(const ExportRequest& request, const Usage& usage) {
  const bool cached = usage.hit != entries_.end();
  if (cached && usage.hit->second.holders.count(request.holder)) return absl::OkStatus();
  const uint64_t size = cached ? usage.hit->second.buffer->size : request.size;
  if (usage.mine_bytes + size > request.holder_bytes) {
    return RefuseLocked(absl::StrCat(
        "uid ", request.holder, " holds ", usage.mine_bytes, " bytes of exported buffers on ",
        request.device, "; another of ", size, " would pass its share (--max-export-bytes-per-uid: ",
        request.holder_bytes, "); close exports it no longer needs"));
  }
  if (usage.mine_buffers >= options_.max_buffers_per_holder) {
    return RefuseLocked(absl::StrCat("uid ", request.holder, " holds ", usage.mine_buffers,
                                     " exported buffers, the daemon's limit per uid (",
                                     options_.max_buffers_per_holder,
                                     "); close exports it no longer needs"));
  }
  return absl::OkStatus();
}

absl::Status ExportCache::MakeRoomLocked(
    const ExportRequest& request, uint64_t used,
    std::vector<std::shared_ptr<const ExportedBuffer>>* dropped) {
  const std::string& device = request.device;
  if (request.size > request.device_bytes) {
    return RefuseLocked(absl::StrCat("an export of ", request.size, " bytes to ", device,
                                     " exceeds --device-memory-bytes (", request.device_bytes,
                                     " for ", device, ")"));
  }
  if (used + request.size > request.device_bytes) {
    used -= EvictUnheldLocked(device, used + request.size - request.device_bytes, 0, dropped);
  }
  if (used + request.size > request.device_bytes) {
    return RefuseLocked(absl::StrCat("an export of ", request.size, " bytes to ", device,
                                     " does not fit --device-memory-bytes (",
                                     request.device_bytes, " for ", device, "): ", used,
                                     " bytes are held by clients' open exports"));
  }
  if (entries_.size() + 1 > options_.max_buffers) {
    EvictUnheldLocked("", 0, entries_.size() + 1 - options_.max_buffers, dropped);
  }
  if (entries_.size() + 1 > options_.max_buffers) {
    return RefuseLocked(absl::StrCat("clients' open exports hold ", entries_.size(),
                                     " buffers, the daemon's limit (", options_.max_buffers,
                                     "; each keeps an fd)"));
  }
  return absl::OkStatus();
}

ExportHold ExportCache::HoldLocked(Entries::iterator hit, uid_t holder) {
  Entry& entry = hit->second;
  entry.last_use = ++clock_;
  ++entry.holders[holder];
  ++entry.holds;
  ++stats_.hits;
  return ExportHold(this, hit->first, holder, entry.buffer);
}

ExportHold ExportCache::InsertLocked(const ExportRequest& request,
                                     std::shared_ptr<const ExportedBuffer> buffer) {
  const uint64_t id = next_id_++;
  Entry& entry = entries_[id];
  entry.table = request.table;
  entry.key = request.table.get();
  entry.device = request.device;
  entry.buffer = buffer;
  entry.holders[request.holder] = 1;
  entry.holds = 1;
  entry.last_use = ++clock_;
  ++stats_.fills;
  return ExportHold(this, id, request.holder, std::move(buffer));
}

absl::StatusOr<ExportHold> ExportCache::Get(const ExportRequest& request, const Fill& fill,
                                            bool* filled) {
  if (filled != nullptr) *filled = false;
  std::vector<std::shared_ptr<const ExportedBuffer>> dropped;  // freed outside mu_
  absl::MutexLock fill_lock(&fill_mu_);
  {
    absl::MutexLock lock(&mu_);
    DropDeadLocked(&dropped);
    const Usage usage = UsageLocked(request);
    WD_RETURN_IF_ERROR(CheckShareLocked(request, usage));
    if (usage.hit != entries_.end()) return HoldLocked(usage.hit, request.holder);
    WD_RETURN_IF_ERROR(MakeRoomLocked(request, usage.used, &dropped));
  }
  dropped.clear();
  absl::StatusOr<std::unique_ptr<ExportedBuffer>> made = fill();
  if (!made.ok()) return made.status();
  std::shared_ptr<const ExportedBuffer> buffer(std::move(*made));
  if (filled != nullptr) *filled = true;
  absl::MutexLock lock(&mu_);
  return InsertLocked(request, std::move(buffer));
}

absl::Status ExportCache::RefuseLocked(std::string why) {
  ++stats_.refusals;
  return absl::ResourceExhaustedError(std::move(why));
}

void ExportCache::Release(uint64_t id, uid_t holder) {
  std::shared_ptr<const ExportedBuffer> dropped;  // freed outside mu_
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& entry = it->second;
  auto h = entry.holders.find(holder);
  if (h != entry.holders.end() && --h->second == 0) entry.holders.erase(h);
  if (--entry.holds == 0 && entry.table.expired()) {
    dropped = std::move(entry.buffer);
    entries_.erase(it);
  }
  // (`dropped` is destroyed after `lock`, declared before it.)
}

uint64_t ExportCache::Reclaim(const std::string& device, uint64_t bytes) {
  std::vector<std::shared_ptr<const ExportedBuffer>> dropped;  // freed outside mu_
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    freed = EvictUnheldLocked(device, bytes, 0, &dropped);
  }
  return freed;
}

uint64_t ExportCache::bytes(const std::string& device) const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [id, e] : entries_) {
    if (e.device == device) n += e.buffer->size;
  }
  return n;
}

uint64_t ExportCache::held_bytes(const std::string& device, uid_t holder) const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [id, e] : entries_) {
    if (e.device == device && e.holders.count(holder) > 0) n += e.buffer->size;
  }
  return n;
}

ExportCacheStats ExportCache::stats() const {
  absl::MutexLock lock(&mu_);
  ExportCacheStats s = stats_;
  for (const auto& [id, e] : entries_) {
    ++s.buffers;
    s.bytes += e.buffer->size;
    if (e.holds > 0) ++s.held;
  }
  return s;
}

}  // namespace weightd
