// A checkpoint: an immutable set of named tensors read from safetensors into
// sealed memfd segments. Shared as std::shared_ptr<const Checkpoint> by the
// models that serve it and by in-flight fetches; thread-safe once built.
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "common/digest.h"
#include "common/file_opener.h"
#include "common/dtype.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"
#include "server/store/peer_source.h"

namespace weightd {

struct StoredTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  BufferPtr buffer;     // sealed; of any memory kind (server/memory/buffer.h)
  uint64_t offset = 0;  // inside buffer
  uint64_t length = 0;  // bytes
  Digest digest;        // of the stored bytes
  std::string file;     // the file it came from (for messages)

  int64_t NumElements() const;
  // The bytes where the CPU can read them; nullptr when the buffer is not
  // host memory (only a fill backend of its kind reads it then).
  const uint8_t* host_data() const {
    const uint8_t* base = buffer != nullptr ? buffer->host_data() : nullptr;
    return base != nullptr ? base + offset : nullptr;
  }
};

// What the daemon holds per tensor besides its bytes (names, shapes, the
// name maps of checkpoint, layout and generations), charged to the memory
// budget for as long as the checkpoint lives. Measured: 300,000 tensors
// took 332 MiB of RSS with 7-character names, 593 MiB with 45.
inline constexpr uint64_t kTensorMetadataBytes = 1024;
inline constexpr uint64_t kTensorMetadataBytesPerNameByte = 24;
inline constexpr uint64_t kTensorMetadataBytesPerDim = 16;
uint64_t TensorMetadataBytes(absl::string_view name, size_t rank);

// Bytes of a tensor that memory holds already, outside the checkpoint
// being loaded (CheckpointLoadOptions::find_held): where, and whose.
struct HeldElsewhere {
  BufferPtr buffer;
  uint64_t offset = 0;
  std::string holder;  // whose (a model's name), for logs
};

// One file of a checkpoint, as read: its content identity and where its
// data section lies in the checkpoint's segments (a peer reads ranges of it
// by file, whatever its own segment layout).
struct CheckpointFileInfo {
  std::string path;
  CheckpointFileId id;       // name, size, header digest
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t data_length = 0;
  size_t segment = 0;        // in host_segments()
  uint64_t segment_offset = 0;
  // The file's size and mtime when it was read: a holder whose file changed
  // since no longer offers it to peers.
  int64_t mtime_sec = 0;
  int64_t mtime_nsec = 0;
  uint64_t dev = 0;
  uint64_t ino = 0;
};

class Checkpoint {
 public:
  // `host_segments`: the host-memory segments behind the tensors' buffers
  // (what the host loader filled; page statistics and pinning look at
  // them). `metadata_charge`: the budget held for the tensors' metadata
  // (may be null), returned when the checkpoint is freed.
  Checkpoint(std::string path, std::vector<std::string> files,
             std::vector<StoredTensor> tensors, std::vector<SegmentPtr> host_segments = {},
             std::unique_ptr<MemoryCharge> metadata_charge = nullptr,
             std::vector<CheckpointFileInfo> file_info = {});

  const std::string& path() const { return path_; }
  const std::vector<std::string>& files() const { return files_; }
  // Sorted by name.
  const std::vector<StoredTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const StoredTensor* Find(absl::string_view name) const;
  uint64_t total_bytes() const { return total_bytes_; }
  const std::vector<SegmentPtr>& host_segments() const { return host_segments_; }
  // Per file, in order (empty for checkpoints not read from files), and
  // the CheckpointKey of their ids (zero when empty).
  const std::vector<CheckpointFileInfo>& file_info() const { return file_info_; }
  const Digest& content_key() const { return content_key_; }
  // XXH3-128 over the tensors' digests in name order: which copy of a key
  // a holder offers (PeerHolding::copy).
  const Digest& copy_id() const { return copy_id_; }
  // Bytes of the checkpoint's segments by the pages behind them (indexed by
  // PageKind: 4 KiB, THP-advised shmem, 2 MiB hugetlb), rounding included.
  const std::array<uint64_t, kPageKinds>& page_bytes() const { return page_bytes_; }
  // Budget bytes held for the tensors' metadata (0 without a charge).
  uint64_t metadata_bytes() const { return metadata_charge_ ? metadata_charge_->bytes() : 0; }
  // The metadata charge, for a caller that drops this checkpoint in favour
  // of an identical resident one (LoadCheckpoint) and keeps the charge.
  std::unique_ptr<MemoryCharge> TakeMetadataCharge() { return std::move(metadata_charge_); }
  // Bytes of tensors whose buffers other checkpoints or generations hold
  // (a load that shared them: ShareHeldTensors); total_bytes() less these
  // is what this checkpoint's own segments hold. Such a checkpoint has no
  // file_info(): its segments are not laid out by file.
  uint64_t bytes_held_elsewhere() const { return bytes_held_elsewhere_; }
  void set_bytes_held_elsewhere(uint64_t bytes) { bytes_held_elsewhere_ = bytes; }

