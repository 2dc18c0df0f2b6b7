#include "server/store/model_roots.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fd.h"

namespace weightd {
namespace {

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("resolving \"", path, "\""));
  }
  return std::string(buf);
}

bool IsInside(absl::string_view path, absl::string_view root) {
  if (root == "/") return true;
  return path == root ||
         (absl::StartsWith(path, root) && path.size() > root.size() &&
          path[root.size()] == '/');
}

}  // namespace

absl::StatusOr<ModelRoots> ModelRoots::Create(const std::vector<std::string>& roots) {
  ModelRoots out;
  for (const std::string& root : roots) {
    auto real = RealPath(root);
    if (!real.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--model-root ", root, ": ", real.status().message()));
    }
    out.roots_.push_back(*real);
  }
  return out;
}

absl::StatusOr<std::string> ModelRoots::Resolve(absl::string_view path) const {
  if (roots_.empty()) {
    return absl::PermissionDeniedError("the daemon has no --model-root");
  }
  if (path.empty()) return absl::InvalidArgumentError("empty path");
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("path contains a NUL byte");
  }
  std::string full = path[0] == '/' ? std::string(path)
                                    : absl::StrCat(roots_.front(), "/", path);
  auto real = RealPath(full);
  if (!real.ok()) {
    // Say nothing of what exists outside the roots.
    std::string lexical = std::filesystem::path(full).lexically_normal().string();
    bool inside = false;
    for (const std::string& root : roots_) inside = inside || IsInside(lexical, root);
    if (!inside) {
      return absl::PermissionDeniedError(
          absl::StrCat("path \"", path, "\" is outside the model roots [",
                       absl::StrJoin(roots_, ", "), "]"));
    }
    if (real.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(absl::StrCat("path \"", path, "\" does not exist"));
    }
    return real.status();
  }
  for (const std::string& root : roots_) {
    if (IsInside(*real, root)) return *real;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "path \"", path, "\" resolves to \"", *real,
      "\", outside the model roots [", absl::StrJoin(roots_, ", "), "]"));
}

}  // namespace weightd
