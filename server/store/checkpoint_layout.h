// Where a load puts what it reads: the files' data sections laid out in
// segments, each tensor at its place, and the chunks the data is read in.
// Pure planning (no I/O, no memory taken) but DigestTensors, which digests
// what the chunks filled. Values and free functions; no state of their own.
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_LAYOUT_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_LAYOUT_H_

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/store/checkpoint.h"
#include "server/store/checkpoint_files.h"

namespace weightd {

inline constexpr uint64_t kSegmentAlign = 4096;

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The data sections in segments, in file order: each segment filled up to
// segment_target_bytes (a larger file gets one of its own), each file's
// data starting 4 KiB aligned.
struct LoadLayout {
  std::vector<uint64_t> segment_sizes;
  uint64_t bytes_total = 0;  // of every data section
  // Per file: its identity and place (what peers ask for and serve).
  std::vector<CheckpointFileInfo> file_info;
  // The tensors where the layout puts them (buffer and digest unset), in
  // file order, each file's by offset; and each one's segment, file and
  // offset in that file's data section.
  std::vector<StoredTensor> tensors;
  std::vector<size_t> tensor_segment;
  std::vector<size_t> tensor_file;
  std::vector<uint64_t> tensor_begin;
};

// Lays `files` out (setting each one's segment_index and segment_offset).
LoadLayout LayOut(CheckpointFiles& files, uint64_t segment_target_bytes);

// A range of one file's data section that a load fills (from storage or a
// peer), and where in the segments it goes.
struct Chunk {
  size_t file;
  uint64_t file_offset;  // in the file (the data section's offset included)
  uint64_t length;
  uint8_t* dest;
  uint64_t data_begin;  // in the file's data section
  size_t group;         // chunks of one group come from one holder
};

// Every data section in chunks of at most chunk_bytes, in groups: whole
// tensors packed together, or one large tensor's pieces. A group comes
// from one holder (while it lasts), so a tensor that misses its digest
// names the peer that sent it.
struct ChunkPlan {
  std::vector<Chunk> chunks;  // file by file, each file's in order
  // File i's chunks are [first_chunk[i], first_chunk[i + 1]).
  std::vector<size_t> first_chunk;
  // Where file i's data section lies in the segments.
  std::vector<uint8_t*> file_data;

  // The chunks under a byte range of a file's data section.
  std::vector<size_t> Under(size_t file, uint64_t begin, uint64_t length) const;
};

// `file_data`: where each file's data section goes (its segment's bytes
// at its segment_offset).
ChunkPlan PlanChunks(const std::vector<CheckpointFile>& files, const LoadLayout& layout,
                     std::vector<uint8_t*> file_data, uint64_t chunk_bytes);

// Sets each tensor's digest to that of its bytes where `plan` put them, on
// `threads` threads.
absl::Status DigestTensors(LoadLayout& layout, const ChunkPlan& plan, int threads);

// Digests each tensor as its bytes arrive: once every chunk under it has
// landed (ChunkDone), on the thread that landed the last one, so that
// digesting overlaps the reads still in flight instead of following them.
// Thread-safe: ChunkDone may be called from the reader threads at once,
// once per chunk. Borrows `layout` (whose digests it sets) and `plan`.
class DigestAsRead {
 public:
  DigestAsRead(LoadLayout& layout, const ChunkPlan& plan);
  DigestAsRead(const DigestAsRead&) = delete;
  DigestAsRead& operator=(const DigestAsRead&) = delete;

  // Chunk `chunk` of the plan holds its bytes (written before the call).
  void ChunkDone(size_t chunk);
  // Tensors digested so far.
  size_t digested() const { return digested_.load(); }

 private:
  void Digest(size_t tensor);

  // Constant after construction.
  LoadLayout& layout_;
  const ChunkPlan& plan_;
  std::vector<std::vector<size_t>> tensors_of_chunk_;
  // Own synchronization: per tensor, the chunks under it still to land.
  std::unique_ptr<std::atomic<uint32_t>[]> pending_;
  std::atomic<size_t> digested_{0};
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_LAYOUT_H_
