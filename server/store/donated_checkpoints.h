// The checkpoints a predecessor daemon handed over with its memory
// (server/state/handover.h), kept until a load of the same files adopts
// their segments instead of reading the files (AdoptDonated).
#ifndef WEIGHTD_SERVER_STORE_DONATED_CHECKPOINTS_H_
#define WEIGHTD_SERVER_STORE_DONATED_CHECKPOINTS_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/digest.h"
#include "common/fd.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"
#include "server/store/checkpoint.h"
#include "server/store/checkpoint_layout.h"

namespace weightd {

// How a successor checks the segments a predecessor handed over
// (--take-over-verify): every tensor's digest recomputed, one tensor in 16
// (and the first and last), or the predecessor's digests trusted.
enum class AdoptVerify { kFull, kSample, kNone };
const char* AdoptVerifyName(AdoptVerify v);

// A checkpoint a predecessor daemon held, handed over with its memory
// (server/state/handover.h): the identity of its files (FilesKey: path,
// device, inode, size, mtime, ctime of each), the segment size it was laid
// out with, its segments' memfds in layout order and each tensor's digest.
struct DonatedCheckpoint {
  std::string files_key;
  uint64_t segment_target_bytes = 0;
  std::vector<UniqueFd> segment_fds;
  std::vector<PageKind> segment_pages;
  absl::flat_hash_map<std::string, Digest> digests;  // by tensor name
  // Where each tensor lay: segment index, offset, length (by tensor name).
  struct Place {
    int64_t segment = -1;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  absl::flat_hash_map<std::string, Place> places;
};

// The checkpoints handed over, until a load of the same files takes each
// (LoadCheckpoint: instead of reading the files, it adopts the segments
// once they check out). Thread-safe; mu_ is a leaf, and the counters are
// atomics of their own.
class DonatedCheckpoints {
 public:
  explicit DonatedCheckpoints(AdoptVerify verify) : verify_(verify) {}
  void Add(DonatedCheckpoint checkpoint) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and returns the one whose files are `files_key`, if any.
  std::optional<DonatedCheckpoint> Take(const std::string& files_key) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops what no load took (their fds close); returns how many.
  size_t DropUnused() ABSL_LOCKS_EXCLUDED(mu_);
  AdoptVerify verify() const { return verify_; }
  // Loads that adopted segments, and that read their files instead
  // (refused: layout, digest or memfd mismatch).
  uint64_t adopted() const { return adopted_.load(); }
  uint64_t refused() const { return refused_.load(); }
  void CountAdopted() { adopted_.fetch_add(1); }
  void CountRefused() { refused_.fetch_add(1); }

 private:
  // Constant after construction.
  const AdoptVerify verify_;

  // Own synchronization.
  std::atomic<uint64_t> adopted_{0};
  std::atomic<uint64_t> refused_{0};

  // Protected by mu_.
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, DonatedCheckpoint> by_files_ ABSL_GUARDED_BY(mu_);
};

// How a load adopts a donation.
struct AdoptOptions {
  HostMemoryManager* memory = nullptr;  // adopts the memfds (and charges them)
  uint64_t segment_target_bytes = 0;    // this daemon's layout
  AdoptVerify verify = AdoptVerify::kFull;
  int threads = 1;  // digesting in parallel
};

// What a load adopted: the segments, and the tensors of its layout on them
// with the predecessor's digests.
struct AdoptedSegments {
  std::vector<SegmentPtr> segments;
  std::vector<StoredTensor> tensors;
};

// The predecessor's segments `d` for files laid out as `layout` (this
// daemon's layout of the same files), each tensor where the layout puts
// it, the digests checked as `options.verify` says. FAILED_PRECONDITION
// for another layout (segment size, count, sizes, a tensor's place, a
// digest missing), DATA_LOSS for a digest that does not match the bytes;
// the memfds' own checks as HostMemoryManager::Adopt makes them. Any error
// means: read the files instead.
absl::StatusOr<AdoptedSegments> AdoptDonated(DonatedCheckpoint d, const LoadLayout& layout,
                                             const AdoptOptions& options);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_DONATED_CHECKPOINTS_H_
