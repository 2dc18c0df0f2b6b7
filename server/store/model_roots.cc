#include "server/store/model_roots.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

// As the kernel's MAXSYMLINKS.
constexpr int kMaxSymlinks = 40;

// Cleared for good the first time the kernel answers ENOSYS.
std::atomic<bool> openat2_available{true};

// "a/b" -> "a", "b" -> "", "/x/y" -> "/x".
std::string Parent(absl::string_view path) {
  size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return "";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

// Appends the components of `path` to `todo` so that the first one is at
// the back.
void PushComponents(absl::string_view path, std::vector<std::string>* todo) {
  std::vector<std::string> parts = absl::StrSplit(path, '/');
  todo->insert(todo->end(), parts.rbegin(), parts.rend());
}

bool IsNoop(const std::string& component) { return component.empty() || component == "."; }

UniqueFd Openat2(int dirfd, const std::string& rel, int flags, int* err) {
  open_how how{};
  how.flags = static_cast<uint64_t>(flags);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = ::syscall(SYS_openat2, dirfd, rel.empty() ? "." : rel.c_str(), &how, sizeof(how));
  if (fd < 0) {
    *err = errno;
    if (errno == ENOSYS) openat2_available.store(false, std::memory_order_relaxed);
    return UniqueFd();
  }
  return UniqueFd(static_cast<int>(fd));
}

}  // namespace

absl::StatusOr<ModelRoots> ModelRoots::Create(const std::vector<std::string>& roots) {
  return Create(roots, Options());
}

