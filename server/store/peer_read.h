// A checkpoint load's bytes from peers (CheckpointPeers, peer_source.h):
// which holders to use (PlanPeers), how ranges spread over them
// (RendezvousOrder), and the grouped reads with storage fallback and the
// checks of what they sent (PeerRead). Storage's bytes are the truth: what
// peers send is compared with tensor digests the holders agree on, with
// storage samples, and with storage's bytes at places no peer is told
// (SecretPieces).
#ifndef WEIGHTD_SERVER_STORE_PEER_READ_H_
#define WEIGHTD_SERVER_STORE_PEER_READ_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/digest.h"
#include "server/store/byte_ranges.h"
#include "server/store/checkpoint_files.h"
#include "server/store/checkpoint_layout.h"
#include "server/store/checkpoint_load_options.h"
#include "server/store/load_tally.h"
#include "server/store/loading_checkpoints.h"
#include "server/store/peer_source.h"
#include "server/store/storage_read.h"

namespace weightd {

// What the peers offered a load: the holders that agree on every tensor's
// digest (expected[i] for tensor i of the layout), the partial holders
// (daemons loading the same files now, whose samples where they have
// bytes match storage's), and the storage samples their bytes were checked
// against. `swarm`: the load goes through PeerRead even with no holder at
// all, so that loaders starting together find each other and share out
// storage's reads.
struct PeerPlan {
  Digest key;
  std::vector<std::string> holders;
  std::vector<Digest> expected;  // empty when no complete holder answered
  std::vector<CheckpointRange> samples;
  std::vector<Digest> sample_digests;  // of storage's bytes
  Digest copy;  // the holders' copy (PeerHolding::copy)
  std::vector<PeerHolding> partial;
  bool swarm = false;
};

// The checkpoint key of `files` (CheckpointKey): what peers are asked for.
Digest CheckpointKeyOf(const CheckpointFiles& files);

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
uint64_t RendezvousScore(const Digest& key, const std::string& holder, size_t chunk);
std::vector<size_t> RendezvousOrder(const std::vector<std::string>& holders, const Digest& key,
                                    size_t chunk);

// Fills a load's chunks from the holders of a PeerPlan, peer_streams at
// once, each chunk from the holder first in its rendezvous order among
// those that have it (a complete holder, or a partial one whose ranges
// cover it). With partial holders, the loads share out storage: each chunk
// has an owner among this load and the partial holders still reading
// (in turn over their copy ids, sorted: the same on every daemon that sees
// the same loads, and as many chunks each), this load reads its own
// chunks from storage (read_threads shared out among the owners; one
// until the first refresh when the plan saw no one) and
// waits for the others' until their owner has read them, asking the peers
// again every peer_refresh; an owner gone, or stalled for peer_patience,
// passes its chunks on, and a chunk waited for longer than 3 x
// peer_patience is read from storage here. The ranges this load reads from storage are offered at
// once (`own`, if any). What no one supplies comes from storage (kAuto) or
// fails the load UNAVAILABLE (kPeers, which uses complete holders only).
// Then checks what they sent, round after round, until every tensor
// matches the holders' digests (where a complete holder gave them), every
// sample storage's bytes, and every secret piece storage's bytes: a peer
// that fails a range is dropped for the rest of the load
// (peer_read_failed); one caught with wrong bytes is dropped
// (peer_data_loss) and nothing it sent is kept. When storage itself
// disagrees with the holders' digests, everything is read from storage
// (kPeers: DATA_LOSS). On success the layout's tensors carry the digests
// of the bytes kept.
//
// Not thread-safe; owned by the loading thread. The fill's threads share
// the holders and the chunks' states under mu_; each writes only the
// per-chunk entries of the chunk it fills. Borrows everything it is given.
class PeerRead {
 public:
  PeerRead(const std::string& path, const CheckpointLoadOptions& options, const PeerPlan& plan,
           const std::vector<CheckpointFile>& files, LoadLayout& layout, const ChunkPlan& chunks,
           const StorageReader& storage, LoadTally& tally, LoadingCopy* own = nullptr);

  // Fills and checks every chunk (above). Once only.
  absl::Status Run();

  // After Run: where the bytes kept came from (by source, and the peers
  // that sent some), and the bytes kept per peer.
  const LoadProgressInfo& sources() const { return sources_; }
  const std::map<std::string, uint64_t>& kept_by_peer() const { return kept_by_peer_; }

