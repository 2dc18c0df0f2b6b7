// Opening a checkpoint's files: the path a load names (a .safetensors file,
// an index, a directory holding either) opened file by file through the
// file seam (common/file_opener.h), each one's header read and parsed, and
// the tensors checked against each other and against the index. Nothing
// here allocates tensor memory or reads a data section. Free functions and
// values; no state of their own.
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_FILES_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_FILES_H_

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/digest.h"
#include "common/file_opener.h"
#include "common/safetensors.h"

namespace weightd {

inline constexpr char kSafetensorsIndexName[] = "model.safetensors.index.json";

// One safetensors file of a checkpoint, open, its header parsed. Read it
// through the seam (FileOpener::ReadAt on `opened`) only.
struct CheckpointFile {
  OpenedFile opened;  // fd, path as named, fstat when opened
  SafetensorsHeader header;
  Digest header_digest;  // of the 8-byte length and the JSON
  // Placement of the data section in the load's segments (LayOut).
  size_t segment_index = 0;
  uint64_t segment_offset = 0;

  const std::string& path() const { return opened.path; }
  const struct stat& st() const { return opened.st; }
  uint64_t size() const { return static_cast<uint64_t>(opened.st.st_size); }
  // Bytes of the data section (after the header).
  uint64_t data_length() const { return size() - header.data_offset; }
};

// Reads and parses the header of `file` through `files`. INVALID_ARGUMENT
// naming the file for anything but a well-formed safetensors header.
absl::StatusOr<CheckpointFile> OpenSafetensors(const FileOpener& files, OpenedFile file);

// A checkpoint's files, in order (the index's order, or by name in a
// directory), with each one's name (in the index; else its base name).
struct CheckpointFiles {
  std::vector<CheckpointFile> files;
  std::vector<std::string> names;
  uint64_t tensors = 0;  // over all files
};

// Opens `path` and every file it leads to (the index, each shard it names,
// each *.safetensors of a directory), each once, through `opener`, then
// parses each header in order (appending its path to `opened_files` when
// given). INVALID_ARGUMENT for a tensor in two files, or one the index does
// not map to its file, or an index entry no file holds; NOT_FOUND for a
// directory with neither safetensors files nor an index. Errors name the
// file.
absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(const FileOpener& opener,
                                                    const std::string& path,
                                                    std::vector<std::string>* opened_files);

// The identity of the files as opened: each one's path, device, inode,
// size, mtime and ctime, in order (ResidentCheckpoints, DonatedCheckpoints).
std::string FilesKey(const std::vector<CheckpointFile>& files);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_FILES_H_
