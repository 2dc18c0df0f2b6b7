// Checkpoints still being loaded, offered to peers that load the same files
// at the same time (issue [fleet]: loaders that serve what they have). A
// load registers its copy once its memory is laid out (LoadingCheckpoints::
// Add) and marks each range as it lands from storage (LoadingCopy::MarkRead);
// a peer asking for the checkpoint then learns which ranges this daemon has
// (LoadingCheckpoints::Find) and reads those (Read).
//
// Only storage's own bytes are offered while the load runs: what the load
// took from other peers is unchecked until it ends (its digests and secret
// pieces), so it is offered only once the load is done and the checkpoint
// resident (ResidentCheckpoints). A reader of a partial copy gets a copy of
// the bytes taken under the copy's lock, never a pointer into memory the
// load may still free or remap: Close (before the load seals or frees its
// segments) waits for such copies and ends the offer.
//
// Thread-safe: LoadingCheckpoints' mu_ and each LoadingCopy's mu_ are
// leaves, never held together.
#ifndef WEIGHTD_SERVER_STORE_LOADING_CHECKPOINTS_H_
#define WEIGHTD_SERVER_STORE_LOADING_CHECKPOINTS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/digest.h"
#include "server/auth/access_control.h"
#include "server/memory/buffer.h"
#include "server/store/byte_ranges.h"
#include "server/store/peer_source.h"

namespace weightd {

// A partial holder names at most kMaxPartialRanges ranges in one answer
// (peer_source.h: the first ones, in file and offset order). The longest
// range it serves in one read (as a resident holder):
inline constexpr uint64_t kMaxPartialReadBytes = 256ull << 20;
// The most bytes copied for peers' reads of partial copies at once (each
// copy lives until its ReadCheckpoint stream ends); beyond it a read is
// RESOURCE_EXHAUSTED, and the peer asks again later.
inline constexpr uint64_t kMaxPartialCopyBytes = 256ull << 20;

class LoadingCopy {
 public:
  // Where the files' data sections are (per file), once the load has its
  // memory; until then nothing is read or served.
  void Attach(std::vector<const uint8_t*> data) ABSL_LOCKS_EXCLUDED(mu_);
  // Range [begin, begin + length) of file `file`'s data section holds
  // storage's bytes (written before the call; after Attach).
  void MarkRead(size_t file, uint64_t begin, uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the offer: waits for reads copying from the memory, then refuses
  // every later one (NOT_FOUND). Before the load seals or frees the memory.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

  const Digest& key() const { return key_; }
  const Digest& copy() const { return copy_; }
  const ReaderList& readers() const { return readers_; }

  // Built by LoadingCheckpoints::Add only.
  LoadingCopy(Digest key, Digest copy, ReaderList readers, std::vector<uint64_t> length);

 private:
  friend class LoadingCheckpoints;
  // Whether all of `r` is read; sets `out` to its bytes if so.
  bool CopyOut(const CheckpointRange& r, std::string* out) const ABSL_LOCKS_EXCLUDED(mu_);
  // The ranges read (at most kMaxPartialRanges), and the digest of each
  // sample wholly inside them (nullopt for the others); false once closed.
  bool Describe(const std::vector<CheckpointRange>& samples, std::vector<CheckpointRange>* have,
                std::vector<std::optional<Digest>>* digests) const ABSL_LOCKS_EXCLUDED(mu_);
  bool HasLocked(const CheckpointRange& r) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Digest key_;
  const Digest copy_;
  const ReaderList readers_;
  const std::vector<uint64_t> length_;  // per file: of its data section

  // Protected by mu_ (a leaf); readers copy under it held shared.
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<const uint8_t*> data_ ABSL_GUARDED_BY(mu_);  // per file; Attach
  ByteRanges read_ ABSL_GUARDED_BY(mu_);  // from storage, per file
};

class LoadingCheckpoints {
 public:
  // `max_copy_bytes`: the most bytes of copies for peers alive at once.
  explicit LoadingCheckpoints(uint64_t max_copy_bytes = kMaxPartialCopyBytes)
      : max_copy_bytes_(max_copy_bytes) {}

  // Registers a load of the checkpoint `key` whose files' data sections
  // are `length` bytes each, readable by peers that `readers` admit: from
  // now on peers see it loading (with nothing read until it attaches its
  // memory and marks ranges). Registered before the load asks its peers,
  // so loads that start together see each other. The copy is offered until
  // the handle is closed (or destroyed); its id is random (no two loads
  // share one).
  std::shared_ptr<LoadingCopy> Add(const Digest& key, ReaderList readers,
                                   std::vector<uint64_t> length) ABSL_LOCKS_EXCLUDED(mu_);

  // What the loads of `key` that `admits` (given the copy's readers) have:
  // one holding per copy, partial, with its ranges and the digests of the
  // samples inside them.
  struct Offer {
    Digest copy;
    std::vector<CheckpointRange> have;
    std::vector<std::optional<Digest>> sample_digests;
  };
  std::vector<Offer> Find(const Digest& key, const std::vector<CheckpointRange>& samples,
                          absl::FunctionRef<bool(const ReaderList&)> admits) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes of range `r` of copy `copy` of `key`, copied: NOT_FOUND when
  // no such load runs (any more), the asker is not admitted, or not all of
  // `r` has been read yet; INVALID_ARGUMENT for a range outside the files
  // or over kMaxPartialReadBytes; RESOURCE_EXHAUSTED while copies for
  // peers would hold more than max_copy_bytes.
  absl::StatusOr<BufferPtr> Read(const Digest& key, const Digest& copy, const CheckpointRange& r,
                                 absl::FunctionRef<bool(const ReaderList&)> admits) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  std::vector<std::shared_ptr<LoadingCopy>> Live(const Digest& key) const
      ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t max_copy_bytes_;
  // Own synchronization: bytes of copies alive (shared with the copies,
  // which may outlive this).
  const std::shared_ptr<std::atomic<uint64_t>> copied_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  // Protected by mu_ (a leaf): the registered loads (dropped once gone).
  mutable absl::Mutex mu_;
  std::multimap<Digest, std::weak_ptr<LoadingCopy>> loads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_LOADING_CHECKPOINTS_H_
