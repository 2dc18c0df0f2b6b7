// Confinement of user-supplied paths to the daemon's --model-root dirs.
#ifndef WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_
#define WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

class ModelRoots {
 public:
  // Each root is resolved (realpath) now; a root that does not exist is
  // INVALID_ARGUMENT.
  static absl::StatusOr<ModelRoots> Create(const std::vector<std::string>& roots);

  // Resolves `path` (symlinks followed, relative paths against the first
  // root) and returns it when it lies inside a root; PERMISSION_DENIED when
  // it resolves outside every root, NOT_FOUND when it does not exist.
  absl::StatusOr<std::string> Resolve(absl::string_view path) const;

  const std::vector<std::string>& roots() const { return roots_; }

 private:
  std::vector<std::string> roots_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_MODEL_ROOTS_H_
