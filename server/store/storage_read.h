// Reading a load's bytes from storage: its chunks into the segments, and
// pieces of the files' data sections (samples, checks of peers' bytes),
// all through the file seam (FileOpener::ReadAt) and counted in the load's
// tally.
#ifndef WEIGHTD_SERVER_STORE_STORAGE_READ_H_
#define WEIGHTD_SERVER_STORE_STORAGE_READ_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/file_opener.h"
#include "server/store/checkpoint_files.h"
#include "server/store/checkpoint_layout.h"
#include "server/store/load_tally.h"

namespace weightd {

// Allocates and maps the shared-memory pages under [dest, dest + length)
// (rounded out to pages) in one call instead of a fault per page while
// pread() copies; RESOURCE_EXHAUSTED when the memory is not there.
absl::Status PopulateForWrite(uint8_t* dest, uint64_t length);
// Best effort: fills the page tables of a read-only mapped range, so
// fetches and casts reading it take no page faults.
void PopulateForRead(const uint8_t* data, uint64_t length);

// Reads one load's files. Thread-safe: const after construction, shared by
// the reader threads. Borrows everything it is given; all of it outlives
// the reader.
class StorageReader {
 public:
  StorageReader(const FileOpener& opener, const std::vector<CheckpointFile>& files,
                LoadTally& tally)
      : opener_(opener), files_(files), tally_(tally) {}

  // Reads chunk `c` into its place (its pages populated first); with
  // `count`, as progress too. Errors name the file ("reading PATH: ...").
  absl::Status ReadChunk(const Chunk& c, bool count) const;
  // Reads every chunk of `plan`, `threads` at once, as progress; each
  // chunk read is told to `digest` (if any), which digests the tensors it
  // completes.
  absl::Status ReadAll(const ChunkPlan& plan, int threads,
                       DigestAsRead* digest = nullptr) const;
  // Reads `length` bytes at `offset` of file `file`'s data section into
  // `dest` (a sample, a check). Errors name the file.
  absl::Status ReadData(size_t file, uint64_t offset, uint64_t length, void* dest) const;

 private:
  // Constant after construction.
  const FileOpener& opener_;
  const std::vector<CheckpointFile>& files_;
  // Own synchronization.
  LoadTally& tally_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_STORAGE_READ_H_
