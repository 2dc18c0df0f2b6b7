#include "server/transport/export_cache.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace weightd {

absl::StatusOr<std::shared_ptr<const ExportedBuffer>> ExportCache::Get(
    const std::shared_ptr<const void>& table, const std::string& device, uint64_t size,
    const Fill& fill, bool* filled) {
  if (filled != nullptr) *filled = false;
  absl::MutexLock fill_lock(&fill_mu_);
  std::vector<std::shared_ptr<const ExportedBuffer>> dropped;  // freed outside mu_
  {
    absl::MutexLock lock(&mu_);
    const Key key{table.get(), device};
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      if (it->second.table.lock() == table) {
        it->second.last_use = ++clock_;
        ++stats_.hits;
        return it->second.buffer;
      }
      // A dead table's address reused: its buffer, if a connection still
      // holds it, keeps counting (as an orphan) until let go.
      if (it->second.buffer.use_count() > 1) {
        orphans_.emplace_back(device, std::move(it->second.buffer));
      } else {
        dropped.push_back(std::move(it->second.buffer));
      }
      entries_.erase(it);
    }
    for (auto o = orphans_.begin(); o != orphans_.end();) {
      if (o->second.use_count() == 1) {
        dropped.push_back(std::move(o->second));
        o = orphans_.erase(o);
      } else {
        ++o;
      }
    }
    // Room on the device: drop dead tables' buffers, then the least
    // recently used unheld ones.
    uint64_t used = 0;
    for (const auto& [dev, buffer] : orphans_) {
      if (dev == device) used += buffer->size;
    }
    std::vector<std::map<Key, Entry>::iterator> mine;
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (e->first.second != device) {
        ++e;
        continue;
      }
      if (e->second.table.expired() && e->second.buffer.use_count() == 1) {
        dropped.push_back(std::move(e->second.buffer));
        e = entries_.erase(e);
        ++stats_.evictions;
        continue;
      }
      used += e->second.buffer->size;
      mine.push_back(e);
      ++e;
    }
    if (budget_ != 0 && size > budget_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "an export of ", size, " bytes to ", device, " exceeds --device-memory-bytes (",
          budget_, ")"));
    }
    std::sort(mine.begin(), mine.end(),
              [](const auto& a, const auto& b) { return a->second.last_use < b->second.last_use; });
    for (auto& e : mine) {
      if (budget_ == 0 || used + size <= budget_) break;
      if (e->second.buffer.use_count() != 1) continue;  // held by a connection
      used -= e->second.buffer->size;
      dropped.push_back(std::move(e->second.buffer));
      entries_.erase(e);
      ++stats_.evictions;
    }
    if (budget_ != 0 && used + size > budget_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "an export of ", size, " bytes to ", device, " does not fit --device-memory-bytes (",
          budget_, "): ", used, " bytes are held by clients' open exports"));
    }
  }
  dropped.clear();
  absl::StatusOr<std::unique_ptr<ExportedBuffer>> made = fill();
  if (!made.ok()) return made.status();
  std::shared_ptr<const ExportedBuffer> buffer(std::move(*made));
  if (filled != nullptr) *filled = true;
  absl::MutexLock lock(&mu_);
  entries_[Key{table.get(), device}] = Entry{table, buffer, ++clock_};
  ++stats_.fills;
  return buffer;
}

uint64_t ExportCache::bytes(const std::string& device) const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [key, e] : entries_) {
    if (key.second == device) n += e.buffer->size;
  }
  for (const auto& [dev, buffer] : orphans_) {
    if (dev == device) n += buffer->size;
  }
  return n;
}

ExportCacheStats ExportCache::stats() const {
  absl::MutexLock lock(&mu_);
  ExportCacheStats s = stats_;
  for (const auto& [key, e] : entries_) {
    ++s.buffers;
    s.bytes += e.buffer->size;
  }
  for (const auto& [dev, buffer] : orphans_) {
    ++s.buffers;
    s.bytes += buffer->size;
  }
  return s;
}

}  // namespace weightd
