#include "common/file_opener.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr int kProbeAttempts = 4;

}  // namespace

std::string Dirname(absl::string_view path) {
  size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string Basename(absl::string_view path) {
  size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

absl::StatusOr<OpenedFile> OpenReadableChecked(
    const std::function<absl::StatusOr<UniqueFd>(int flags)>& open, absl::string_view path) {
  for (int attempt = 0; attempt < kProbeAttempts; ++attempt) {
    const bool last = attempt + 1 == kProbeAttempts;
    auto probed = open(O_PATH | O_CLOEXEC);
    if (absl::IsUnavailable(probed.status()) && !last) continue;  // changed: again
    if (!probed.ok()) return probed.status();
    UniqueFd probe = std::move(*probed);
    struct stat st;
    if (::fstat(probe.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
    const bool dir = S_ISDIR(st.st_mode);
    if (!dir && !S_ISREG(st.st_mode)) {
      const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                         : S_ISSOCK(st.st_mode) ? "a socket"
                         : S_ISCHR(st.st_mode)  ? "a character device"
                         : S_ISBLK(st.st_mode)  ? "a block device"
                                                : "a special file";
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is ", kind, ", not a regular file or directory"));
    }
    auto reopened = open(O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | (dir ? O_DIRECTORY : 0));
    if (absl::IsUnavailable(reopened.status()) && !last) continue;
    if (!reopened.ok()) return reopened.status();
    UniqueFd fd = std::move(*reopened);
    OpenedFile f;
    if (::fstat(fd.get(), &f.st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
    if (f.st.st_dev != st.st_dev || f.st.st_ino != st.st_ino) continue;  // swapped: again
    int fl = ::fcntl(fd.get(), F_GETFL);
    if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0) {
      return ErrnoStatus(errno, absl::StrCat("fcntl ", path));
    }
    f.fd = std::move(fd);
    f.path = std::string(path);
    return f;
  }
  return absl::UnavailableError(
      absl::StrCat(path, " kept changing while it was being opened; try again"));
}

absl::Status FileOpener::ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                                void* dest) const {
  return PreadFull(file.fd.get(), dest, length, offset);
}

absl::StatusOr<struct stat> FileOpener::Stat(const OpenedFile& file) const {
  struct stat st;
  if (::fstat(file.fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", file.path));
  return st;
}

absl::StatusOr<std::vector<std::string>> FileOpener::List(const OpenedFile& dir,
                                                          absl::string_view suffix) const {
  int listing = ::openat(dir.fd.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = listing < 0 ? nullptr : ::fdopendir(listing);
  if (d == nullptr) {
    int err = errno;
    if (listing >= 0) ::close(listing);
    return ErrnoStatus(err, absl::StrCat("opening directory ", dir.path));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (absl::EndsWith(name, suffix)) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<std::string> ReadWholeFile(const FileOpener& files, const OpenedFile& file,
                                          uint64_t cap) {
  WD_ASSIGN_OR_RETURN(struct stat st, files.Stat(file));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(file.path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > cap) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path, " is ", st.st_size, " bytes, more than the limit of ", cap));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  WD_RETURN_IF_ERROR_CTX(files.ReadAt(file, 0, out.size(), out.data()), "reading ", file.path);
  return out;
}

absl::StatusOr<OpenedFile> UnconfinedFileOpener::Open(absl::string_view path) const {
  if (path.empty()) return absl::InvalidArgumentError("empty path");
  const std::string p(path);
  if (p.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("path contains a NUL byte");
  }
  auto opened = OpenReadableChecked(
      [&](int flags) -> absl::StatusOr<UniqueFd> {
        UniqueFd fd(::open(p.c_str(), flags));
        if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("opening ", p));
        return fd;
      },
      p);
  if (opened.ok()) opened->beneath = p;
  return opened;
}

absl::StatusOr<OpenedFile> UnconfinedFileOpener::OpenIn(const OpenedFile& dir,
                                                        absl::string_view name) const {
  return Open(JoinPath(dir.path, name));
}

absl::StatusOr<OpenedFile> UnconfinedFileOpener::OpenBeside(const OpenedFile& file,
                                                            absl::string_view name) const {
  return Open(JoinPath(Dirname(file.path), name));
}

}  // namespace weightd
