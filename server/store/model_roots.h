// Confinement of user-supplied paths to the daemon's --model-root dirs.
//
// Every file a load reads (checkpoint, index, each shard an index names,
// adapter files and directories) is opened through ModelRoots and read
// through the fd it returns; nothing is checked by name and then opened by
// name again. Paths are resolved beneath an fd held on the root directory:
// with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) where the kernel has
// it, else (and for the cases it refuses, below) by a walk of one
// openat(O_PATH | O_NOFOLLOW) per component. Symlinks are followed while
// they stay inside a root: a relative target is resolved from the link's
// directory, ".." never climbs above the root, an absolute target must name
// a path inside one of the roots (it is then walked beneath that root's fd).
// A directory swapped for a symlink mid-load therefore cannot make the
// daemon read outside the roots: it reads the inside file or fails.
//
// Messages: a path that leaves the roots gets one message whatever lies
// outside ("path \"P\" is outside the model roots [...]"), so a caller learns
// nothing about what exists there.
#ifndef WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_
#define WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/fd.h"
#include "common/file_opener.h"

namespace weightd {

// The FileOpener the daemon loads through. Owns an O_PATH fd on each root.
// Thread-safe: immutable after Create (moves aside), every method const.
class ModelRoots final : public FileOpener {
 public:
  struct Options {
    // false: always the component walk (the fallback for kernels before
    // 5.6), so tests cover it on any kernel.
    bool use_openat2 = true;
  };

  // Each root is resolved (realpath) and opened now; a root that does not
  // exist or is not a directory is INVALID_ARGUMENT.
  static absl::StatusOr<ModelRoots> Create(const std::vector<std::string>& roots);
  static absl::StatusOr<ModelRoots> Create(const std::vector<std::string>& roots, Options options);

  ModelRoots(ModelRoots&&) = default;
  ModelRoots& operator=(ModelRoots&&) = default;

  // FileOpener. Open: `path` is absolute, or relative to the first root.
  // PERMISSION_DENIED when it leaves every root (same message whether or not
  // the target exists), NOT_FOUND when it does not exist inside a root,
  // INVALID_ARGUMENT for an empty path, a NUL byte, a FIFO/socket/device.
  // OpenIn / OpenBeside resolve `name` from the directory as named, still
  // confined to the root (so "../blobs/x", as in a Hugging Face cache, works
  // while it stays inside).
  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override;
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override;
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override;

  // The roots as resolved at start-up.
  std::vector<std::string> roots() const;

 private:
  struct Root {
    std::string real;   // realpath
    std::string given;  // as configured, lexically normalized (absolute only)
    UniqueFd fd;        // O_PATH | O_DIRECTORY
  };
  ModelRoots() = default;

  // Opens `beneath` (relative) beneath root `root`; `path` names it in
  // messages.
  absl::StatusOr<OpenedFile> OpenBeneath(size_t root, const std::string& beneath,
                                         const std::string& path) const;
  // One open of `beneath` with `flags` by the component walk; errno values
  // as open(2) gives them, EXDEV for a way out of the roots.
  UniqueFd Walk(size_t root, const std::string& beneath, int flags, int* err) const;
  // Follows symlink `link`, met by the walk: its target's components go
  // onto `todo`; an absolute target inside a root restarts the walk from
  // that root (`root`, `dirs`). false with *err set for a link that cannot
  // be read, an empty one (ENOENT), or one out of the roots (EXDEV).
  bool FollowLink(const UniqueFd& link, size_t* root, std::vector<UniqueFd>* dirs,
                  std::vector<std::string>* todo, int* err) const;
  // Opens with `flags`: openat2 beneath `dirfd` first (when `dirfd` >= 0 and
  // the kernel has it), else the walk from the root; the status names
  // `path`.
  absl::StatusOr<UniqueFd> OpenOnce(int dirfd, const std::string& rel, size_t root,
                                    const std::string& beneath, int flags,
                                    const std::string& path) const;
  // The root holding absolute `path` (lexically) and the rest beneath it.
  bool Locate(absl::string_view path, size_t* root, std::string* beneath) const;
  absl::Status Outside(absl::string_view path) const;

  // Constant after construction.
  std::vector<Root> roots_;
  Options options_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_
