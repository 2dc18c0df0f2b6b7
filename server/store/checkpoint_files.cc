#include "server/store/checkpoint_files.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr uint64_t kMaxIndexBytes = 64ull << 20;

// The files opened, before their headers are read, with the index (when
// there is one) and the name each file has in it.
struct OpenedFiles {
  std::vector<OpenedFile> files;
  std::vector<std::string> index_names;
  bool has_index = false;
  SafetensorsIndex index;
};

absl::Status ReadIndex(const FileOpener& opener, const OpenedFile& index_file, OpenedFiles* out) {
  WD_ASSIGN_OR_RETURN(std::string json, ReadWholeFile(opener, index_file, kMaxIndexBytes));
  auto parsed = ParseSafetensorsIndex(json);
  if (!parsed.ok()) return Annotate(parsed.status(), index_file.path);
  out->index = std::move(*parsed);
  out->has_index = true;
  for (const std::string& name : out->index.files) {
    WD_ASSIGN_OR_RETURN(OpenedFile f, opener.OpenBeside(index_file, name));
    out->files.push_back(std::move(f));
    out->index_names.push_back(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<OpenedFiles> OpenFiles(const FileOpener& opener, const std::string& path) {
  OpenedFiles out;
  WD_ASSIGN_OR_RETURN(OpenedFile top, opener.Open(path));
  if (!top.is_directory()) {
    if (Basename(path) == kSafetensorsIndexName) {
      // An index file named directly: its shards lie beside it.
      WD_RETURN_IF_ERROR(ReadIndex(opener, top, &out));
      return out;
    }
    out.files.push_back(std::move(top));
    return out;
  }
  // The index is opened like any other file: a symlink out of the roots is
  // refused before a byte of it is read.
  auto index_file = opener.OpenIn(top, kSafetensorsIndexName);
  if (index_file.ok()) {
    WD_RETURN_IF_ERROR(ReadIndex(opener, *index_file, &out));
    return out;
  }
  if (!absl::IsNotFound(index_file.status())) return index_file.status();
  WD_ASSIGN_OR_RETURN(std::vector<std::string> names, opener.List(top, ".safetensors"));
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "directory ", path, " holds no .safetensors files and no ", kSafetensorsIndexName));
  }
  for (const std::string& name : names) {
    WD_ASSIGN_OR_RETURN(OpenedFile f, opener.OpenIn(top, name));
    out.files.push_back(std::move(f));
  }
  return out;
}

// Each tensor in one file only, and (with an index) in the file the index
// maps it to; `owner` collects tensor -> file path.
absl::Status CheckTensorsOf(const CheckpointFile& f, const OpenedFiles& found, size_t i,
                            absl::flat_hash_map<std::string, std::string>& owner) {
  const std::string& p = f.path();
  for (const SafetensorsEntry& e : f.header.tensors) {
    auto [it, inserted] = owner.emplace(e.name, p);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", e.name, "\" appears in both ", it->second, " and ", p));
    }
    if (found.has_index) {
      auto mapped = found.index.weight_map.find(e.name);
      if (mapped == found.index.weight_map.end() || mapped->second != found.index_names[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            p, ": tensor \"", e.name, "\" is not mapped to this file by ", kSafetensorsIndexName));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointFile> OpenSafetensors(const FileOpener& files, OpenedFile file) {
  CheckpointFile f;
  f.opened = std::move(file);
  const std::string& path = f.path();
  if (!S_ISREG(f.st().st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = f.size();
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file is ", size, " bytes, too short for a safetensors header"));
  }
  char prefix[8];
  WD_RETURN_IF_ERROR_CTX(files.ReadAt(f.opened, 0, 8, prefix), path);
  auto header_len = ParseSafetensorsPrefix(absl::string_view(prefix, 8), size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  std::string json(*header_len, '\0');
  WD_RETURN_IF_ERROR_CTX(files.ReadAt(f.opened, 8, json.size(), json.data()), path);
  auto header = ParseSafetensorsHeader(json, size);
  if (!header.ok()) return Annotate(header.status(), path);
  f.header = std::move(*header);
  DigestBuilder digest;
  digest.Update(prefix, 8);
  digest.Update(json.data(), json.size());
  f.header_digest = digest.Finish();
  return f;
}

absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(const FileOpener& opener,
                                                    const std::string& path,
                                                    std::vector<std::string>* opened_files) {
  WD_ASSIGN_OR_RETURN(OpenedFiles found, OpenFiles(opener, path));
  CheckpointFiles out;
  out.files.reserve(found.files.size());
  absl::flat_hash_map<std::string, std::string> owner;  // tensor -> file
  for (size_t i = 0; i < found.files.size(); ++i) {
    WD_ASSIGN_OR_RETURN(CheckpointFile f, OpenSafetensors(opener, std::move(found.files[i])));
    if (opened_files != nullptr) opened_files->push_back(f.path());
    WD_RETURN_IF_ERROR(CheckTensorsOf(f, found, i, owner));
    out.tensors += f.header.tensors.size();
    out.names.push_back(found.has_index ? found.index_names[i] : Basename(f.path()));
    out.files.push_back(std::move(f));
  }
  if (found.has_index) {
    for (const auto& [name, file] : found.index.weight_map) {
      if (!owner.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            kSafetensorsIndexName, " maps tensor \"", name, "\" to ", file,
            ", which does not hold it"));
      }
    }
  }
  return out;
}

std::string FilesKey(const std::vector<CheckpointFile>& files) {
  std::string key;
  for (const CheckpointFile& f : files) {
    const struct stat& st = f.st();
    absl::StrAppend(&key, f.path().size(), ":", f.path(), "|", st.st_dev, "|", st.st_ino, "|",
                    st.st_size, "|", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "|",
                    st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec, "|", f.opened.version, ";");
  }
  return key;
}

}  // namespace weightd
