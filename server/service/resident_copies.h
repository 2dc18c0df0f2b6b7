// ResidentCopies: bytes that loaded models already hold, found for sharing
// (publish commits, restored publishes, model loads), and the resident
// checkpoints offered to peers that load the same files (FindHeld,
// ReadHeld).
//
// Thread-safe: no lock of its own; it reads Catalog snapshots (immutable)
// and ResidentCheckpoints (its own leaf lock). Borrows both and the access
// policy; owns only the count of bytes sent to peers.
#ifndef WEIGHTD_SERVER_SERVICE_RESIDENT_COPIES_H_
#define WEIGHTD_SERVER_SERVICE_RESIDENT_COPIES_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/digest.h"
#include "server/auth/access_control.h"
#include "server/service/catalog.h"
#include "server/service/types.h"
#include "server/store/peer_source.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

class ResidentCopies {
 public:
  struct Options {
    const Catalog* catalog = nullptr;
    const ResidentCheckpoints* resident = nullptr;
    const AccessPolicy* access = nullptr;
    // Where a held copy's files are looked at again (a remote object's
    // version: a HEAD through it).
    const FileOpener* files = nullptr;
  };
  explicit ResidentCopies(Options options) : options_(options) {}

  // Where bytes can be shared instead of stored (CommitStaged,
  // RestorePublish, model loads). For each wanted run of bytes: a tensor
  // some loaded model holds now (a checkpoint tensor, served or not, or a
  // published one of its current generation) with the same digest and the
  // same bytes (memcmp), in host memory, such that
  //  - whoever reads the new holder could read its segment already:
  //    clients map whole segments, so the holder (with its current
  //    generation's guards) must be public or have exactly `scope`
  //    (ReadScope of the new holder's guards; "" admits public holders
  //    only); and
  //  - sharing pins no more than it saves: the segment is one the new
  //    generation holds anyway (`held`: buffer ids), or the runs shared
  //    from it make up at least half of it.
  // Empty where there is none. The model named `own` (if any) is looked
  // at first. (The holder is the model's name.)
  using ResidentCopy = HeldElsewhere;
  struct WantedBytes {
    Digest digest;
    const uint8_t* data = nullptr;
    uint64_t length = 0;
  };
  std::vector<std::optional<ResidentCopy>> Find(const std::string& own, const std::string& scope,
                                                absl::Span<const WantedBytes> wanted,
                                                const absl::flat_hash_set<uint64_t>& held) const;
  // Find's second rule over `copies` (one per `wanted`): drops the copies
  // from a segment outside `held` whose distinct runs taken make up less
  // than half of it. True when it dropped any.
  static bool DropCopiesUnderHalf(std::vector<std::optional<ResidentCopy>>& copies,
                                  absl::Span<const WantedBytes> wanted,
                                  const absl::flat_hash_set<uint64_t>& held);

  // For peers loading from this daemon: see WeightService::FindHeld and
  // ReadHeld (the contract is written there).
  absl::StatusOr<PeerHolding> FindHeld(const Digest& key,
                                       const std::vector<CheckpointRange>& samples,
                                       const std::vector<Digest>& sample_digests,
                                       const Principal& asker) const;
  // Where copy `copy` of `key` keeps each file's data section (its segment,
  // the offset in it, the length), for a UCX grant: the same filter as
  // ReadHeld (NOT_FOUND otherwise).
  struct HeldSection {
    SegmentPtr segment;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  absl::StatusOr<std::vector<HeldSection>> HeldSections(const Digest& key, const Digest& copy,
                                                        const Principal& asker) const;
  absl::StatusOr<ReadRange> ReadHeld(const Digest& key, const Digest& copy,
                                     const CheckpointRange& range, const Principal& asker);

  // Bytes ReadHeld handed to peers.
  uint64_t bytes_sent_to_peers() const { return bytes_sent_to_peers_.load(); }

 private:
  // The resident checkpoints read from files whose CheckpointKey is `key`
  // and that are unchanged since (all of them, or file `only_file`), the
  // newest first.
  std::vector<std::shared_ptr<const Checkpoint>> HeldCopies(const Digest& key,
                                                           int only_file = -1) const;
  // Whether a loaded model or adapter holding `c` admits `asker` as a reader.
  bool MayOfferToPeer(const Checkpoint& c, const Principal& asker) const;

  // Constant after construction.
  const Options options_;

  // Own synchronization.
  std::atomic<uint64_t> bytes_sent_to_peers_{0};
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SERVICE_RESIDENT_COPIES_H_
