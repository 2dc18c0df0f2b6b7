// Where a checkpoint load gets its bytes besides storage: the daemon's
// peers, other daemons holding the same files (issue [cluster]). The store
// sees peers through this interface only; server/grpc/peer_table.h
// implements it over gRPC, tests implement it in memory.
//
// A checkpoint is the same on two daemons when its files have the same
// names, sizes and header bytes (CheckpointKey). That much is read from
// storage by every daemon (headers are small); the rest is trusted only
// once checked: samples of storage bytes against the peer's (before and
// after the transfer) and every tensor against the digest the peers report
// (LoadCheckpoint).
#ifndef WEIGHTD_SERVER_STORE_PEER_SOURCE_H_
#define WEIGHTD_SERVER_STORE_PEER_SOURCE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/digest.h"

namespace weightd {

// Where a load may take the tensor bytes from (weightctl load --source).
enum class LoadSource { kAuto, kStorage, kPeers };
const char* LoadSourceName(LoadSource s);
absl::StatusOr<LoadSource> ParseLoadSource(absl::string_view s);

// One file of a checkpoint as its content identity sees it.
struct CheckpointFileId {
  std::string name;      // base name (its name in the index)
  uint64_t size = 0;     // of the whole file
  Digest header;         // of its header bytes (8-byte length and JSON)
};
// XXH3-128 over every file in order of (u64 LE name length, name, u64 LE
// size, header digest): FindCheckpointRequest.key.
Digest CheckpointKey(const std::vector<CheckpointFileId>& files);

// A byte range of one file's data section (the bytes after its header).
struct CheckpointRange {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// What a peer says it holds.
struct PeerHolding {
  std::string peer;  // its address
  // Which of the holder's copies answered (Checkpoint::copy_id): the files
  // of two checkpoints may share a key (sibling training steps: the same
  // names, sizes and headers), and a range is read from this one.
  Digest copy;
  // Per file: its tensors' digests, in data-offset order (ties by name).
  std::vector<std::vector<Digest>> tensor_digests;
  std::vector<Digest> sample_digests;  // one per sample asked for
};

class CheckpointPeers {
 public:
  virtual ~CheckpointPeers() = default;
  // Asks every peer that may hold `key` (in parallel, each within its
  // deadline) and returns those that do, with the digests of `samples` of
  // their bytes (of the copy whose samples are `sample_digests`, storage's,
  // when a peer holds several). Peers that fail to answer are logged, not
  // returned.
  virtual std::vector<PeerHolding> FindHolders(const Digest& key,
                                               const std::vector<CheckpointRange>& samples,
                                               const std::vector<Digest>& sample_digests) = 0;
  // Reads `range` of copy `copy` of the checkpoint `key` from `peer` into
  // `dest` (range.length bytes): an error for anything refused, short, out
  // of order or later than the transfer deadline.
  virtual absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                                 const CheckpointRange& range, uint8_t* dest) = 0;
};

// Where a load's bytes came from (LoadCheckpoint fills it).
struct LoadSourceReport {
  uint64_t storage_bytes = 0;  // data read from storage (samples included)
  uint64_t peer_bytes = 0;
  std::map<std::string, uint64_t> by_peer;        // bytes received, by address
  std::map<std::string, uint64_t> peer_failures;  // ranges a peer failed, by address
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_PEER_SOURCE_H_
