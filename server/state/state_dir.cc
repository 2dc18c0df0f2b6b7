#include "server/state/state_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

std::string Mode(mode_t m) { return absl::StrFormat("%04o", m & 07777); }

// One path component: a name in a directory, leading nowhere else.
absl::Status CheckName(absl::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != absl::string_view::npos ||
      name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", name.substr(0, 80), "\" is not a name in a directory"));
  }
  return absl::OkStatus();
}

const char* KindName(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "a special file";
}

const char* KindName(StateDir::Kind k) {
  switch (k) {
    case StateDir::Kind::kFile:
      return "a regular file";
    case StateDir::Kind::kDirectory:
      return "a directory";
    case StateDir::Kind::kSocket:
      return "a socket";
  }
  return "?";
}

bool IsKind(mode_t m, StateDir::Kind k) {
  switch (k) {
    case StateDir::Kind::kFile:
      return S_ISREG(m);
    case StateDir::Kind::kDirectory:
      return S_ISDIR(m);
    case StateDir::Kind::kSocket:
      return S_ISSOCK(m);
  }
  return false;
}

std::string LinkTarget(int dirfd, const std::string& name) {
  char buf[4096];
  const ssize_t n = ::readlinkat(dirfd, name.c_str(), buf, sizeof(buf));
  return n < 0 ? "?" : std::string(buf, static_cast<size_t>(n));
}

// A file opened in a StateDir must be the entry that was checked, still
// fit: a regular file of the owner, one link.
absl::Status CheckOpenedFile(int fd, const struct stat& checked, const std::string& path,
                             uid_t owner) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode) || st.st_uid != owner || st.st_nlink != 1 ||
      (checked.st_ino != 0 && (st.st_dev != checked.st_dev || st.st_ino != checked.st_ino))) {
    return absl::FailedPreconditionError(absl::StrCat(path, " changed while it was opened (",
                                                      KindName(st.st_mode), " of uid ", st.st_uid,
                                                      ", ", st.st_nlink, " links); remove it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

}  // namespace

absl::Status StateDir::CheckOpened(int fd, const std::string& path, uid_t owner) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a directory"));
  }
  if (st.st_uid != owner) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is owned by uid ", st.st_uid, " (mode ", Mode(st.st_mode), "), not by uid ", owner,
        " that runs the daemon: its state directory must be its own, so that no other "
        "user can plant links or files there; chown ",
        owner, " ", path, " && chmod 0700 ", path,
        ", or give a directory that does not exist yet (the daemon creates it)"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is writable by ", (st.st_mode & S_IWOTH) != 0 ? "others" : "its group",
                     " (mode ", Mode(st.st_mode), ", owner uid ", st.st_uid,
                     "): another user could plant links or files there; chmod 0700 ", path,
                     ", or give a directory that does not exist yet (the daemon creates it)"));
  }
  struct statvfs vfs;
  if (::fstatvfs(fd, &vfs) == 0 && (vfs.f_flag & ST_RDONLY) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        path,
        " is not writable: it is on a read-only file system, and the daemon writes its "
        "journal there; mount it read-write or give another directory"));
  }
  if (::faccessat(fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
    const int err = errno;
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not writable by uid ", owner, " (", std::strerror(err),
                     "), and the daemon writes its journal there; make it writable or give another "
                     "directory"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StateDir>> StateDir::Open(const std::string& given,
                                                               uid_t owner) {
  if (given.empty()) return absl::InvalidArgumentError("empty state directory path");
  // A trailing '/' would make O_NOFOLLOW follow a link.
  std::string path = given;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    const int err = errno;
    return absl::FailedPreconditionError(
        absl::StrCat(path, " cannot be created: ", std::strerror(err), "; create it (owned by uid ",
                     owner, ", mode 0700) or give another directory"));
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    struct stat st;
    // O_DIRECTORY|O_NOFOLLOW on a link: ELOOP or ENOTDIR.
    if ((err == ELOOP || err == ENOTDIR) && ::lstat(path.c_str(), &st) == 0) {
      if (S_ISLNK(st.st_mode)) {
        return absl::FailedPreconditionError(absl::StrCat(
            path, " is a symbolic link (to ", LinkTarget(AT_FDCWD, path),
            "): the daemon follows no links to or in its state directory; give the directory "
            "itself"));
      }
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is ", KindName(st.st_mode), ", not a directory"));
    }
    return ErrnoStatus(err, absl::StrCat("opening ", path));
  }
  WD_RETURN_IF_ERROR(CheckOpened(fd.get(), path, owner));
  return std::shared_ptr<const StateDir>(new StateDir(path, std::move(fd), owner));
}

absl::StatusOr<std::shared_ptr<const StateDir>> StateDir::Subdir(absl::string_view name,
                                                                 bool create) const {
  WD_RETURN_IF_ERROR(CheckName(name));
  const std::string n(name), path = PathOf(name);
  if (create && ::mkdirat(fd_.get(), n.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("creating ", path));
  }
  UniqueFd fd(::openat(fd_.get(), n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ELOOP || err == ENOTDIR) {
      // Says what it is.
      WD_RETURN_IF_ERROR(Check(name, Kind::kDirectory).status());
    }
    return ErrnoStatus(err, absl::StrCat("opening ", path));
  }
  WD_RETURN_IF_ERROR(CheckOpened(fd.get(), path, owner_));
  return std::shared_ptr<const StateDir>(new StateDir(path, std::move(fd), owner_));
}

std::string StateDir::PathOf(absl::string_view name) const {
  return path_ == "/" ? absl::StrCat("/", name) : absl::StrCat(path_, "/", name);
}

absl::StatusOr<struct stat> StateDir::Check(absl::string_view name, Kind kind) const {
  WD_RETURN_IF_ERROR(CheckName(name));
  const std::string n(name), path = PathOf(name);
  struct stat st;
  if (::fstatat(fd_.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoStatus(errno, absl::StrCat("stat ", path));
  }
  if (S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is a symbolic link (to ", LinkTarget(fd_.get(), n),
        "): the daemon follows no links in its state directory (one could make it write "
        "elsewhere); remove it"));
  }
  if (!IsKind(st.st_mode, kind)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is ", KindName(st.st_mode), ", not ", KindName(kind), "; remove it"));
  }
  if (st.st_uid != owner_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is owned by uid ", st.st_uid, ", not by uid ", owner_,
                     " that runs the daemon: it was not made by the daemon; remove it"));
  }
  if (kind == Kind::kFile && st.st_nlink != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " has ", st.st_nlink,
                     " hard links (writing it would change another file); "
                     "remove it"));
  }
  if (kind == Kind::kDirectory && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is writable by group or others (mode ", Mode(st.st_mode),
        "): another user could plant links or files there; remove it or chmod 0700 it"));
  }
  return st;
}

