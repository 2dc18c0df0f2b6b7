#include "server/service/fetch_table_cache.h"

namespace weightd {

std::optional<FetchTableCache::Hit> FetchTableCache::Lookup(
    const std::string& key, const std::shared_ptr<const void>& generation) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  const Entry& e = it->second;
  Hit hit;
  bool live = e.generation.lock() == generation;
  for (size_t i = 0; live && i < e.buffers.size(); ++i) {
    BufferPtr buffer = e.buffers[i].lock();
    live = buffer != nullptr;
    hit.buffers.push_back(std::move(buffer));
  }
  if (!live) {  // an older generation under the same number, or evicted
    entries_.erase(it);
    return std::nullopt;
  }
  hit.table = e.table;
  hit.guards = e.guards;
  return hit;
}

void FetchTableCache::Store(std::string key, const std::shared_ptr<const void>& generation,
                            std::shared_ptr<const FetchTable> table,
                            const std::vector<BufferPtr>& buffers,
                            std::vector<ReadGuard> guards) {
  Entry entry;
  entry.generation = generation;
  entry.table = std::move(table);
  entry.buffers.assign(buffers.begin(), buffers.end());
  entry.guards = std::move(guards);
  absl::MutexLock lock(&mu_);
  absl::erase_if(entries_, [](const auto& kv) {
    if (kv.second.generation.expired()) return true;
    for (const auto& s : kv.second.buffers) {
      if (s.expired()) return true;
    }
    return false;
  });
  if (entries_.size() >= capacity_) entries_.clear();
  entries_.insert_or_assign(std::move(key), std::move(entry));
}

size_t FetchTableCache::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace weightd
