// Reading an adapter's weights file: its safetensors header, then every
// byte in order (for the digest) with the tensors a format uses converted to
// fp32.
#include <sys/stat.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"
#include "common/dtype.h"
#include "common/fd.h"
#include "common/status_macros.h"
#include "server/adapter/adapter_internal.h"

namespace weightd::adapter_internal {

absl::StatusOr<TensorFile> OpenTensorFile(const FileOpener& files, OpenedFile file) {
  TensorFile f;
  f.files = &files;
  f.path = file.path;
  f.file = std::move(file);
  const std::string& path = f.path;
  const struct stat& st = f.file.st;
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  f.size = static_cast<uint64_t>(st.st_size);
  if (f.size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", f.size, " bytes, too short for a safetensors header"));
  }
  char len8[8];
  WD_RETURN_IF_ERROR_CTX(files.ReadAt(f.file, 0, 8, len8), path);
  auto header_len = ParseSafetensorsPrefix(absl::string_view(len8, 8), f.size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  f.prefix.resize(8 + *header_len);
  WD_RETURN_IF_ERROR_CTX(files.ReadAt(f.file, 0, f.prefix.size(), f.prefix.data()), path);
  auto header = ParseSafetensorsHeader(absl::string_view(f.prefix).substr(8), f.size);
  if (!header.ok()) return Annotate(header.status(), path);
  f.header = std::move(*header);
  return f;
}

absl::StatusOr<TensorMap> ReadTensors(const TensorFile& f,
                                      const absl::flat_hash_set<std::string>& wanted,
                                      DigestBuilder* digest, const uint8_t* fetched) {
  digest->Update(f.prefix.data(), f.prefix.size());
  TensorMap out;
  std::vector<uint8_t> buf;
  for (const SafetensorsEntry& e : f.header.tensors) {
    const uint64_t length = e.end - e.begin;
    const bool want = wanted.contains(e.name);
    if (want && !IsFloating(e.dtype)) {
      return KeyError(f.path, e.name,
                      absl::StrCat("dtype ", DTypeName(e.dtype), " is not a floating type"));
    }
    buf.resize(static_cast<size_t>(length));
    if (fetched != nullptr) {
      if (length > 0) std::memcpy(buf.data(), fetched + e.begin, buf.size());
    } else {
      WD_RETURN_IF_ERROR_CTX(
          f.files->ReadAt(f.file, f.header.data_offset + e.begin, buf.size(), buf.data()),
          f.path, ": tensor \"", e.name, "\"");
    }
    digest->Update(buf.data(), buf.size());
    if (!want) continue;
    LoadedTensor t;
    t.shape = e.shape;
    const int64_t n = NumElements(e.shape);
    t.values.resize(static_cast<size_t>(n));
    if (n > 0) {
      WD_RETURN_IF_ERROR_CTX(
          CastBuffer(e.dtype, buf.data(), DType::kF32, t.values.data(), static_cast<size_t>(n)),
          f.path, ": tensor \"", e.name, "\"");
    }
    out.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace weightd::adapter_internal
