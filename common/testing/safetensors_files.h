// Test support: safetensors files written for a test (models, adapters,
// files to break). Header-only, like maps.h; the bytes go through
// BuildSafetensorsHeader, the writer the daemon's own publish path uses,
// and every reader in the tests parses them independently.
#ifndef WEIGHTD_COMMON_TESTING_SAFETENSORS_FILES_H_
#define WEIGHTD_COMMON_TESTING_SAFETENSORS_FILES_H_

#include <fcntl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/fd.h"
#include "common/safetensors.h"

namespace weightd {

// One tensor of a test file: its bytes as they lie in the file.
struct TestTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
};

// The bytes of `v` as the file holds F32 elements (this host is
// little-endian, as safetensors is).
inline std::string F32Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// F32 [n] tensors whose element i is name length * 1000 + i + bias: each
// tensor's bytes differ from every other's.
inline std::vector<TestTensor> RampTensors(const std::vector<std::pair<std::string, int>>& tensors,
                                           float bias = 0) {
  std::vector<TestTensor> out;
  for (const auto& [name, n] : tensors) {
    std::vector<float> v(n);
    for (int i = 0; i < n; ++i) v[i] = static_cast<float>(name.size() * 1000 + i) + bias;
    out.push_back({name, DType::kF32, {n}, F32Bytes(v)});
  }
  return out;
}

// The whole file: header, then each tensor's bytes in order.
inline std::string SafetensorsFileBytes(const std::vector<TestTensor>& tensors) {
  std::vector<SafetensorsWriteEntry> entries;
  std::string data;
  for (const TestTensor& t : tensors) {
    entries.push_back({t.name, t.dtype, t.shape, t.bytes.size()});
    data += t.bytes;
  }
  return BuildSafetensorsHeader(entries) + data;
}

// Writes it at `path` (created or truncated, mode 0644).
inline absl::Status WriteSafetensorsFile(const std::string& path,
                                         const std::vector<TestTensor>& tensors) {
  const std::string blob = SafetensorsFileBytes(tensors);
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("open ", path, " for writing"));
  return WriteFull(fd.get(), blob.data(), blob.size());
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_TESTING_SAFETENSORS_FILES_H_