absl::StatusOr<UniqueFd> StateDir::OpenToRead(absl::string_view name) const {
  WD_ASSIGN_OR_RETURN(struct stat checked, Check(name, Kind::kFile));
  const std::string n(name), path = PathOf(name);
  UniqueFd fd(::openat(fd_.get(), n.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  WD_RETURN_IF_ERROR(CheckOpenedFile(fd.get(), checked, path, owner_));
  return fd;
}

absl::StatusOr<UniqueFd> StateDir::OpenToAppend(absl::string_view name, bool truncate) const {
  struct stat checked {};
  auto found = Check(name, Kind::kFile);
  if (found.ok()) {
    checked = *found;
  } else if (!absl::IsNotFound(found.status())) {
    return found.status();
  }
  const std::string n(name), path = PathOf(name);
  UniqueFd fd(::openat(fd_.get(), n.c_str(),
                       O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  WD_RETURN_IF_ERROR(CheckOpenedFile(fd.get(), checked, path, owner_));
  // Emptied only once it is known to be the file it should be.
  if (truncate && ::ftruncate(fd.get(), 0) != 0) {
    return ErrnoStatus(errno, absl::StrCat("truncating ", path));
  }
  return fd;
}

absl::StatusOr<UniqueFd> StateDir::CreateFile(absl::string_view name) const {
  auto found = Check(name, Kind::kFile);
  if (found.ok()) {
    WD_RETURN_IF_ERROR(Remove(name));
  } else if (!absl::IsNotFound(found.status())) {
    return found.status();
  }
  const std::string n(name), path = PathOf(name);
  UniqueFd fd(
      ::openat(fd_.get(), n.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("creating ", path));
  return fd;
}

absl::Status StateDir::Rename(absl::string_view from, absl::string_view to) const {
  WD_RETURN_IF_ERROR(CheckName(from));
  WD_RETURN_IF_ERROR(CheckName(to));
  const std::string f(from), t(to);
  if (::renameat(fd_.get(), f.c_str(), fd_.get(), t.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("renaming ", PathOf(from), " to ", PathOf(to)));
  }
  return absl::OkStatus();
}

absl::Status StateDir::Remove(absl::string_view name) const {
  WD_RETURN_IF_ERROR(CheckName(name));
  const std::string n(name), path = PathOf(name);
  struct stat st;
  if (::fstatat(fd_.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, absl::StrCat("stat ", path));
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is a directory; not removed"));
  }
  if (::unlinkat(fd_.get(), n.c_str(), 0) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("removing ", path));
  }
  return absl::OkStatus();
}

absl::Status StateDir::Sync() const {
  if (::fsync(fd_.get()) != 0) return ErrnoStatus(errno, absl::StrCat("fsync ", path_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> StateDir::List() const {
  // A file description of its own: a dup would share the read position
  // with other listings.
  int fd = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path_));
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("listing ", path_));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

std::string StateDir::SocketPath(absl::string_view name) const {
  static const bool proc = ::access("/proc/self/fd", X_OK) == 0;
  return proc ? absl::StrCat("/proc/self/fd/", fd_.get(), "/", name) : PathOf(name);
}

absl::StatusOr<UniqueFd> StateDir::ListenUnix(absl::string_view name, mode_t mode) const {
  const std::string path = PathOf(name);
  auto found = Check(name, Kind::kSocket);
  if (found.ok()) {
    auto live = ConnectUnix(name);
    if (live.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is already in use: a process accepts connections on it"));
    }
    if (!absl::IsNotFound(live.status())) return live.status();
    WD_RETURN_IF_ERROR(Remove(name));  // left by a daemon that died
  } else if (!absl::IsNotFound(found.status())) {
    return found.status();
  }
  WD_ASSIGN_OR_RETURN(sockaddr_un addr, Address(SocketPath(name)));
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("bind ", path));
  }
  const std::string n(name);
  if (::fchmodat(fd_.get(), n.c_str(), mode, 0) != 0) {
    return ErrnoStatus(errno, absl::StrCat("chmod ", path));
  }
  if (::listen(fd.get(), 256) != 0) return ErrnoStatus(errno, absl::StrCat("listen ", path));
  return fd;
}

absl::StatusOr<UniqueFd> StateDir::ConnectUnix(absl::string_view name) const {
  const std::string path = PathOf(name);
  WD_RETURN_IF_ERROR(Check(name, Kind::kSocket).status());
  WD_ASSIGN_OR_RETURN(sockaddr_un addr, Address(SocketPath(name)));
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ECONNREFUSED) {
      return absl::NotFoundError(absl::StrCat("connect ", path, ": ", std::strerror(err)));
    }
    return absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(err)));
  }
  return fd;
}

