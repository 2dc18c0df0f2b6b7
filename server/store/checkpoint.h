// A checkpoint: an immutable set of named tensors read from safetensors into
// sealed memfd segments. Shared as std::shared_ptr<const Checkpoint> by the
// models that serve it and by in-flight fetches; thread-safe once built.
//
// The store's files, bottom up: checkpoint.h (this value), checkpoint_files.h
// (opening the safetensors files), checkpoint_layout.h (where a load puts
// their bytes), load_tally.h (progress and where the bytes came from),
// peer_read.h (the bytes from peers, checked against storage),
// resident_checkpoints.h and donated_checkpoints.h (what memory holds
// already, and what a predecessor handed over), checkpoint_loader.h
// (LoadCheckpoint: the phases of a load).
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/digest.h"
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
  // A remote object's version (its ETag; OpenedFile::version), "" for a
  // file: `path` is then its URL.
  std::string version;
};

// The checkpoint itself: its tensors, the segments behind them, its files'
// identities and the budget charge for its metadata, all owned. Immutable
// once shared: thread-safe as a std::shared_ptr<const Checkpoint>. The two
// mutators (TakeMetadataCharge, set_bytes_held_elsewhere) are for the
// loader that builds it, before anyone else sees it.
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
  // Constant after construction.
  std::string path_;
  std::vector<std::string> files_;
  std::vector<StoredTensor> tensors_;
  std::vector<SegmentPtr> host_segments_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  uint64_t total_bytes_ = 0;
  std::array<uint64_t, kPageKinds> page_bytes_{};
  std::vector<CheckpointFileInfo> file_info_;
  Digest content_key_;
  Digest copy_id_;

  // Set by the loader before the checkpoint is shared.
  std::unique_ptr<MemoryCharge> metadata_charge_;
  uint64_t bytes_held_elsewhere_ = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_H_
