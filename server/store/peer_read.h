// A checkpoint load's bytes from peers (CheckpointPeers, peer_source.h):
// which holders to use (PlanPeers), how ranges spread over them
// (RendezvousOrder), and the grouped reads with storage fallback and the
// checks of what they sent (PeerRead). Storage's bytes are the truth: what
// peers send is compared with tensor digests the holders agree on, with
// storage samples, and with storage's bytes at places no peer is told
// (SecretPieces).
#ifndef WEIGHTD_SERVER_STORE_PEER_READ_H_
#define WEIGHTD_SERVER_STORE_PEER_READ_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/digest.h"
#include "server/store/checkpoint_files.h"
#include "server/store/checkpoint_layout.h"
#include "server/store/checkpoint_load_options.h"
#include "server/store/load_tally.h"
#include "server/store/peer_source.h"
#include "server/store/storage_read.h"

namespace weightd {

// What the peers offered a load: the holders that agree on every tensor's
// digest (expected[i] for tensor i of the layout), and the storage samples
// their bytes were checked against.
struct PeerPlan {
  Digest key;
  std::vector<std::string> holders;
  std::vector<Digest> expected;
  std::vector<CheckpointRange> samples;
  std::vector<Digest> sample_digests;  // of storage's bytes
  Digest copy;  // the holders' copy (PeerHolding::copy)
};

// Samples storage, asks the peers who holds `files` and keeps the holders
// whose samples match storage and who agree on the tensor digests (the
// largest such group). No holder: an empty plan (kAuto), UNAVAILABLE
// (kPeers); FAILED_PRECONDITION for kPeers without options.peers.
// Holders turned away are logged (peer_content_differs) and counted in
// `tally` as failures.
absl::StatusOr<PeerPlan> PlanPeers(const std::string& path, const CheckpointLoadOptions& options,
                                   const CheckpointFiles& files, const LoadLayout& layout,
                                   const StorageReader& storage, LoadTally& tally);

// Where the bytes peers send are compared with storage's (the load reads
// them from storage after the peers sent theirs): per file, pieces of
// peer_sample_bytes at random places chosen here, after the holders
// answered, and never sent to any peer, so a peer that answers the
// question's samples truthfully cannot know where else it is checked.
// peer_verify samples: peer_samples_per_file pieces per file; a fraction:
// that share of each file's pieces (at least as many); all: the chunks
// themselves, every byte.
std::vector<CheckpointRange> SecretPieces(const std::vector<CheckpointFile>& files,
                                          const CheckpointLoadOptions& options,
                                          const std::vector<Chunk>& chunks);

// The holders of a range in rendezvous order: each range goes to the
// holder scoring highest for it, so a fleet loading the same files spreads
// its ranges over every holder, and a holder dropped moves only its own.
std::vector<size_t> RendezvousOrder(const std::vector<std::string>& holders, const Digest& key,
                                    size_t chunk);

// Fills a load's chunks from the holders of a PeerPlan, each chunk from the
// first in its rendezvous order still in the load, peer_streams at once;
// what none supplies comes from storage (kAuto) or fails the load
// UNAVAILABLE (kPeers). Then checks what they sent, round after round,
// until every tensor matches the holders' digests, every sample storage's
// bytes, and every secret piece storage's bytes: a peer that fails a range
// is dropped for the rest of the load (peer_read_failed); one caught with
// wrong bytes is dropped (peer_data_loss) and nothing it sent is kept.
// When storage itself disagrees with the holders' digests, everything is
// read from storage (kPeers: DATA_LOSS). On success the layout's tensors
// carry the digests of the bytes kept.
//
// Not thread-safe; owned by the loading thread. Fill's stream threads each
// write only the entries of the chunk they fill, the holders' atomics and
// the (thread-safe) tally. Borrows everything it is given.
class PeerRead {
 public:
  PeerRead(const std::string& path, const CheckpointLoadOptions& options, const PeerPlan& plan,
           const std::vector<CheckpointFile>& files, LoadLayout& layout, const ChunkPlan& chunks,
           const StorageReader& storage, LoadTally& tally);

  // Fills and checks every chunk (above). Once only.
  absl::Status Run();

  // After Run: where the bytes kept came from (by source, and the peers
  // that sent some), and the bytes kept per peer.
  const LoadProgressInfo& sources() const { return sources_; }
  const std::map<std::string, uint64_t>& kept_by_peer() const { return kept_by_peer_; }

 private:
  // What one round of checks found.
  struct Verdict {
    std::set<size_t> redo;  // chunks to fetch again
    bool storage_disagrees = false;
    std::string first_bad;  // what storage disagreed on first
  };
  static constexpr int kFromStorage = -1;

  // The first chunk of every group, then the second of each, ...
  std::vector<size_t> FirstPassOrder() const;
  absl::Status Fill(const std::vector<size_t>& todo, bool count);
  absl::Status FillChunk(size_t ci, bool count);
  void Drop(size_t h, const absl::Status& why, const char* event);
  absl::StatusOr<Verdict> Check();
  void Blame(const std::vector<size_t>& under, const std::string& what, Verdict& v);
  absl::StatusOr<std::vector<size_t>> CompareWithStorage();
  absl::Status TrustStorage(const std::string& first_bad);
  absl::Status AllFromStorage();
  void CountSources();

  // Constant after construction.
  const std::string& path_;
  const CheckpointLoadOptions& options_;
  const PeerPlan& plan_;
  const std::vector<CheckpointFile>& files_;
  const ChunkPlan& chunks_;
  const StorageReader& storage_;
  // The secret pieces (chosen once the first pass is in).
  std::vector<CheckpointRange> secret_;

  // Own synchronization.
  LoadTally& tally_;
  // Per holder: dropped from the load; dropped for wrong bytes (nothing it
  // sent is kept).
  std::unique_ptr<std::atomic<bool>[]> dropped_;
  std::unique_ptr<std::atomic<bool>[]> lied_;

  // Per chunk, each entry written only by the thread filling that chunk:
  // who filled it (a holder, or kFromStorage) and over what (a static
  // string: "grpc", "ucx"); filled by a peer since the last comparison with
  // storage; holders it is not asked again (changed only between fills).
  std::vector<int> supplier_;
  std::vector<const char*> transport_;
  std::vector<char> unchecked_;
  std::vector<std::vector<int>> excluded_;

  // Owned by the loading thread.
  LoadLayout& layout_;
  LoadProgressInfo sources_;
  std::map<std::string, uint64_t> kept_by_peer_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_PEER_READ_H_