 private:
  std::string path_;
  std::vector<std::string> files_;
  std::vector<StoredTensor> tensors_;
  std::vector<SegmentPtr> host_segments_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  uint64_t total_bytes_ = 0;
  std::array<uint64_t, kPageKinds> page_bytes_{};
  std::unique_ptr<MemoryCharge> metadata_charge_;
  std::vector<CheckpointFileInfo> file_info_;
  Digest content_key_;
  Digest copy_id_;
  uint64_t bytes_held_elsewhere_ = 0;
};

// Checkpoints resident in memory by the identity of their files: each
// file's path, device, inode, size, mtime and ctime, in order. A load whose
// files are all resident already (the same checkpoint under another
// model's name, or seen through another profile) shares that checkpoint's
// memory instead of reading a second copy. Any write to a file changes its
// ctime, even one that puts the mtime back, so a rewritten file is read
// again. Entries die with their checkpoint. Thread-safe.
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

 private:
  struct Entry {
    std::weak_ptr<const Checkpoint> checkpoint;
    Digest content_key;
    uint64_t added = 0;  // order of Add
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> by_files_ ABSL_GUARDED_BY(mu_);
  uint64_t adds_ ABSL_GUARDED_BY(mu_) = 0;
};

// A resident checkpoint other than `c` whose files are byte for byte c's
// (in order: the same sizes, headers and data sections; names and paths may
// differ), or null.
std::shared_ptr<const Checkpoint> FindIdenticalCopy(const ResidentCheckpoints& resident,
                                                    const Checkpoint& c);

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
// once they check out). Thread-safe.
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
  const AdoptVerify verify_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, DonatedCheckpoint> by_files_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> adopted_{0};
  std::atomic<uint64_t> refused_{0};
};

struct LoadProgressInfo {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  uint64_t tensors_done = 0;
  uint64_t tensors_total = 0;
  std::string current_file;
  // Where the bytes done came from (peers: the addresses that sent some).
  uint64_t bytes_from_storage = 0;
  uint64_t bytes_from_peers = 0;
  std::vector<std::string> peers;
};
using LoadProgressFn = std::function<void(const LoadProgressInfo&)>;