absl::StatusOr<OpenedFile> StateDirFileOpener::Open(absl::string_view path) const {
  const std::string name = Basename(path);
  if (Dirname(path) != dir_->path() || !CheckName(name).ok()) {
    return absl::PermissionDeniedError(absl::StrCat(path, " is not a file of ", dir_->path()));
  }
  WD_ASSIGN_OR_RETURN(struct stat checked, dir_->Check(name, StateDir::Kind::kFile));
  WD_ASSIGN_OR_RETURN(OpenedFile f,
                      OpenReadableChecked(
                          [&](int flags) -> absl::StatusOr<UniqueFd> {
                            UniqueFd fd(::openat(dir_->fd(), name.c_str(), flags | O_NOFOLLOW));
                            if (!fd.valid())
                              return ErrnoStatus(errno, absl::StrCat("opening ", path));
                            return fd;
                          },
                          path));
  if (f.is_directory() || f.st.st_dev != checked.st_dev || f.st.st_ino != checked.st_ino) {
    return absl::FailedPreconditionError(absl::StrCat(path, " changed while it was opened"));
  }
  f.beneath = name;
  return f;
}

absl::StatusOr<OpenedFile> StateDirFileOpener::OpenIn(const OpenedFile& dir,
                                                      absl::string_view name) const {
  return absl::PermissionDeniedError(
      absl::StrCat(JoinPath(dir.path, name), ": no directories are read in ", dir_->path()));
}

absl::StatusOr<OpenedFile> StateDirFileOpener::OpenBeside(const OpenedFile& file,
                                                          absl::string_view name) const {
  (void)file;
  return Open(dir_->PathOf(name));
}

}  // namespace weightd