 private:
  // A holder of the load: complete (every byte, and the tensor digests) or
  // partial (the ranges of `have`, growing).
  struct Holder {
    std::string peer;
    Digest copy;
    bool partial = false;
    std::string id;  // its rendezvous name: the copy id (partial holders)
    ByteRanges have;        // what it says it has (partial holders)
    absl::Time progressed;  // when `have` last grew (or it joined)
    bool present = true;    // in the latest answers
    bool unreadable = false;  // refused a read since (gone, busy): until then
    bool dropped = false;   // from the load
    bool lied = false;      // dropped for wrong bytes: nothing it sent is kept
  };
  // What one round of checks found.
  struct Verdict {
    std::set<size_t> redo;  // chunks to fetch again
    bool storage_disagrees = false;
    std::string first_bad;  // what storage disagreed on first
  };
  static constexpr int kFromStorage = -1;
  enum ChunkState : char { kTodo, kInFlight, kDone };

  // The first chunk of every group, then the second of each, ...
  std::vector<size_t> FirstPassOrder() const;
  // The first pass: every chunk once, shared out with partial holders.
  absl::Status FirstPass();
  void Worker(bool storage) ABSL_LOCKS_EXCLUDED(mu_);
  // The next chunk a worker takes (and from whom: a holder, or
  // kFromStorage), waiting while there is none yet; -1 when the pass is
  // over.
  std::pair<long, int> Take(bool storage) ABSL_LOCKS_EXCLUDED(mu_);
  // The holder to read chunk `ci` from (first in rendezvous order among
  // those that have it and are not dropped or excluded for it), or -1.
  int Supplier(size_t ci) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Has(const Holder& h, const Chunk& c) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The ranges a partial holder's answer names (checked by Fault).
  ByteRanges RangesOf(const PeerHolding& p) const;
  // Asks the peers again; true when something changed (a holder, ranges).
  bool Refresh() ABSL_LOCKS_EXCLUDED(mu_);
  void UpdateOwners() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddHolder(const PeerHolding& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `h` cannot be used, or empty.
  std::string Fault(const PeerHolding& h) const;
  void TurnAway(const std::string& peer, const std::string& why) const;

  absl::Status Fill(const std::vector<size_t>& todo, bool count);
  absl::Status FillChunk(size_t ci, bool count) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadOwn(size_t ci, bool count);  // from storage, then offered
  // Whether `s` is this load's own cancellation (it fails; no one's fault).
  bool OwnCancel(const absl::Status& s) const;
  // Chunk `ci` from holder `h` (`peer`'s copy `copy`), kept unchecked.
  absl::Status ReadFrom(size_t ci, int h, const std::string& peer, const Digest& copy,
                        bool count) ABSL_LOCKS_EXCLUDED(mu_);
  void Drop(size_t h, const absl::Status& why, const char* event) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Verdict> Check() ABSL_LOCKS_EXCLUDED(mu_);
  void Blame(const std::vector<size_t>& under, const std::string& what, Verdict& v)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<size_t>> CompareWithStorage();
  absl::Status TrustStorage(const std::string& first_bad) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AllFromStorage() ABSL_LOCKS_EXCLUDED(mu_);
  void CountSources() ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const std::string& path_;
  const CheckpointLoadOptions& options_;
  const PeerPlan& plan_;
  const std::vector<CheckpointFile>& files_;
  const ChunkPlan& chunks_;
  const StorageReader& storage_;
  LoadingCopy* const own_;       // null: this load offers nothing
  const std::string self_id_;    // this load's rendezvous name
  std::vector<std::vector<size_t>> order_;  // each file's tensors in digest order
  std::vector<size_t> first_order_;         // FirstPassOrder
  // The secret pieces (chosen once the first pass is in).
  std::vector<CheckpointRange> secret_;

  // Own synchronization.
  LoadTally& tally_;

  // Protected by mu_: the holders (by index; only ever appended), the
  // expected digests (set once, by the plan or the first complete holder
  // to answer), the chunks' states and owners in the first pass.
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::deque<Holder> holders_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<std::string, Digest>> refused_ ABSL_GUARDED_BY(mu_);
  std::vector<Digest> expected_ ABSL_GUARDED_BY(mu_);
  std::vector<ChunkState> state_ ABSL_GUARDED_BY(mu_);
  std::vector<char> mine_ ABSL_GUARDED_BY(mu_);  // per chunk: this load is its owner
  size_t remaining_ ABSL_GUARDED_BY(mu_) = 0;
  // Storage reads in flight, and how many may be: one until the first
  // refresh when the plan found no other load (loads that start together
  // may not have seen each other yet), then read_threads shared out among
  // the loads reading (UpdateOwners).
  int storage_busy_ ABSL_GUARDED_BY(mu_) = 0;
  int storage_width_ ABSL_GUARDED_BY(mu_) = 1;
  bool refreshed_ ABSL_GUARDED_BY(mu_) = false;  // or the plan saw others
  // Per chunk: since when it waits for another load (InfiniteFuture: not);
  // past 3 x peer_patience a storage reader with room takes it. The first
  // chunk of first_order_ not done.
  std::vector<absl::Time> waiting_since_ ABSL_GUARDED_BY(mu_);
  size_t first_todo_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);

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
