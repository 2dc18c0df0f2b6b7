#include "server/transport/host_push.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/memory/buffer.h"
#include "server/transport/push_plan.h"

namespace weightd {
namespace {

constexpr uint64_t kChunk = uint64_t{64} << 20;

const char* FileKind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a pipe";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISDIR(mode)) return "a directory";
  return "a file";
}

absl::Status SizeKept(int fd, uint64_t needed) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::AbortedError(absl::StrCat("destination: fstat: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < needed) {
    return absl::AbortedError(absl::StrCat("the destination shrank to ", st.st_size,
                                           " bytes during the push (it needs ", needed, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PushLayout> LayoutForPush(const LeaseContents& lease,
                                         absl::Span<const uint64_t> offsets) {
  std::vector<uint64_t> lengths;
  if (lease.tensors != nullptr) {
    lengths.reserve(lease.tensors->size());
    for (const LeaseTensor& t : *lease.tensors) lengths.push_back(t.length);
  }
  if (offsets.empty()) return DefaultPushLayout(lengths);
  return CheckPushLayout(lengths, offsets);
}

absl::Status CheckHostDestination(int fd, const PushLayout& layout) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError("the push's destination is not an open fd");
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the push's destination is ", FileKind(st.st_mode), ", not a memfd"));
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC) {
    return absl::UnimplementedError(
        "the push's destination is a hugetlbfs memfd (MFD_HUGETLB), which takes no writes "
        "but through a mapping; pass a plain memfd");
  }
  int seals = ::fcntl(fd, F_GET_SEALS);
  bool memfd = seals >= 0;
  if (memfd) {
    char link[64] = {};
    ssize_t n = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
    // A tmpfs file (/dev/shm) answers F_GET_SEALS too.
    if (n > 0 && !absl::StartsWith(absl::string_view(link, n), "/memfd:")) memfd = false;
  }
  if (!memfd) {
    return absl::InvalidArgumentError(
        "the push's destination is a file, not a memfd (memfd_create)");
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
  // A destination that may shrink mid-push would have the daemon's writes
  // past its new end grow it back, with pages the daemon allocates: no
  // check between writes closes that race, the seal does.
  if (!(seals & F_SEAL_SHRINK)) {
    return absl::FailedPreconditionError(
        "the push's destination is not sealed against shrinking: create it with "
        "memfd_create(MFD_ALLOW_SEALING), size and fallocate it, then "
        "fcntl(F_ADD_SEALS, F_SEAL_SHRINK)");
  }
  if (static_cast<uint64_t>(st.st_size) < layout.size) {
    return absl::InvalidArgumentError(absl::StrCat("the push's destination has ", st.st_size,
                                                   " bytes; its layout needs ", layout.size));
  }
  // The pages the push writes must be the client's: the memfd must have at
  // least as many allocated (st_blocks: written or fallocated) as the
  // tensors' ranges cover. (Which pages cannot be asked: SEEK_HOLE and
  // mincore call fallocated-but-unwritten shmem pages holes.) So a push
  // makes the daemon allocate nothing beyond what the client allocated.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uint64_t, uint64_t>> pages;  // [first, last] per tensor
  for (size_t i = 0; i < layout.offsets.size(); ++i) {
    if (layout.lengths[i] == 0) continue;
    pages.emplace_back(layout.offsets[i] / page,
                       (layout.offsets[i] + layout.lengths[i] - 1) / page);
  }
  std::sort(pages.begin(), pages.end());
  uint64_t needed = 0, covered_to = 0;  // pages [0, covered_to) counted
  for (const auto& [first, last] : pages) {
    uint64_t from = std::max(first, covered_to);
    if (last + 1 > from) needed += last + 1 - from;
    covered_to = std::max(covered_to, last + 1);
  }
  const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
  if (allocated < needed * page) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the push's destination has ", allocated, " bytes allocated; its tensors cover ",
        needed * page, ": allocate it whole (fallocate) before the push, so its memory is "
        "the client's"));
  }
  return absl::OkStatus();
}

absl::Status PushToHost(const LeaseContents& lease, const PushLayout& layout, int fd,
                        const std::atomic<bool>* cancel) {
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
  if (absl::Status s = CheckHostDestination(fd, layout); !s.ok()) return s;
  if (absl::Status s = CheckLeaseTensors(lease); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  for (const PushCopy& copy : PlanPushCopies(*lease.tensors, layout, {.max_copy_bytes = kChunk})) {
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
      return absl::UnavailableError("the daemon is shutting down; the push was cut short");
    }
    const uint8_t* src = lease.buffers[copy.buffer]->host_data() + copy.src_offset;
    uint64_t done = 0;
    while (done < copy.length) {
      ssize_t w = ::pwrite(fd, src + done, static_cast<size_t>(copy.length - done),
                           static_cast<off_t>(copy.dst_offset + done));
      if (w < 0) {
        int err = errno;
        if (err == EINTR) continue;
        if (err == EPERM) {
          return absl::AbortedError(
              "the destination was sealed against writes during the push (write refused)");
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
  }
  return SizeKept(fd, layout.size);
}

}  // namespace weightd