absl::StatusOr<ModelRoots> ModelRoots::Create(const std::vector<std::string>& roots,
                                              Options options) {
  ModelRoots out;
  out.options_ = options;
  for (const std::string& root : roots) {
    char buf[PATH_MAX];
    if (::realpath(root.c_str(), buf) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model-root ", root, ": ", ErrnoStatus(errno, "resolving").message()));
    }
    Root r;
    r.real = buf;
    if (!root.empty() && root[0] == '/') {
      r.given = std::filesystem::path(root).lexically_normal().string();
      while (r.given.size() > 1 && r.given.back() == '/') r.given.pop_back();
    }
    r.fd.Reset(::open(r.real.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!r.fd.valid()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model-root ", root, ": ", ErrnoStatus(errno, "opening").message()));
    }
    out.roots_.push_back(std::move(r));
  }
  return out;
}

std::vector<std::string> ModelRoots::roots() const {
  std::vector<std::string> out;
  for (const Root& r : roots_) out.push_back(r.real);
  return out;
}

absl::Status ModelRoots::Outside(absl::string_view path) const {
  return absl::PermissionDeniedError(absl::StrCat(
      "path \"", path, "\" is outside the model roots [", absl::StrJoin(roots(), ", "), "]"));
}

bool ModelRoots::Locate(absl::string_view path, size_t* root, std::string* beneath) const {
  for (size_t i = 0; i < roots_.size(); ++i) {
    for (const std::string& spelling : {roots_[i].real, roots_[i].given}) {
      if (spelling.empty()) continue;
      absl::string_view rest = path;
      if (spelling == "/") {
        if (!absl::ConsumePrefix(&rest, "/")) continue;
      } else if (!absl::ConsumePrefix(&rest, spelling) ||
                 !(rest.empty() || absl::ConsumePrefix(&rest, "/"))) {
        continue;
      }
      *root = i;
      *beneath = std::string(rest);
      return true;
    }
  }
  return false;
}

bool ModelRoots::FollowLink(const UniqueFd& link, size_t* root, std::vector<UniqueFd>* dirs,
                            std::vector<std::string>* todo, int* err) const {
  // The link we opened, not whatever the name holds now.
  std::string target(PATH_MAX, '\0');
  ssize_t n = ::readlinkat(link.get(), "", target.data(), target.size());
  if (n < 0) {
    *err = errno;
    return false;
  }
  target.resize(static_cast<size_t>(n));
  if (target.empty()) {
    *err = ENOENT;
    return false;
  }
  if (target[0] != '/') {
    PushComponents(target, todo);
    return true;
  }
  size_t to_root;
  std::string rest;
  if (!Locate(target, &to_root, &rest)) {
    *err = EXDEV;
    return false;
  }
  *root = to_root;
  dirs->clear();
  PushComponents(rest, todo);
  return true;
}

UniqueFd ModelRoots::Walk(size_t root, const std::string& beneath, int flags, int* err) const {
  std::vector<UniqueFd> dirs;     // opened beneath roots_[root]; back() is where we are
  std::vector<std::string> todo;  // components left; the next one at back()
  PushComponents(beneath, &todo);
  int links = 0;
  auto here = [&] { return dirs.empty() ? roots_[root].fd.get() : dirs.back().get(); };
  while (true) {
    while (!todo.empty() && IsNoop(todo.back())) todo.pop_back();
    if (todo.empty()) {  // a directory we hold (or the root itself)
      UniqueFd fd(::openat(here(), ".", flags));
      if (!fd.valid()) *err = errno;
      return fd;
    }
    std::string name = std::move(todo.back());
    todo.pop_back();
    if (name == "..") {
      // Never openat(".."): the parent is the directory we came through,
      // and above the root there is nothing.
      if (dirs.empty()) {
        *err = EXDEV;
        return UniqueFd();
      }
      dirs.pop_back();
      continue;
    }
    UniqueFd fd(::openat(here(), name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
      *err = errno;
      return UniqueFd();
    }
    if (S_ISLNK(st.st_mode)) {
      if (++links > kMaxSymlinks) {
        *err = ELOOP;
        return UniqueFd();
      }
      if (!FollowLink(fd, &root, &dirs, &todo, err)) return UniqueFd();
      continue;
    }
    bool last = true;
    for (const std::string& c : todo) last = last && IsNoop(c);
    if (!last) {
      if (!S_ISDIR(st.st_mode)) {
        *err = ENOTDIR;
        return UniqueFd();
      }
      dirs.push_back(std::move(fd));
      continue;
    }
    if ((flags & O_PATH) != 0) return fd;
    // The object itself, now for reading; O_NOFOLLOW: if the name became a
    // symlink since, this fails rather than follow it (EAGAIN: the caller
    // starts over).
    UniqueFd opened(::openat(here(), name.c_str(), flags | O_NOFOLLOW));
    if (!opened.valid()) *err = errno == ELOOP ? EAGAIN : errno;
    return opened;
  }
}

absl::StatusOr<UniqueFd> ModelRoots::OpenOnce(int dirfd, const std::string& rel, size_t root,
                                              const std::string& beneath, int flags,
                                              const std::string& path) const {
  int err = 0;
  if (options_.use_openat2 && openat2_available.load(std::memory_order_relaxed)) {
    // The fast path; whatever it refuses (an absolute symlink, a way out of
    // `dirfd` that may stay inside the root, an old kernel) the walk
    // decides.
    UniqueFd fd = Openat2(dirfd >= 0 ? dirfd : roots_[root].fd.get(),
                          dirfd >= 0 ? rel : beneath, flags, &err);
    if (fd.valid()) return fd;
  }
  UniqueFd fd = Walk(root, beneath, flags, &err);
  if (fd.valid()) return fd;
  switch (err) {
    case EXDEV:
      return Outside(path);
    case ENOENT:
      return absl::NotFoundError(absl::StrCat("path \"", path, "\" does not exist"));
    case ELOOP:
      return absl::InvalidArgumentError(
          absl::StrCat("path \"", path, "\": too many levels of symbolic links"));
    case EAGAIN:
      return absl::UnavailableError(
          absl::StrCat("path \"", path, "\" changed while it was being opened; try again"));
    default:
      return ErrnoStatus(err, absl::StrCat("opening \"", path, "\""));
  }
}

absl::StatusOr<OpenedFile> ModelRoots::OpenBeneath(size_t root, const std::string& beneath,
                                                   const std::string& path) const {
  auto opened = OpenReadableChecked(
      [&](int flags) { return OpenOnce(-1, "", root, beneath, flags, path); }, path);
  if (!opened.ok()) return opened.status();
  opened->root = root;
  opened->beneath = beneath;
  return opened;
}

absl::StatusOr<OpenedFile> ModelRoots::Open(absl::string_view path) const {
  if (roots_.empty()) return absl::PermissionDeniedError("the daemon has no --model-root");
  if (path.empty()) return absl::InvalidArgumentError("empty path");
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("path contains a NUL byte");
  }
  size_t root = 0;
  std::string beneath;
  if (path[0] != '/') {
    beneath = std::string(path);
  } else if (!Locate(path, &root, &beneath)) {
    // Not spelled inside a root, it may still lead into one through a
    // symlink outside (/srv/models -> /data/models). What realpath says is
    // then opened beneath the root's fd, so a race can only make that fail.
    // Nothing about what lies outside is said: one message for all.
    char buf[PATH_MAX];
    const std::string p(path);
    if (::realpath(p.c_str(), buf) == nullptr || !Locate(buf, &root, &beneath)) {
      return Outside(path);
    }
  }
  return OpenBeneath(root, beneath, std::string(path));
}

absl::StatusOr<OpenedFile> ModelRoots::OpenIn(const OpenedFile& dir, absl::string_view name) const {
  const std::string rel(name);
  const std::string beneath = JoinPath(dir.beneath, rel);
  const std::string path = JoinPath(dir.path, rel);
  auto opened = OpenReadableChecked(
      [&](int flags) { return OpenOnce(dir.fd.get(), rel, dir.root, beneath, flags, path); },
      path);
  if (!opened.ok()) return opened.status();
  opened->root = dir.root;
  opened->beneath = beneath;
  return opened;
}

absl::StatusOr<OpenedFile> ModelRoots::OpenBeside(const OpenedFile& file,
                                                  absl::string_view name) const {
  return OpenBeneath(file.root, JoinPath(Parent(file.beneath), name),
                     JoinPath(Parent(file.path), name));
}

}  // namespace weightd
