// The daemon's state directory (--state-dir) and the directories in it,
// held open: every file the daemon reads, writes, renames or removes there
// is named relative to the open directory (openat, renameat, unlinkat,
// O_NOFOLLOW, O_CLOEXEC), so that neither a link in it nor a rename of a
// directory above it leads the daemon anywhere else.
//
// What makes that enough is checked when a directory is opened: it is no
// symbolic link, it is owned by the daemon's uid and not writable by group
// or others (no other user can add, swap or remove its entries while the
// daemon uses it), and the daemon can write it. An entry is checked before
// it is used: a file must be a regular file of the daemon's uid with one
// link, a directory as above, a socket a socket. Anything else (a link or
// hard link planted while the directory was open to others, a FIFO, a
// file of another user) is FAILED_PRECONDITION naming it and what to do;
// it is never followed, opened or written.
//
// Immutable after Open; thread-safe.
#ifndef WEIGHTD_SERVER_STATE_STATE_DIR_H_
#define WEIGHTD_SERVER_STATE_STATE_DIR_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/fd.h"
#include "common/file_opener.h"

namespace weightd {

class StateDir {
 public:
  // Creates `path` (mode 0700) when it is missing, and opens it.
  // FAILED_PRECONDITION naming the directory (with its owner and mode
  // where they are the reason) and what to do when it is a symbolic link
  // or not a directory, is owned by another uid than `owner` (the daemon's
  // effective uid), is writable by group or others, or cannot be written
  // (a read-only file system, an immutable directory) or created.
  static absl::StatusOr<std::shared_ptr<const StateDir>> Open(const std::string& path, uid_t owner);

  // The directory `name` in this one (one path component), created 0700
  // when missing and `create` (NOT_FOUND when missing otherwise), checked
  // as Open() checks.
  absl::StatusOr<std::shared_ptr<const StateDir>> Subdir(absl::string_view name, bool create) const;

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }
  uid_t owner() const { return owner_; }
  // path()/name, for messages.
  std::string PathOf(absl::string_view name) const;

  enum class Kind { kFile, kDirectory, kSocket };
  // The entry `name` (lstat): NOT_FOUND when there is none, FAILED_PRECONDITION
  // when it is not of `kind` as the header says (a link, another owner, more
  // than one link, a directory others may write).
  absl::StatusOr<struct stat> Check(absl::string_view name, Kind kind) const;

  // The regular file `name`, open for reading (NOT_FOUND when missing).
  absl::StatusOr<UniqueFd> OpenToRead(absl::string_view name) const;
  // The regular file `name`, open for appending; created 0600 when missing,
  // emptied first when `truncate`.
  absl::StatusOr<UniqueFd> OpenToAppend(absl::string_view name, bool truncate) const;
  // A new regular file `name` (0600, O_EXCL), open for writing; an old
  // regular file of that name is removed first.
  absl::StatusOr<UniqueFd> CreateFile(absl::string_view name) const;
  // renameat within this directory (`to` replaced).
  absl::Status Rename(absl::string_view from, absl::string_view to) const;
  // Removes the entry `name`: a link itself, never what it points to; a
  // directory is not removed (FAILED_PRECONDITION). OK when it is missing.
  absl::Status Remove(absl::string_view name) const;
  // fsync of the directory (a rename or creation in it made durable).
  absl::Status Sync() const;
  // The names of its entries ("." and ".." left out).
  absl::StatusOr<std::vector<std::string>> List() const;

  // A Unix stream socket listening at `name` (mode `mode`, close-on-exec).
  // A socket file nobody listens on is replaced; one a live process accepts
  // on is FAILED_PRECONDITION ("already in use"), and so is any other kind
  // of entry.
  absl::StatusOr<UniqueFd> ListenUnix(absl::string_view name, mode_t mode) const;
  // Connects to the socket at `name`: NOT_FOUND when there is none or
  // nobody listens on it (ECONNREFUSED); FAILED_PRECONDITION for an entry
  // that is no socket (a link included).
  absl::StatusOr<UniqueFd> ConnectUnix(absl::string_view name) const;

 private:
  StateDir(std::string path, UniqueFd fd, uid_t owner)
      : path_(std::move(path)), fd_(std::move(fd)), owner_(owner) {}
  // The opened directory `fd` (named `path`) checked as Open() says.
  static absl::Status CheckOpened(int fd, const std::string& path, uid_t owner);
  // A path naming `name` in this directory through /proc/self/fd (bind and
  // connect take no directory fd), or PathOf(name) where /proc is missing.
  std::string SocketPath(absl::string_view name) const;

  const std::string path_;
  const UniqueFd fd_;
  const uid_t owner_;
};

// Opens the regular files of one StateDir (checked as StateDir::Check says)
// for a load, e.g. a restore of saved published weights; a path naming
// anything outside it is PERMISSION_DENIED.
class StateDirFileOpener final : public FileOpener {
 public:
  explicit StateDirFileOpener(std::shared_ptr<const StateDir> dir) : dir_(std::move(dir)) {}
  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override;
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override;
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override;

 private:
  std::shared_ptr<const StateDir> dir_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STATE_STATE_DIR_H_
