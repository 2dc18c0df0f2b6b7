// Fuzzes ParseSafetensorsIndex (common/safetensors.h): the
// model.safetensors.index.json of an HF sharded checkpoint, whose file names
// the store then opens — so an accepted index must never name a path outside
// the checkpoint's directory.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/safetensors.h"

namespace weightd {
namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

bool IsPlainFileName(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
         f.find('\\') == std::string::npos && f.find('\0') == std::string::npos;
}

void CheckIndex(const SafetensorsIndex& index) {
  FUZZ_CHECK(!index.weight_map.empty());
  FUZZ_CHECK(!index.files.empty());
  const std::set<std::string> files(index.files.begin(), index.files.end());
  FUZZ_CHECK(files.size() == index.files.size());  // distinct
  std::set<std::string> used;
  for (const auto& [tensor, file] : index.weight_map) {
    FUZZ_CHECK(IsPlainFileName(file));
    FUZZ_CHECK(files.count(file) == 1);
    used.insert(file);
  }
  FUZZ_CHECK(used == files);  // no file without a tensor
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<SafetensorsIndex> index = ParseSafetensorsIndex(in);
  if (!index.ok()) {
    FUZZ_CHECK(index.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  CheckIndex(*index);
  return 0;
}
