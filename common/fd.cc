#include "common/fd.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)  // MFD_HUGE_SHIFT = 26, log2(2 MiB) = 21
#endif

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

namespace weightd {

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
    case EISDIR:
    case ENAMETOOLONG:
    case ELOOP:
      return absl::InvalidArgumentError(msg);
    case EAGAIN:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

const char* PageKindName(PageKind kind) {
  switch (kind) {
    case PageKind::kSmall:
      return "4k";
    case PageKind::kTransparentHuge:
      return "thp";
    case PageKind::kHugetlb:
      return "2m_hugetlb";
  }
  return "?";
}

namespace {

// mmap()s `length` bytes of `fd` at a 2 MiB-aligned address when `length`
// is at least 2 MiB (a PROT_NONE reservation one huge page larger, the file
// mapped over its aligned part with MAP_FIXED, the slack unmapped), else
// wherever the kernel puts it. Returns MAP_FAILED with errno set.
void* MmapAligned(size_t length, int prot, int flags, int fd) {
  if (length < kHugePageBytes) return ::mmap(nullptr, length, prot, flags, fd, 0);
  const size_t span = length + kHugePageBytes;
  void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return MAP_FAILED;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  void* addr = ::mmap(reinterpret_cast<void*>(aligned), length, prot, flags | MAP_FIXED, fd, 0);
  if (addr == MAP_FAILED) {
    const int err = errno;
    ::munmap(raw, span);
    errno = err;
    return MAP_FAILED;
  }
  if (aligned > base) ::munmap(raw, aligned - base);
  const uintptr_t end = aligned + length, raw_end = base + span;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t tail = (end + page - 1) & ~(page - 1);
  if (raw_end > tail) ::munmap(reinterpret_cast<void*>(tail), raw_end - tail);
  return addr;
}

// The page size of a hugetlbfs file; 0 for any other file.
size_t HugetlbPageSize(int fd) {
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0 || fs.f_type != HUGETLBFS_MAGIC) return 0;
  return static_cast<size_t>(fs.f_bsize);
}

}  // namespace

absl::StatusOr<MappedRegion> MappedRegion::Map(int fd, size_t size, Mode mode,
                                               bool populate) {
  if (size == 0) return MappedRegion();
  int prot = mode == Mode::kReadOnly ? PROT_READ : PROT_READ | PROT_WRITE;
  int flags = mode == Mode::kCopyOnWrite ? MAP_PRIVATE : MAP_SHARED;
  if (populate) flags |= MAP_POPULATE;
  // A hugetlbfs mapping spans whole huge pages (munmap of a part fails);
  // a private one would reserve a pool page per page of it up front.
  if (const size_t huge = HugetlbPageSize(fd); huge != 0) {
    size = (size + huge - 1) / huge * huge;
    if (mode == Mode::kCopyOnWrite) flags |= MAP_NORESERVE;
  }
  void* addr = MmapAligned(size, prot, flags, fd);
  if (addr == MAP_FAILED) return ErrnoStatus(errno, "mmap");
  return MappedRegion(addr, size);
}

absl::Status MappedRegion::PopulateRead(size_t offset, size_t length) const {
#ifndef MADV_POPULATE_READ
  return absl::UnimplementedError("MADV_POPULATE_READ is not available");
#else
  if (length == 0) return absl::OkStatus();
  if (offset > size_ || length > size_ - offset) {
    return absl::OutOfRangeError("PopulateRead: range outside the mapping");
  }
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t begin = offset / page * page;
  size_t end = std::min(size_, (offset + length + page - 1) / page * page);
  if (::madvise(data() + begin, end - begin, MADV_POPULATE_READ) != 0) {
    if (errno == EINVAL) return absl::UnimplementedError("MADV_POPULATE_READ unsupported");
    return ErrnoStatus(errno, "madvise(MADV_POPULATE_READ)");
  }
  return absl::OkStatus();
#endif
}

void MappedRegion::Reset() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
}

