#include "server/push/host_push.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"
#include "server/kernels/merge.h"
#include "common/status_macros.h"
#include "server/memory/buffer.h"
#include "server/push/push_plan.h"

namespace weightd {
namespace {

constexpr uint64_t kChunk = uint64_t{64} << 20;
// A cast is converted into a bounce buffer of at most this, then written:
// small enough to stay in cache between the two.
constexpr uint64_t kCastChunk = uint64_t{2} << 20;

// Writes [data, data + length) at `offset` of the destination.
absl::Status WriteAt(int fd, const uint8_t* data, uint64_t length, uint64_t offset) {
  uint64_t done = 0;
  while (done < length) {
    ssize_t w = ::pwrite(fd, data + done, static_cast<size_t>(length - done),
                         static_cast<off_t>(offset + done));
    if (w < 0) {
      int err = errno;
      if (err == EINTR) continue;
      if (err == EPERM) {
        return absl::AbortedError(
            "the client changed the destination during the push (a write seal, or O_APPEND "
            "against its size seal): the write was refused");
      }
      if (err == ENOSPC || err == EFBIG || err == ENOMEM) {
        return absl::ResourceExhaustedError(
            absl::StrCat("writing the push's destination: ", std::strerror(err)));
      }
      return absl::AbortedError(
          absl::StrCat("writing the push's destination: ", std::strerror(err)));
    }
    if (w == 0) return absl::AbortedError("writing the push's destination: no progress");
    done += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckHostDestination(int fd, const PushLayout& layout) {
  if (fd < 0 || ::fcntl(fd, F_GETFD) < 0) {
    return absl::InvalidArgumentError("the push's destination is not an open fd");
  }
  // What it is, asked without calling into its filesystem (fstat of a file
  // on a FUSE mount waits for the FUSE server): F_GET_SEALS answers for
  // shmem files only, the /proc link names the rest.
  char link[128] = {};
  ssize_t n = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
  const absl::string_view what(link, n > 0 ? static_cast<size_t>(n) : 0);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  // A tmpfs file (/dev/shm) answers F_GET_SEALS too.
  if (seals < 0 || (n > 0 && !absl::StartsWith(what, "/memfd:"))) {
    const char* kind = absl::StartsWith(what, "pipe:")          ? "a pipe"
                       : absl::StartsWith(what, "socket:")      ? "a socket"
                       : absl::StartsWith(what, "anon_inode:") ? "an anonymous inode"
                                                                : "a file";
    return absl::InvalidArgumentError(
        absl::StrCat("the push's destination is ", kind, ", not a memfd (memfd_create)"));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("the push's destination is not a memfd (memfd_create)");
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC) {
    return absl::UnimplementedError(
        "the push's destination is a hugetlbfs memfd (MFD_HUGETLB), which takes no writes "
        "but through a mapping; pass a plain memfd");
  }
  int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_ACCMODE) == O_RDONLY) {
    return absl::FailedPreconditionError(
        "the push's destination fd is read-only; pass the memfd opened for writing");
  }
  if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
    return absl::FailedPreconditionError(
        "the push's destination is sealed against writes (F_SEAL_WRITE / F_SEAL_FUTURE_WRITE)");
  }
  // Its size must be fixed: one that may shrink mid-push would have the
  // daemon's writes past its new end grow it back, one that may grow lets
  // pages be allocated past the end (fallocate KEEP_SIZE) or writes be moved
  // there (O_APPEND on the client's side of the shared file description),
  // each with pages charged to the daemon. No check between writes closes
  // those races; the seals do.
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    return absl::FailedPreconditionError(
        "the push's destination is not sealed against shrinking and growing: create it with "
        "memfd_create(MFD_ALLOW_SEALING), size and fallocate it, then "
        "fcntl(F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)");
  }
  if (static_cast<uint64_t>(st.st_size) < layout.size) {
    return absl::InvalidArgumentError(absl::StrCat("the push's destination has ", st.st_size,
                                                   " bytes; its layout needs ", layout.size));
  }
  // Its pages must be the client's: all of them allocated (st_blocks:
  // written or fallocated; which pages cannot be asked — SEEK_HOLE and
  // mincore call fallocated-but-unwritten shmem pages holes). With the size
  // sealed, the daemon's writes then allocate nothing — unless the client
  // punches holes into it mid-push (F_SEAL_SHRINK does not stop
  // FALLOC_FL_PUNCH_HOLE): the daemon refills those, at most the push's
  // bytes, and the client gets them back in its buffer.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t whole = (static_cast<uint64_t>(st.st_size) + page - 1) / page * page;
  const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
  if (allocated < whole) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the push's destination has ", allocated, " of its ", whole,
        " bytes allocated: allocate it whole (fallocate) before the push, so its memory is "
        "the client's"));
  }
  return absl::OkStatus();
}

