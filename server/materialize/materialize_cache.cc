#include "server/materialize/materialize_cache.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace weightd {
namespace {

void AppendFloat(std::string* key, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  absl::StrAppend(key, bits, ";");
}

}  // namespace

std::string MaterializeCache::Key(const MaterializeItem& item, const std::string& scope) {
  // The scope first, length-prefixed: entries of different scopes never
  // meet, whatever the rest of the key holds.
  std::string key = absl::StrCat(scope.size(), "#", scope, "|", static_cast<int>(item.out_dtype), "|");
  if (item.scalar.has_value()) {
    key += "scalar:";
    AppendFloat(&key, *item.scalar);
    return key;
  }
  if (item.fp8_scale.has_value()) {
    key += "fp8:";
    AppendFloat(&key, *item.fp8_scale);
  }
  for (const PartSlice& s : item.slices) {
    if (s.stored != nullptr) {
      absl::StrAppend(&key, "P", s.stored->digest.Hex(), ":", static_cast<int>(s.stored->dtype));
    } else {
      absl::StrAppend(&key, "Z", static_cast<int>(s.dtype));
    }
    absl::StrAppend(&key, "[", absl::StrJoin(s.shape, ","), "]@[", absl::StrJoin(s.box.offset, ","),
                    "]+[", absl::StrJoin(s.box.shape, ","), "]");
    for (const AppliedPatch& p : s.patches) {
      absl::StrAppend(&key, "{", p.patch->CacheKey(), "*");
      AppendFloat(&key, p.strength);
      key += "}";
    }
    key += "|";
  }
  return key;
}

std::vector<size_t> MaterializeCache::Lookup(absl::Span<const std::string> keys,
                                             std::vector<MaterializedTensor>* out) {
  std::vector<size_t> misses;
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (LookupLocked(keys[i], &(*out)[i])) {
      ++stats_.hits;
    } else {
      ++stats_.misses;
      misses.push_back(i);
    }
  }
  return misses;
}

bool MaterializeCache::LookupLocked(const std::string& key, MaterializedTensor* out) {
  auto it = cache_.find(key);
  if (it == cache_.end()) return false;
  const Entry& e = it->second;
  if (e.packed_id == 0) {
    BufferPtr buffer = e.view_of.lock();
    if (buffer == nullptr) {
      cache_.erase(it);
      return false;
    }
    *out = MaterializedTensor{std::move(buffer), e.offset, e.length, e.digest, true};
    return true;
  }
  auto p = packed_.find(e.packed_id);
  if (p == packed_.end()) return false;
  *out = MaterializedTensor{p->second.buffer, e.offset, e.length, e.digest, false};
  return true;
}

void MaterializeCache::Insert(absl::Span<const std::string> keys, absl::Span<const size_t> misses,
                              const std::vector<MaterializedTensor>& out,
                              absl::Span<const Packed> packed, const std::string& tag) {
  absl::MutexLock lock(&mu_);
  for (const Packed& p : packed) {
    PackedBuffer& pb = packed_[p.buffer->id()];
    pb.buffer = p.buffer;
    if (p.first_base != nullptr) pb.base = p.first_base->buffer;
    if (p.tagged) pb.tag = tag;
    stats_.packed_segments++;
    stats_.packed_bytes += p.buffer->size();
  }
  for (size_t i : misses) {
    Entry e;
    e.offset = out[i].offset;
    e.length = out[i].length;
    e.digest = out[i].digest;
    if (out[i].view) {
      e.view_of = out[i].buffer;
    } else {
      e.packed_id = out[i].buffer->id();
    }
    auto [it, inserted] = cache_.try_emplace(keys[i], e);
    // A concurrent call may have computed the same thing first: keep its
    // entry (identical bytes); ours lives on only as long as this fetch.
    if (inserted && !out[i].view) packed_[e.packed_id].entries++;
  }
  for (const Packed& p : packed) {
    if (packed_[p.buffer->id()].entries == 0) {
      stats_.packed_segments--;
      stats_.packed_bytes -= p.buffer->size();
      packed_.erase(p.buffer->id());
    }
  }
}

void MaterializeCache::RetireTag(const std::string& tag) {
  absl::MutexLock lock(&mu_);
  retired_tags_.insert(tag);
}

uint64_t MaterializeCache::Evict(bool orphans_only, std::vector<SegmentPtr>* dropped) {
  absl::MutexLock lock(&mu_);
  uint64_t freed = 0;
  absl::flat_hash_set<std::string> live_tags;
  for (auto it = packed_.begin(); it != packed_.end();) {
    auto cur = it++;
    bool retired = !cur->second.tag.empty() && retired_tags_.contains(cur->second.tag);
    if (retired && cur->second.buffer.use_count() != 1) live_tags.insert(cur->second.tag);
    if (orphans_only && !cur->second.base.expired() && !retired) continue;
    if (cur->second.buffer.use_count() == 1) {
      freed += cur->second.buffer->size();
      stats_.packed_segments--;
      stats_.packed_bytes -= cur->second.buffer->size();
      dropped->push_back(std::move(cur->second.buffer));  // freed by the caller, unlocked
      packed_.erase(cur);
    }
  }
  // Entries of freed packed segments go at once. Views die only when their
  // checkpoint is gone, which a sweep after every release would look for in
  // vain: walking every entry then costs more than the release itself, so a
  // sweep that freed nothing prunes only every 64th time (stats() counts
  // live entries only, so nothing observable waits on it).
  if (freed > 0 || !orphans_only || ++sweeps_since_prune_ >= 64) {
    sweeps_since_prune_ = 0;
    absl::erase_if(cache_, [this](const auto& kv) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !EntryLive(kv.second);
    });
  }
  // A retired tag is forgotten once none of its segments is left.
  for (auto it = retired_tags_.begin(); it != retired_tags_.end();) {
    auto cur = it++;
    if (!live_tags.contains(*cur)) retired_tags_.erase(cur);
  }
  return freed;
}

bool MaterializeCache::EntryLive(const Entry& e) const {
  return e.packed_id == 0 ? !e.view_of.expired() : packed_.contains(e.packed_id);
}

MaterializerStats MaterializeCache::stats() const {
  absl::MutexLock lock(&mu_);
  MaterializerStats s = stats_;
  s.entries = 0;
  for (const auto& [key, e] : cache_) s.entries += EntryLive(e) ? 1 : 0;
  return s;
}

}  // namespace weightd
