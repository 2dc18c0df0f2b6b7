// The file seam of a load (leveldb's Env for model files): opening files
// for reading, one fd per file, never a second open by name; and reading
// and stat'ing them through that fd. The daemon confines every file a load
// reads to its --model-root dirs (server/store/model_roots.h); tests and
// tools open paths as named, and inject faults through a FileOpenerWrapper
// that overrides the one call they break.
#ifndef WEIGHTD_COMMON_FILE_OPENER_H_
#define WEIGHTD_COMMON_FILE_OPENER_H_

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cancel.h"
#include "common/fd.h"

namespace weightd {

// A regular file or a directory, open for reading (O_RDONLY, blocking,
// close-on-exec). Read it through `fd` only: its name may since name
// something else.
struct OpenedFile {
  UniqueFd fd;
  struct stat st {};  // fstat of fd
  std::string path;   // as named by the caller, for messages
  // Where the opener found it, to open its neighbours (FileOpener only).
  size_t root = 0;
  std::string beneath;
  // A remote object's version (its ETag, quoted as the server sent it);
  // empty for a file. Part of the checkpoint's identity (FilesKey).
  std::string version;
  // The load this file is read for may be cancelled (Cancellation; borrowed,
  // outlives the reads; null: never): the loader checks it between reads,
  // and a remote opener ends a request in flight with its status.
  const Cancellation* cancel = nullptr;

  bool is_directory() const { return S_ISDIR(st.st_mode); }
};

// Every implementation is safe for concurrent calls from many threads
// without external synchronization (a load reads on several); all methods
// are const.
class FileOpener {
 public:
  virtual ~FileOpener() = default;

  // Opens `path`. Anything but a regular file or a directory (a FIFO, a
  // socket, a device) is INVALID_ARGUMENT naming it, at once: it is never
  // opened for reading, so nothing blocks. NOT_FOUND when it does not exist.
  virtual absl::StatusOr<OpenedFile> Open(absl::string_view path) const = 0;
  // Opens `name` (relative; may hold '/') inside directory `dir`.
  virtual absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const = 0;
  // Opens `name` in the directory that holds `file` (as `file` was named).
  virtual absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                                absl::string_view name) const = 0;

  // Reads exactly `length` bytes at `offset` of `file` into `dest`
  // (pread(2) on file.fd, never mmap: a file truncated under the reader
  // must not SIGBUS it). On success all of dest[0, length) is written.
  // DATA_LOSS "file shrank: ..." when the file ends first; the errno's
  // status ("pread: ...") on an I/O error. The message does not name the
  // file: the caller adds its path.
  virtual absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                              void* dest) const;
  // The status of `file` now (fstat(2) of file.fd; file.st is the status
  // when it was opened). An error names file.path.
  virtual absl::StatusOr<struct stat> Stat(const OpenedFile& file) const;
  // The names in directory `dir` that end with `suffix`, sorted (readdir
  // on dir.fd; a remote opener lists its prefix). Errors name dir.path.
  virtual absl::StatusOr<std::vector<std::string>> List(const OpenedFile& dir,
                                                        absl::string_view suffix) const;
};

// Forwards every call to `target` (which must outlive it): a test derives
// from it and overrides only the call it breaks, as with leveldb's
// EnvWrapper. Thread-safe as its target is.
class FileOpenerWrapper : public FileOpener {
 public:
  explicit FileOpenerWrapper(const FileOpener* target) : target_(target) {}

  const FileOpener* target() const { return target_; }

  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override {
    return target_->Open(path);
  }
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override {
    return target_->OpenIn(dir, name);
  }
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override {
    return target_->OpenBeside(file, name);
  }
  absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                      void* dest) const override {
    return target_->ReadAt(file, offset, length, dest);
  }
  absl::StatusOr<struct stat> Stat(const OpenedFile& file) const override {
    return target_->Stat(file);
  }
  absl::StatusOr<std::vector<std::string>> List(const OpenedFile& dir,
                                                absl::string_view suffix) const override {
    return target_->List(dir, suffix);
  }

 private:
  // Constant after construction.
  const FileOpener* const target_;
};

// Opens paths as open(2) does, symlinks followed anywhere. For tests and
// tools that read files their user named; the daemon uses ModelRoots.
class UnconfinedFileOpener final : public FileOpener {
 public:
  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override;
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override;
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override;
};

// "dir/name" ("name" when dir is empty; no doubled '/').
std::string JoinPath(absl::string_view dir, absl::string_view name);
// "a/b" -> "a", "b" -> ".", "/b" -> "/".
std::string Dirname(absl::string_view path);
// "a/b" -> "b", "b" -> "b".
std::string Basename(absl::string_view path);

// The open protocol every FileOpener follows. `open(flags)` opens the
// object (the same name each call) with `flags` and returns the fd or an
// errno. First it is opened O_PATH and fstat'ed: a FIFO, socket or device is
// refused before anything could block on it or trigger a driver. Then it is
// opened O_RDONLY|O_NONBLOCK (O_NONBLOCK cleared after) and must be the same
// inode, else the probe starts over (a few times, then UNAVAILABLE); an
// UNAVAILABLE from `open` (the name changed under it) starts over too.
// `path` names it in messages.
absl::StatusOr<OpenedFile> OpenReadableChecked(
    const std::function<absl::StatusOr<UniqueFd>(int flags)>& open, absl::string_view path);

// Reads all of `file`, a regular file of at most `cap` bytes (an index, a
// config), through `files` (Stat, then ReadAt): INVALID_ARGUMENT for a
// non-regular or larger file; errors name file.path. ReadFdToString
// (common/fd.h) through the seam, with its messages.
absl::StatusOr<std::string> ReadWholeFile(const FileOpener& files, const OpenedFile& file,
                                          uint64_t cap);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FILE_OPENER_H_