namespace {

// The push's copies, casts and merges (CheckLeaseTensors first, through
// MakePushJob), each piece handed to `write` (bytes, length, offset in the
// destination).
absl::Status CopyLease(const LeaseContents& lease, const PushLayout& layout,
                       const std::atomic<bool>* cancel,
                       const std::function<absl::Status(const uint8_t*, uint64_t, uint64_t)>& write) {
  WD_ASSIGN_OR_RETURN(PushJob job, MakePushJob(lease, layout,
                                               {.max_copy_bytes = kChunk,
                                                .max_cast_bytes = kCastChunk}));
  std::vector<uint8_t> bounce;
  for (const PushJobCopy& copy : job.copies) {
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
      return absl::UnavailableError("the daemon is shutting down; the push was cut short");
    }
    const uint8_t* src = copy.src;
    if (copy.cast) {
      // The host twin of the CUDA push's cast on the GPU: the same pieces,
      // converted by the CPU's kernels (bit for bit the GPU's, cast_test).
      if (bounce.size() < copy.dst_length) bounce.resize(copy.dst_length);
      const size_t count = copy.length / DTypeSize(copy.src_dtype);
      if (copy.merge >= 0) {
        // And the GPU's merge: the same element function (merge_elements.h).
        const PushJobMerge& merge = job.merges[static_cast<size_t>(copy.merge)];
        WD_RETURN_IF_ERROR(MergeBufferHost(copy.src_dtype, src, copy.dst_dtype, bounce.data(),
                                           count, copy.first_element, merge.row_begin,
                                           merge.cols, {merge.terms, merge.num_terms}));
      } else {
        WD_RETURN_IF_ERROR(
            CastBuffer(copy.src_dtype, src, copy.dst_dtype, bounce.data(), count));
      }
      src = bounce.data();
    }
    WD_RETURN_IF_ERROR(write(src, copy.dst_length, copy.dst_offset));
  }
  return absl::OkStatus();
}

// What a lease must be for either push.
absl::Status CheckLeaseForHostPush(const LeaseContents& lease, const PushLayout& layout) {
  const size_t n = lease.tensors == nullptr ? 0 : lease.tensors->size();
  if (layout.offsets.size() != n || layout.lengths.size() != n) {
    return absl::InternalError("push layout does not match the lease");
  }
  for (size_t i = 0; i < lease.buffers.size(); ++i) {
    if (lease.buffers[i]->kind() != MemoryKind::kHost) {
      return absl::UnimplementedError(absl::StrCat(
          "segment ", i, " is in ", MemoryKindName(lease.buffers[i]->kind()),
          " memory; a push into host memory copies host memory only"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PushToHost(const LeaseContents& lease, const PushLayout& layout, int fd,
                        const std::atomic<bool>* cancel) {
  WD_RETURN_IF_ERROR(CheckLeaseForHostPush(lease, layout));
  if (absl::Status s = CheckHostDestination(fd, layout); !s.ok()) return s;
  if (lease.tensors == nullptr || lease.tensors->empty()) return absl::OkStatus();
  return CopyLease(lease, layout, cancel,
                   [fd](const uint8_t* data, uint64_t length, uint64_t offset) {
                     return WriteAt(fd, data, length, offset);
                   });
}

absl::Status CopyLeaseToHost(const LeaseContents& lease, const PushLayout& layout, uint8_t* dest,
                             uint64_t dest_size, const std::atomic<bool>* cancel) {
  WD_RETURN_IF_ERROR(CheckLeaseForHostPush(lease, layout));
  if (layout.size > dest_size) {
    return absl::InternalError(absl::StrCat("a copy of ", layout.size, " bytes into ",
                                            dest_size));
  }
  if (lease.tensors == nullptr || lease.tensors->empty()) return absl::OkStatus();
  return CopyLease(lease, layout, cancel,
                   [dest](const uint8_t* data, uint64_t length, uint64_t offset) {
                     std::memcpy(dest + offset, data, static_cast<size_t>(length));
                     return absl::OkStatus();
                   });
}

}  // namespace weightd
