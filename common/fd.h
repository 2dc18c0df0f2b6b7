// RAII for file descriptors, memory mappings and sealed memfd segments.
#ifndef WEIGHTD_COMMON_FD_H_
#define WEIGHTD_COMMON_FD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

// The pages behind a memfd segment. Huge kinds use 2 MiB pages and round
// the segment's size up to a multiple of them.
enum class PageKind : uint8_t {
  kSmall = 0,            // 4 KiB shmem pages
  kTransparentHuge = 1,  // shmem advised MADV_HUGEPAGE: the kernel's THP, when it has them
  kHugetlb = 2,          // memfd_create(MFD_HUGETLB): 2 MiB pages from the hugetlb pool
};
inline constexpr int kPageKinds = 3;
inline constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;
// "4k", "thp", "2m_hugetlb": the label stats and metrics use.
const char* PageKindName(PageKind kind);
inline uint64_t RoundUpToHugePage(uint64_t n) {
  return (n + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
}

// An errno as an absl::Status with the matching code, e.g. ENOENT ->
// NOT_FOUND, EACCES -> PERMISSION_DENIED, ENOMEM -> RESOURCE_EXHAUSTED.
absl::Status ErrnoStatus(int err, absl::string_view what);

// Owns one file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Owns one mmap()ed region; munmaps on destruction. Move-only.
class MappedRegion {
 public:
  MappedRegion() = default;
  MappedRegion(void* addr, size_t size) : addr_(addr), size_(size) {}
  ~MappedRegion() { Reset(); }
  MappedRegion(MappedRegion&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedRegion& operator=(MappedRegion&& o) noexcept {
    if (this != &o) {
      Reset();
      addr_ = std::exchange(o.addr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  enum class Mode { kReadOnly, kReadWrite, kCopyOnWrite };
  // Maps `size` bytes of `fd` from offset 0. size 0 gives an empty region.
  // `populate` fills the page tables now (MAP_POPULATE), far cheaper than
  // one fault per page on first touch. Regions of 2 MiB or more start at a
  // 2 MiB-aligned address, so that huge pages behind them (hugetlb, shmem
  // THP) can be mapped whole (PMD mappings). A hugetlbfs file's mapping is
  // rounded up to its page size; its copy-on-write maps reserve nothing
  // (MAP_NORESERVE: a write to such a page copies it from the pool then).
  static absl::StatusOr<MappedRegion> Map(int fd, size_t size, Mode mode,
                                          bool populate = false);

  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  size_t size() const { return size_; }
  void Reset();

  // Fills the page tables for [offset, offset + length) now
  // (MADV_POPULATE_READ), so reading it later takes no page faults. Kernels
  // before 5.14 lack it: UNIMPLEMENTED, and the pages fault in on first use.
  absl::Status PopulateRead(size_t offset, size_t length) const;

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

// An anonymous shared-memory file (memfd_create with MFD_ALLOW_SEALING),
// writable through its mapping until Seal(); after sealing, nobody can write,
// grow or shrink it (F_SEAL_FUTURE_WRITE|F_SEAL_GROW|F_SEAL_SHRINK|F_SEAL_SEAL:
// write(), hole punching and writable shared mappings fail for every holder
// of the fd) and the daemon's own mapping is read-only (mprotect). Kernels
// before 5.10 get F_SEAL_WRITE instead, with the mapping remade read-only.
// Move-only; not thread-safe until sealed, then read-only and safe to share.
class MemfdSegment {
 public:
  // Creates a segment of `size` bytes named `name` (shown in /proc/pid/fd).
  // `prefault` touches every page now (MAP_POPULATE) so later writes do not
  // fault one page at a time.
  // `pages`: kSmall, or a huge kind (size rounded up to 2 MiB). kHugetlb
  // reserves its pages from the hugetlb pool when mapped: RESOURCE_EXHAUSTED
  // when the pool is short (never a SIGBUS later); kTransparentHuge is
  // mapped 2 MiB-aligned and advised MADV_HUGEPAGE (the kernel's shmem THP
  // setting decides).
  static absl::StatusOr<MemfdSegment> Create(absl::string_view name,
                                             size_t size, bool prefault,
                                             PageKind pages = PageKind::kSmall);

  // A sealed memfd another process made (a predecessor daemon's segment,
  // received over SCM_RIGHTS at a hand-over), mapped read-only and
  // populated. FAILED_PRECONDITION when it is not a memfd sealed against
  // writes, growing and shrinking (its bytes could still change), or when
  // its pages are not of kind `pages` (hugetlb or not, by its file system).
  static absl::StatusOr<MemfdSegment> Adopt(UniqueFd fd, PageKind pages);

  MemfdSegment() = default;
  MemfdSegment(MemfdSegment&&) = default;
  MemfdSegment& operator=(MemfdSegment&&) = default;

  // Drops write access: applies the seals and makes the mapping read-only.
  // `populate` fills the mapping's page tables now: the owner will read all
  // of it (a checkpoint), and one call is far cheaper than a fault per page.
  // `keep_writable`: the seals are the same (F_SEAL_FUTURE_WRITE: no new
  // writable mapping, no write(2), no hole punching, for every holder of
  // the fd, this process included) but this mapping, which exists already,
  // stays writable: for registering it with CUDA where read-only
  // registration is unsupported (server/gpu/host_pinner.h); nobody writes
  // through it. Only from Linux 5.10 on (see Seal's comment in fd.cc);
  // earlier kernels seal as without it and writable_mapping() is null.
  absl::Status Seal(bool populate = true, bool keep_writable = false);
  // Seal(), proving first that no one else can still write: drops this
  // mapping, adds F_SEAL_WRITE (which the kernel refuses while a shared
  // mapping of the memfd that may write exists in any process, or its
  // pages are pinned), then maps the sealed file read-only. For memory
  // handed out writable (a publisher's staging memfd): F_SEAL_FUTURE_WRITE
  // alone would leave another process's existing writable mapping in place.
  // FAILED_PRECONDITION when such a mapping is still there; the segment is
  // then as it was (unsealed, mapped writable, possibly at another address).
  absl::Status SealExclusive(bool populate = true);

  // Shrinks an unsealed segment to `new_size` bytes (<= size(); huge kinds
  // round it up to 2 MiB), returning the pages past it to the kernel. The mapping keeps its length; bytes
  // past new_size must not be touched again.
  absl::Status Truncate(size_t new_size);

  bool sealed() const { return sealed_; }
  // Whether Seal() kept the mapping (Linux 5.10+): the pages written through
  // it before sealing are still mapped, and reading them takes no faults.
  bool kept_mapping() const { return kept_mapping_; }
  int fd() const { return fd_.get(); }
  // Bytes of the memfd: what was asked for, rounded up to 2 MiB for huge kinds.
  size_t size() const { return size_; }
  PageKind pages() const { return pages_; }
  // Writable only before Seal().
  uint8_t* mutable_data() const { return sealed_ ? nullptr : map_.data(); }
  // The mapping where Seal(keep_writable) kept it writable, else nullptr.
  // Only for registering it with CUDA: the memfd is sealed, its bytes
  // must not change.
  uint8_t* writable_mapping() const {
    return sealed_ && writable_after_seal_ ? map_.data() : nullptr;
  }
  const uint8_t* data() const { return map_.data(); }

 private:
  UniqueFd fd_;
  MappedRegion map_;
  size_t size_ = 0;
  PageKind pages_ = PageKind::kSmall;
  bool sealed_ = false;
  bool kept_mapping_ = false;
  bool writable_after_seal_ = false;
};

// pread()s exactly `size` bytes at `offset`, retrying short reads and EINTR.
// A file shorter than offset+size is DATA_LOSS ("file shrank").
absl::Status PreadFull(int fd, void* buf, size_t size, uint64_t offset);
// Reads a whole regular file of at most `cap` bytes (configs, indexes,
// profiles): INVALID_ARGUMENT for a non-regular or larger file. A FIFO,
// socket or device is refused at once (opened O_NONBLOCK, checked before
// any read), never waited on.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, uint64_t cap);
// The bearer token of a token file: its first non-blank, non-comment
// line's last word (a "NAME TOKEN" line of a daemon's --auth-token-file
// works too). INVALID_ARGUMENT "<flag> <path>: no token" when it has none.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view flag);
// As ReadFileToString, from an open fd (read with pread from offset 0);
// `path` names it in messages.
absl::StatusOr<std::string> ReadFdToString(int fd, absl::string_view path, uint64_t cap);

// write()s all of `size` bytes.
absl::Status WriteFull(int fd, const void* buf, size_t size);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FD_H_
