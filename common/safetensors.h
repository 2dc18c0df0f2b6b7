// The safetensors file format: an 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype", "shape", "data_offsets": [b, e]}, ...,
// optional "__metadata__": {str: str}}, then the data section. Offsets are
// relative to the data section.
//
// The parser is defensive: it is fed files from users and must reject, with a
// precise INVALID_ARGUMENT naming the tensor, anything that is not exactly a
// well-formed file — it never trusts a size before checking it.
#ifndef WEIGHTD_COMMON_SAFETENSORS_H_
#define WEIGHTD_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace weightd {

// Headers larger than this are rejected (safetensors itself uses 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;
// Dims and element counts beyond these are rejected as absurd.
inline constexpr int kMaxTensorRank = 16;

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;        // N
  uint64_t data_offset = 0;         // 8 + N: file offset of the data section
  std::vector<SafetensorsEntry> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// Parses the header JSON `json` (the N bytes after the length prefix) of a
// file of `file_size` bytes. Checks: valid UTF-8 JSON object; every entry has
// a known dtype, a shape of non-negative ints (rank <= kMaxTensorRank, no
// overflow), data_offsets [b, e] with b <= e and e inside the data section;
// (e - b) == numel * dtype size; tensors contiguous, non-overlapping, the
// first starting at 0 and the last ending at the end of the file; no
// duplicate names; no control characters in names (C0, DEL, C1: they would
// forge lines of listings and drive terminals); "__metadata__" a map of
// strings.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t file_size);

// Reads the 8-byte prefix: the header length, checked against
// kMaxSafetensorsHeaderBytes and file_size.
absl::StatusOr<uint64_t> ParseSafetensorsPrefix(absl::string_view prefix8,
                                                uint64_t file_size);

// What a writer needs to know about one tensor.
struct SafetensorsWriteEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t length = 0;  // bytes; numel * dtype size
};

// Serialises a header for `entries`, laid out in the given order with no gaps;
// returns the whole prefix (8-byte length + JSON, padded with spaces to a
// multiple of 8 as the reference implementation does). The data section
// follows it: entry i at the sum of the previous lengths.
std::string BuildSafetensorsHeader(
    absl::Span<const SafetensorsWriteEntry> entries,
    const std::map<std::string, std::string>& metadata = {});

// The files of an HF sharded checkpoint's index
// (model.safetensors.index.json: {"weight_map": {"tensor": "file"}, ...}):
// distinct file names in first-seen order, plus the tensor -> file map.
// Tensor and file names with control characters are INVALID_ARGUMENT, as is
// nesting deeper than kMaxJsonDepth (common/json_depth.h).
struct SafetensorsIndex {
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
};
absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(absl::string_view json);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_SAFETENSORS_H_
