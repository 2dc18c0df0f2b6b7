#include "server/store/byte_ranges.h"

#include <algorithm>
#include <iterator>

namespace weightd {

void ByteRanges::Add(size_t file, uint64_t begin, uint64_t length) {
  if (file >= files_.size() || length == 0) return;
  std::map<uint64_t, uint64_t>& m = files_[file];
  uint64_t b = begin, e = begin + length;
  // Merge with the ranges it touches (each counted out, the merged one in).
  auto it = m.upper_bound(b);
  if (it != m.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= b) {
      b = prev->first;
      e = std::max(e, prev->second);
      bytes_ -= prev->second - prev->first;
      it = m.erase(prev);
    }
  }
  while (it != m.end() && it->first <= e) {
    e = std::max(e, it->second);
    bytes_ -= it->second - it->first;
    it = m.erase(it);
  }
  m[b] = e;
  bytes_ += e - b;
}

bool ByteRanges::Covers(size_t file, uint64_t begin, uint64_t length) const {
  if (file >= files_.size() || length == 0) return false;
  const std::map<uint64_t, uint64_t>& m = files_[file];
  auto it = m.upper_bound(begin);
  if (it == m.begin()) return false;
  --it;  // the last range starting at or before `begin`
  return it->second >= begin + length;
}

std::vector<CheckpointRange> ByteRanges::List(size_t max) const {
  std::vector<CheckpointRange> out;
  for (size_t f = 0; f < files_.size() && out.size() < max; ++f) {
    for (const auto& [b, e] : files_[f]) {
      if (out.size() >= max) break;
      out.push_back({static_cast<uint32_t>(f), b, e - b});
    }
  }
  return out;
}

}  // namespace weightd
