#include "server/store/storage_read.h"

#include <errno.h>
#include <sys/mman.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {

absl::Status PopulateForWrite(uint8_t* dest, uint64_t length) {
#ifdef MADV_POPULATE_WRITE
  uintptr_t begin = reinterpret_cast<uintptr_t>(dest) / kSegmentAlign * kSegmentAlign;
  uintptr_t end = AlignUp(reinterpret_cast<uintptr_t>(dest) + length, kSegmentAlign);
  if (length > 0 &&
      ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM || errno == ENOSPC || errno == EFAULT) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocating ", end - begin, " bytes of shared memory: ", std::strerror(errno)));
    }
    // EINVAL (older kernel): pread() faults the pages in instead.
  }
#endif
  return absl::OkStatus();
}

void PopulateForRead(const uint8_t* data, uint64_t length) {
#ifdef MADV_POPULATE_READ
  uintptr_t begin = reinterpret_cast<uintptr_t>(data) / kSegmentAlign * kSegmentAlign;
  uintptr_t end = AlignUp(reinterpret_cast<uintptr_t>(data) + length, kSegmentAlign);
  if (length > 0) {
    (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);
  }
#endif
}

absl::Status StorageReader::ReadChunk(const Chunk& c, bool count) const {
  const CheckpointFile& f = files_[c.file];
  WD_RETURN_IF_ERROR(CancelledStatus(f.opened.cancel));
  WD_RETURN_IF_ERROR_CTX(PopulateForWrite(c.dest, c.length), "reading ", f.path());
  WD_RETURN_IF_ERROR_CTX(opener_.ReadAt(f.opened, c.file_offset, c.length, c.dest), "reading ",
                         f.path());
  tally_.StorageRead(c.length, f.path(), count);
  return absl::OkStatus();
}

absl::Status StorageReader::ReadAll(const ChunkPlan& plan, int threads,
                                    DigestAsRead* digest) const {
  return ParallelFor(nullptr, plan.chunks.size(), threads, [&](size_t i) {
    WD_RETURN_IF_ERROR(ReadChunk(plan.chunks[i], /*count=*/true));
    if (digest != nullptr) digest->ChunkDone(i);
    return absl::OkStatus();
  });
}

absl::Status StorageReader::ReadData(size_t file, uint64_t offset, uint64_t length,
                                     void* dest) const {
  const CheckpointFile& f = files_[file];
  WD_RETURN_IF_ERROR_CTX(opener_.ReadAt(f.opened, f.header.data_offset + offset, length, dest),
                         "reading ", f.path());
  tally_.StorageRead(length, f.path(), /*count=*/false);
  return absl::OkStatus();
}

}  // namespace weightd