absl::StatusOr<MemfdSegment> MemfdSegment::Create(absl::string_view name, size_t size,
                                                  bool prefault, PageKind pages) {
  std::string cname(name);
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
  if (pages == PageKind::kHugetlb) flags |= MFD_HUGETLB | MFD_HUGE_2MB;
  if (pages != PageKind::kSmall) size = RoundUpToHugePage(size);
  int raw = ::memfd_create(cname.c_str(), flags);
  if (raw < 0) {
    return ErrnoStatus(errno, pages == PageKind::kHugetlb ? "memfd_create(MFD_HUGETLB)"
                                                          : "memfd_create");
  }
  MemfdSegment seg;
  seg.fd_.Reset(raw);
  seg.size_ = size;
  seg.pages_ = pages;
  if (::ftruncate(raw, static_cast<off_t>(size)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("ftruncate memfd to ", size, " bytes"));
  }
  if (size == 0) return seg;
  switch (pages) {
    case PageKind::kSmall: {
      // Allocating the pages with fallocate and then filling the page tables
      // in one call is about twice as fast here as MAP_POPULATE, and several
      // times faster than faulting them in one by one while writing.
      if (prefault && ::fallocate(raw, 0, 0, static_cast<off_t>(size)) != 0) {
        return ErrnoStatus(errno, absl::StrCat("allocating ", size, " bytes of shared memory"));
      }
      void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, raw, 0);
      if (addr == MAP_FAILED) return ErrnoStatus(errno, "mmap memfd");
      seg.map_ = MappedRegion(addr, size);
      break;
    }
    case PageKind::kHugetlb: {
      // A shared hugetlb mapping reserves all its pages from the pool now
      // (ENOMEM when the pool is short), so touching them later never
      // faults without a page (SIGBUS).
      void* addr = MmapAligned(size, PROT_READ | PROT_WRITE, MAP_SHARED, raw);
      if (addr == MAP_FAILED) {
        const int err = errno;
        if (err == ENOMEM || err == ENOSPC) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the hugetlb pool has fewer than ", size / kHugePageBytes,
              " free 2 MiB pages (", size, " bytes)"));
        }
        return ErrnoStatus(err, "mmap hugetlb memfd");
      }
      seg.map_ = MappedRegion(addr, size);
      break;
    }
    case PageKind::kTransparentHuge: {
      void* addr = MmapAligned(size, PROT_READ | PROT_WRITE, MAP_SHARED, raw);
      if (addr == MAP_FAILED) return ErrnoStatus(errno, "mmap memfd");
      seg.map_ = MappedRegion(addr, size);
      // The pages come huge when faulted through an advised mapping
      // (fallocate would allocate them small).
      if (::madvise(addr, size, MADV_HUGEPAGE) != 0) {
        return ErrnoStatus(errno, "madvise(MADV_HUGEPAGE)");
      }
      break;
    }
  }
#ifdef MADV_POPULATE_WRITE
  if (prefault) (void)::madvise(seg.map_.data(), size, MADV_POPULATE_WRITE);  // best effort
#endif
  return seg;
}

absl::StatusOr<MemfdSegment> MemfdSegment::Adopt(UniqueFd fd, PageKind pages) {
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "adopting a segment: fd ", fd.get(), " is not a sealable memfd: ", std::strerror(errno)));
  }
  const int need_shape = F_SEAL_GROW | F_SEAL_SHRINK;
  if ((seals & need_shape) != need_shape || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "adopting a segment: memfd fd ", fd.get(), " is not sealed against writes and resizing "
        "(seals 0x", absl::Hex(seals), ")"));
  }
  struct statfs fs;
  if (::fstatfs(fd.get(), &fs) != 0) return ErrnoStatus(errno, "fstatfs on an adopted memfd");
  const bool hugetlb = static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC;
  if (hugetlb != (pages == PageKind::kHugetlb)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "adopting a segment: memfd fd ", fd.get(), " is ", hugetlb ? "" : "not ",
        "hugetlb, but was described as ", PageKindName(pages)));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat on an adopted memfd");
  MemfdSegment seg;
  seg.size_ = static_cast<size_t>(st.st_size);
  seg.pages_ = pages;
  if (seg.size_ > 0) {
    auto map = MappedRegion::Map(fd.get(), seg.size_, MappedRegion::Mode::kReadOnly,
                                 /*populate=*/true);
    if (!map.ok()) return map.status();
    seg.map_ = std::move(*map);
  }
  seg.fd_ = std::move(fd);
  seg.sealed_ = true;
  seg.kept_mapping_ = true;
  return seg;
}

namespace {
// Whether the running kernel is at least major.minor (uname).
bool KernelAtLeast(int major, int minor) {
  static const std::pair<int, int> version = [] {
    struct utsname u;
    int ma = 0, mi = 0;
    if (::uname(&u) == 0) (void)std::sscanf(u.release, "%d.%d", &ma, &mi);
    return std::make_pair(ma, mi);
  }();
  return version >= std::make_pair(major, minor);
}
}  // namespace

