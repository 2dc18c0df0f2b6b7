// Where a checkpoint load gets its bytes besides storage: the daemon's
// peers, other daemons holding the same files (issue [cluster]). The store
// sees peers through this interface only; server/fleet/peer_checkpoint_client.h
// implements it over gRPC, tests implement it in memory.
//
// A checkpoint is the same on two daemons when its files have the same
// names, sizes and header bytes (CheckpointKey). That much is read from
// storage by every daemon (headers are small); the bytes a peer sends are
// checked against storage's own bytes at places the peer never learns, and
// as much of them as PeerVerify says (LoadCheckpoint). The samples a load
// sends with its question only pick the holder's copy and turn away peers
// with other bytes early: the peer sees them, so they prove nothing about
// the rest.
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

// How much of what peers send a load compares with storage's bytes
// (--peer-verify), at places chosen after the peers answered and never
// sent to them: "samples" (fraction 0: peer_samples_per_file pieces per
// file), "N%" (that share of each file's data, in pieces), "all" (every
// byte: storage is read whole too).
struct PeerVerify {
  double fraction = 0;  // 0: samples; 1: all
  std::string ToString() const;
};
absl::StatusOr<PeerVerify> ParsePeerVerify(absl::string_view s);

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

// The bounds of a FindCheckpoint question and answer, the same for the
// daemon asking and the one answering: samples in a question, bytes in
// one sample, ranges a partial holder names (loads sharing out storage
// each hold every P-th chunk, so a 1 TB checkpoint in 16 MiB chunks needs
// 65536 / P).
inline constexpr size_t kMaxPeerSamples = 4096;
inline constexpr uint64_t kMaxPeerSampleBytes = 1ull << 20;
inline constexpr size_t kMaxPartialRanges = 65536;
// OK when `samples` keep the first two: INVALID_ARGUMENT otherwise.
absl::Status CheckPeerSamples(const std::vector<CheckpointRange>& samples);

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
  // A holder still loading the checkpoint itself (a partial holder): it
  // serves only `available` (storage's bytes it has read so far), has no
  // tensor digests to give (tensor_digests is empty), and knows the
  // samples only inside `available` (sample_known false elsewhere; the
  // digest there is zero). Its copy id names its load, not its bytes.
  bool partial = false;
  std::vector<CheckpointRange> available;
  std::vector<bool> sample_known;
};

// What a load asks its peers (FindCheckpoint).
struct PeerQuery {
  Digest key;
  std::vector<CheckpointRange> samples;  // of storage's bytes
  std::vector<Digest> sample_digests;    // storage's, one per sample
  // Per file, its tensors (from this daemon's own headers): the exact shape
  // of a true answer, and so the most a peer's answer may take.
  std::vector<uint64_t> tensors_per_file;
  // The most bytes a true answer takes on the wire (digests, framing, a
  // partial holder's ranges).
  uint64_t AnswerBound() const;
};

class CheckpointPeers {
 public:
  virtual ~CheckpointPeers() = default;
  // Asks the peers whether they hold `query.key` (a few at once, each
  // within its deadline) and returns those that do, with the digests of
  // the samples of their copy whose samples are `query.sample_digests`.
  // Peers that fail to answer, or whose answer is not of the query's shape
  // (or larger than AnswerBound()), are logged and not returned.
  virtual std::vector<PeerHolding> FindHolders(const PeerQuery& query) = 0;
  // Reads `range` of copy `copy` of the checkpoint `key` from `peer` into
  // `dest` (range.length bytes): an error for anything refused, short, out
  // of order or later than the transfer deadline. `*transport` (when not
  // null) is set to what carried the bytes: "grpc", "ucx".
  virtual absl::Status ReadRange(const std::string& peer, const Digest& key, const Digest& copy,
                                 const CheckpointRange& range, uint8_t* dest,
                                 const char** transport) = 0;
};

// Where a load's bytes came from (LoadCheckpoint fills it).
struct LoadSourceReport {
  uint64_t storage_bytes = 0;  // data read from storage (samples, checks included)
  // Bytes from peers that the load kept (in what it returned), in all and
  // by address; bytes peers sent that were thrown away (wrong, fetched
  // again elsewhere, or the load failed).
  uint64_t peer_bytes = 0;
  std::map<std::string, uint64_t> by_peer;
  uint64_t peer_bytes_discarded = 0;
  std::map<std::string, uint64_t> peer_failures;  // ranges a peer failed, by address
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_PEER_SOURCE_H_
