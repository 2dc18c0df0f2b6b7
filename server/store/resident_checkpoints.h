// What memory holds already, and how a load or a peer uses it: the
// checkpoints resident by the identity of their files (ResidentCheckpoints),
// an identical copy of a freshly read one (FindIdenticalCopy), tensors whose
// bytes other holders keep (ShareHeldTensors), and what a holder tells and
// serves a peer loading the same files (DescribeHolding, FindHeldBytes).
#ifndef WEIGHTD_SERVER_STORE_RESIDENT_CHECKPOINTS_H_
#define WEIGHTD_SERVER_STORE_RESIDENT_CHECKPOINTS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/digest.h"
#include "server/memory/host_memory.h"
#include "server/store/checkpoint.h"
#include "server/store/loading_checkpoints.h"
#include "server/store/peer_source.h"

namespace weightd {

// Checkpoints resident in memory by the identity of their files: each
// file's path, device, inode, size, mtime and ctime, in order. A load whose
// files are all resident already (the same checkpoint under another
// model's name, or seen through another profile) shares that checkpoint's
// memory instead of reading a second copy. Any write to a file changes its
// ctime, even one that puts the mtime back, so a rewritten file is read
// again. Entries die with their checkpoint (it holds weak references
// only). Thread-safe; mu_ is a leaf.
class ResidentCheckpoints {
 public:
  std::shared_ptr<const Checkpoint> Find(const std::string& files_key) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every live entry: (files key, checkpoint).
  std::vector<std::pair<std::string, std::shared_ptr<const Checkpoint>>> Snapshot() const
      ABSL_LOCKS_EXCLUDED(mu_);
  void Add(const std::string& files_key, const std::shared_ptr<const Checkpoint>& checkpoint)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The live ones read from files whose CheckpointKey is `key` (what a peer
  // asks for), the newest first; only those are referenced.
  std::vector<std::shared_ptr<const Checkpoint>> FindByContent(const Digest& key) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The checkpoints still loading, offered to peers as they arrive (its
  // own synchronization).
  LoadingCheckpoints& loading() { return loading_; }
  const LoadingCheckpoints& loading() const { return loading_; }

 private:
  struct Entry {
    std::weak_ptr<const Checkpoint> checkpoint;
    Digest content_key;
    uint64_t added = 0;  // order of Add
  };

  // Protected by mu_.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> by_files_ ABSL_GUARDED_BY(mu_);
  uint64_t adds_ ABSL_GUARDED_BY(mu_) = 0;
  LoadingCheckpoints loading_;
};

// A resident checkpoint other than `c` whose files are byte for byte c's
// (in order: the same sizes, headers and data sections; names and paths may
// differ), or null.
std::shared_ptr<const Checkpoint> FindIdenticalCopy(const ResidentCheckpoints& resident,
                                                    const Checkpoint& c);

// Bytes of a tensor that memory holds already, outside the checkpoint
// being loaded (CheckpointLoadOptions::find_held): where, and whose.
struct HeldElsewhere {
  BufferPtr buffer;
  uint64_t offset = 0;
  std::string holder;  // whose (a model's name), for logs
};
// Per tensor of a checkpoint (in tensors() order), where memory holds its
// bytes already; empty where nothing does.
using FindHeldFn = std::function<std::vector<std::optional<HeldElsewhere>>(const Checkpoint&)>;

// Tensors of a freshly read checkpoint whose bytes memory holds already
// (`find_held`: another checkpoint's tensors, a published generation's)
// point at those bytes; the others move to one segment of their size
// (allocated from `memory`, copied on `threads` threads), and the files'
// segments are freed when `fresh` goes. Done only when the shared bytes
// are over 1/8 of the checkpoint (a copy to save less is not worth it) and
// the segment for the rest fits the budget and seals; otherwise `fresh` is
// returned as it is. The result has no file_info(): its segments are no
// longer laid out by file, so peers are not offered it and a hand-over
// does not send it (the successor reads the files). INTERNAL when
// `find_held` answers for other tensors. `path` names it in logs.
absl::StatusOr<std::shared_ptr<Checkpoint>> ShareHeldTensors(const std::string& path,
                                                             const FindHeldFn& find_held,
                                                             HostMemoryManager* memory,
                                                             int threads,
                                                             std::shared_ptr<Checkpoint> fresh);

// What a holder tells a peer loading `c` (FindCheckpoint): its copy id, its
// tensors' digests per file in data-offset order (ties by name), and the
// digests of `samples` (at most 4096, each at most 1 MiB: INVALID_ARGUMENT
// otherwise).
absl::StatusOr<PeerHolding> DescribeHolding(const Checkpoint& c,
                                            const std::vector<CheckpointRange>& samples);
// Where range `r` of one of c's files lies: its segment and the offset in
// it. INVALID_ARGUMENT outside the files, or longer than `max_length`.
struct HeldBytes {
  SegmentPtr buffer;
  uint64_t offset = 0;
};
inline constexpr uint64_t kMaxPeerRangeBytes = 256ull << 20;
absl::StatusOr<HeldBytes> FindHeldBytes(const Checkpoint& c, const CheckpointRange& r,
                                        uint64_t max_length);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_RESIDENT_CHECKPOINTS_H_
