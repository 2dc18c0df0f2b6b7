// The phases of a publish commit (WeightService::CommitStaged), each a
// function of its inputs that takes no service lock:
//
//   SealStaging     the staging segment sealed for good (and, when it was
//                   handed out, proven unmapped and whole)
//   PiecesOf        each published tensor as parts keyed as the generation
//                   stores them
//   DigestPieces    their digests, in parallel, under a fault guard
//   DiffPieces      which differ from the current generation's bytes
//   HeldBuffers     what the new generation holds anyway (for sharing)
//   PlanStore       one copy of each run of bytes no loaded model holds
//   CompactStored   the changed bytes moved out of the staging segment
//                   when they are a small part of it
//   StoredTensorsOf the published tensor entries, and the result's counts
//
// The service runs them in this order, asks its catalog where bytes are
// held already (FindResidentCopies) between DiffPieces and PlanStore, and
// installs the generation (CommitState) at the end. A failed phase leaves
// nothing visible; its status says what failed, and messages clients match
// are kept as they were.
//
// Thread-safe: no shared state.
#ifndef WEIGHTD_SERVER_PUBLISH_PUBLISH_COMMIT_H_
#define WEIGHTD_SERVER_PUBLISH_PUBLISH_COMMIT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/digest.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"
#include "server/publish/publish_session.h"
#include "server/publish/publish_types.h"
#include "server/service/model.h"
#include "server/store/checkpoint.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

// What a writer that sealed the staging memfd itself (F_SEAL_SEAL) is told.
extern const char kSealedByWriter[];

// A published tensor's part: one per checkpoint tensor it merges (keyed by
// its checkpoint name); an allow_new tensor is one part keyed by its served
// name.
struct StagedPiece {
  size_t spec = 0;  // index into the session's specs
  std::string key;
  bool part = true;  // a checkpoint tensor's place (else an allow_new tensor's)
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // in the staging segment
  uint64_t length = 0;
  Digest digest;
};

// Seals `staged` against writes: `handed_out` (written in place by other
// processes) with SealExclusive, after which no page may be missing
// (FAILED_PRECONDITION naming the punched bytes, or kSealedByWriter);
// otherwise with Seal.
absl::StatusOr<SegmentPtr> SealStaging(std::unique_ptr<Segment> staged, bool handed_out);

// The pieces of `session`'s specs on `model`'s current generation.
// REQUIRES: the model is the instance the session began on.
absl::StatusOr<std::vector<StagedPiece>> PiecesOf(const PublishSession& session,
                                                  const Model& model);

// Digests every piece's bytes in `segment` on `threads` threads (the
// caller's included), a piece at a time. A page that cannot be read ends
// in session.StagingFault.
absl::Status DigestPieces(std::vector<StagedPiece>& pieces, const Segment& segment, int threads,
                          const PublishSession& session);

// What the pieces change on generation `cur` of `model`.
struct PublishDiff {
  // `cur`'s published tensors, less those whose pieces are back to the
  // checkpoint's bytes.
  std::shared_ptr<PublishedBase> published;
  // Changed pieces that are not the checkpoint's own bytes: to be stored.
  std::vector<const StagedPiece*> fresh;
  uint64_t changed_specs = 0;  // specs with any piece changed
};
PublishDiff DiffPieces(const std::vector<StagedPiece>& pieces, const Model& model,
                       const Generation& cur);

// The buffers the new generation holds whatever it shares: the checkpoint's
// and the published tensors `fresh` does not replace.
absl::flat_hash_set<uint64_t> HeldBuffers(const Model& model, const PublishedBase& published,
                                          const std::vector<const StagedPiece*>& fresh);

// What stays to be stored of `fresh` (bytes in `base`) where `resident`
// (one per fresh piece) found no copy: one copy of each run of bytes.
struct StorePlan {
  std::vector<int64_t> same_as;  // per fresh piece: an earlier one with its bytes, or -1
  uint64_t bytes = 0;            // to store, each piece rounded up to 64
  size_t pieces = 0;             // to store (some may be empty)
};
StorePlan PlanStore(const std::vector<const StagedPiece*>& fresh,
                    const std::vector<std::optional<HeldElsewhere>>& resident,
                    const uint8_t* base);

// Where the stored pieces lie: `holder` and per fresh piece its offset.
struct StoredRuns {
  SegmentPtr holder;
  std::vector<uint64_t> offsets;
};
// Only the changed bytes stay: when they are at most 7/8 of the
// `bytes_received`, they move to a segment of their size (allocated from
// `memory`, copied on `threads` threads); else, or without room for the
// copy, the staging `segment` is kept whole, and then copies in `resident`
// from a segment outside `held` are dropped (sharing would only pin it).
StoredRuns CompactStored(const std::vector<const StagedPiece*>& fresh,
                         std::vector<std::optional<HeldElsewhere>>& resident,
                         const StorePlan& plan, const SegmentPtr& segment,
                         uint64_t bytes_received, const absl::flat_hash_set<uint64_t>& held,
                         HostMemoryManager& memory, int threads);

// The published entries for `fresh` of `session` (shared from `resident`
// or stored in `stored`), and the result's bytes_shared, shared_with and
// bytes_stored.
std::vector<StoredTensor> StoredTensorsOf(const PublishSession& session,
                                          const std::vector<const StagedPiece*>& fresh,
                                          const std::vector<std::optional<HeldElsewhere>>& resident,
                                          const StorePlan& plan, const StoredRuns& stored,
                                          const SegmentPtr& segment, PublishResult* result);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PUBLISH_PUBLISH_COMMIT_H_