struct CheckpointLoadOptions {
  HostMemoryManager* memory = nullptr;  // required; allocates and charges
  // Segments are filled up to this size; a file larger than it gets one of
  // its own.
  uint64_t segment_target_bytes = 1ull << 30;
  // Bytes per pread() call.
  uint64_t read_chunk_bytes = 16ull << 20;
  // Threads reading and digesting in parallel.
  int read_threads = 2;
  LoadProgressFn progress;  // optional; called from loader threads
  // Opens `path` and every file it leads to (the index, each shard it
  // names, each file of a directory), each once, read through its fd; the
  // daemon passes its ModelRoots, which confines them all to the model
  // roots. nullptr: UnconfinedFileOpener (tests, tools).
  const FileOpener* files = nullptr;
  // Optional: files already resident are shared, not read again; what this
  // load reads is registered there. Two loads of the same files that run at
  // once both read (the later one is what later loads share).
  ResidentCheckpoints* resident = nullptr;
  // Required with `resident`. When the checkpoint returned is shared
  // (nothing was read, or what was read is identical to a resident copy of
  // other files and was freed), set to the budget charge for the tensors'
  // metadata, which the caller holds for what it builds per model (names,
  // layout, generations); left null otherwise.
  std::unique_ptr<MemoryCharge>* shared_charge = nullptr;
  // Optional: segments a predecessor daemon handed over. A load of files
  // one of them describes adopts its segments instead of reading (checked
  // as DonatedCheckpoints::verify() says); a mismatch is logged and the
  // files are read.
  DonatedCheckpoints* donated = nullptr;
  // Optional: the daemon's peers, asked for the files' bytes unless
  // `source` is kStorage (see LoadCheckpoint). kPeers without `peers` is
  // FAILED_PRECONDITION.
  CheckpointPeers* peers = nullptr;
  LoadSource source = LoadSource::kStorage;
  int peer_streams = 4;  // ranges transferred from peers at once
  // Storage bytes sampled per file to pick a holder's copy and turn away
  // other content early (pieces of peer_sample_bytes at random offsets, new
  // ones each load; sent to the peers), and as many again, never sent, to
  // compare with what the peers send (or more: peer_verify).
  int peer_samples_per_file = 8;
  uint64_t peer_sample_bytes = 64 << 10;
  PeerVerify peer_verify;
  // Optional out: where the bytes came from.
  LoadSourceReport* report = nullptr;
  // Optional out: the files this load opened, in order (the checkpoint
  // returned may list another copy's: a shared identical copy).
  std::vector<std::string>* opened_files = nullptr;
  // Optional: where memory already holds the bytes of a freshly read
  // checkpoint's tensors (one entry per tensor, in tensors() order; empty
  // where nothing does). When those make up over 1/8 of the checkpoint,
  // its tensors point at them and the rest moves to a segment of its size
  // (the files' segments are freed): see ShareHeldTensors.
  std::function<std::vector<std::optional<HeldElsewhere>>(const Checkpoint&)> find_held;
};

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

// Loads `path`, which is a .safetensors file, a directory holding
// model.safetensors.index.json (or that index file itself), or a directory
// of *.safetensors files (sorted by name). Files are read with
// pread (never mmap: a file truncated under the daemon must not SIGBUS it)
// and checked unchanged (size, mtime) after reading: DATA_LOSS otherwise.
// The tensors' metadata (TensorMetadataBytes each) is charged to
// `options.memory` once the headers are parsed, before any data is read:
// RESOURCE_EXHAUSTED when it does not fit.
// Errors name the file and the tensor. On failure nothing stays allocated.
//
// From peers (options.source kAuto or kPeers, with options.peers): after
// the headers are read, storage is sampled (peer_samples_per_file ranges
// per file) and the peers are asked who holds the same files
// (CheckpointKey) with the same bytes at the samples; holders that agree
// on every tensor digest supply ranges of read_chunk_bytes, spread across
// them by rendezvous hashing, peer_streams at once. Once they have sent
// them, what they sent is compared with storage's bytes at places they
// were never told (peer_verify: pieces per file, a share of the bytes, or
// all of them). A peer that fails a
// range (error, stall past its deadline) is dropped for the rest of the
// load; one whose bytes miss a tensor digest, a sample or storage's bytes
// is dropped with a peer_data_loss (DATA_LOSS) event, and what it sent is
// fetched again (options.report counts it as discarded).
// What no peer supplies comes from storage (kAuto), or the load fails
// UNAVAILABLE (kPeers). Storage's bytes are the truth: when storage itself
// disagrees with the peers' digests, everything is read from storage
// (kPeers: DATA_LOSS). kPeers with no holder: UNAVAILABLE.
//
// With options.resident, files that are byte for byte those of a resident
// checkpoint at other paths (a copy: the same number of files, each with
// the same size and header, and data sections that compare equal after
// reading) are not kept twice: the copy just read is freed and the resident
// checkpoint returned, as for the same files (options.shared_charge).
absl::StatusOr<std::shared_ptr<const Checkpoint>> LoadCheckpoint(
    const std::string& path, const CheckpointLoadOptions& options);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_H_