absl::Status MemfdSegment::Seal(bool populate, bool keep_writable) {
  if (sealed_) return absl::OkStatus();
  constexpr int kShape = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
  // F_SEAL_FUTURE_WRITE forbids write(), new writable shared mappings and
  // hole punching to everyone, and keeps our mapping: it is made read-only
  // in place, its page tables stay filled, and the seal does not pay for
  // tearing them down and mapping again (~0.1 s per GiB here). Used from
  // Linux 5.10 on: earlier kernels had a copy-on-write bug with private
  // writable mappings of F_SEAL_FUTURE_WRITE files (the Python client maps
  // segments that way), fixed in 5.10. With `keep_writable` the mapping is
  // left as it is: the seal binds new mappings and writes through the fd,
  // not mappings made before it.
  if (KernelAtLeast(5, 10)) {
    const bool protect = !keep_writable && map_.size() > 0;
    if (protect && ::mprotect(map_.data(), map_.size(), PROT_READ) != 0) {
      return ErrnoStatus(errno, "making the memfd's mapping read-only");
    }
    if (::fcntl(fd_.get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE | kShape) == 0) {
      if (populate && size_ > 0) (void)map_.PopulateRead(0, size_);  // best effort
      sealed_ = true;
      kept_mapping_ = true;
      writable_after_seal_ = keep_writable && map_.size() > 0;
      return absl::OkStatus();
    }
    const int err = errno;
    if (err != EINVAL) {
      // Not sealed: leave the segment as it was, writable.
      if (protect) (void)::mprotect(map_.data(), map_.size(), PROT_READ | PROT_WRITE);
      return ErrnoStatus(err, "sealing memfd");
    }
  }
  // Older kernels: F_SEAL_WRITE fails while a writable shared mapping
  // exists, so drop ours first and map the sealed file read-only.
  return SealExclusive(populate);
}

absl::Status MemfdSegment::SealExclusive(bool populate) {
  if (sealed_) return absl::OkStatus();
  constexpr int kSeals = F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
  map_.Reset();
  if (::fcntl(fd_.get(), F_ADD_SEALS, kSeals) != 0) {
    const int err = errno;
    if (size_ > 0) {
      auto map = MappedRegion::Map(fd_.get(), size_, MappedRegion::Mode::kReadWrite);
      if (map.ok()) map_ = std::move(*map);
    }
    if (err == EBUSY) {
      return absl::FailedPreconditionError(
          "another process still maps the memfd with write access (or pins its pages); "
          "it must unmap it first");
    }
    return ErrnoStatus(err, "sealing memfd against writes");
  }
  if (size_ > 0) {
    auto map = MappedRegion::Map(fd_.get(), size_, MappedRegion::Mode::kReadOnly, populate);
    if (!map.ok()) return map.status();
    map_ = std::move(*map);
  }
  sealed_ = true;
  return absl::OkStatus();
}

absl::Status MemfdSegment::Truncate(size_t new_size) {
  if (sealed_) return absl::FailedPreconditionError("truncating a sealed memfd");
  if (new_size > size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncating a memfd of ", size_, " bytes to ", new_size));
  }
  if (pages_ != PageKind::kSmall) new_size = RoundUpToHugePage(new_size);
  if (new_size == size_) return absl::OkStatus();
  if (::ftruncate(fd_.get(), static_cast<off_t>(new_size)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("ftruncate memfd to ", new_size, " bytes"));
  }
  size_ = new_size;
  return absl::OkStatus();
}

absl::Status PreadFull(int fd, void* buf, size_t size, uint64_t offset) {
  auto* p = static_cast<uint8_t*>(buf);
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "pread");
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(
          "file shrank: expected ", size, " bytes at offset ", offset,
          ", got ", done));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path, uint64_t cap) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  return ReadFdToString(fd.get(), path, cap);
}

absl::StatusOr<std::string> ReadFdToString(int fd, absl::string_view path, uint64_t cap) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > cap) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", st.st_size, " bytes, more than the limit of ", cap));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  absl::Status read = PreadFull(fd, out.data(), out.size(), 0);
  if (!read.ok()) {
    return absl::Status(read.code(), absl::StrCat("reading ", path, ": ", read.message()));
  }
  return out;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> text = ReadFileToString(path, 1 << 20);
  if (!text.ok()) return text.status();
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> w =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    return std::string(w.back());
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": no token"));
}

absl::Status WriteFull(int fd, const void* buf, size_t size) {
  const auto* p = static_cast<const uint8_t*>(buf);
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::write(fd, p + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write");
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace weightd
