// Byte ranges of a checkpoint's files (of their data sections), kept merged:
// what a load still running has read from storage (LoadingCopy), and what a
// partial holder says it has (PeerRead). Not thread-safe: its owner locks.
#ifndef WEIGHTD_SERVER_STORE_BYTE_RANGES_H_
#define WEIGHTD_SERVER_STORE_BYTE_RANGES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "server/store/peer_source.h"

namespace weightd {

class ByteRanges {
 public:
  ByteRanges() = default;
  explicit ByteRanges(size_t files) : files_(files) {}

  // Adds bytes [begin, begin + length) of `file`, merged with the ranges
  // they touch. Ignored for a file past files() or an empty range.
  void Add(size_t file, uint64_t begin, uint64_t length);
  // Whether every byte of [begin, begin + length) of `file` is in; false
  // for a file past files() and for an empty range.
  bool Covers(size_t file, uint64_t begin, uint64_t length) const;
  // The ranges, by file then offset, the first `max` of them.
  std::vector<CheckpointRange> List(size_t max) const;

  size_t files() const { return files_.size(); }
  uint64_t bytes() const { return bytes_; }  // in all, counted once

 private:
  std::vector<std::map<uint64_t, uint64_t>> files_;  // per file: begin -> end
  uint64_t bytes_ = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_BYTE_RANGES_H_
