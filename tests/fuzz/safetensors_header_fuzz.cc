// Fuzzes the safetensors prefix and header parsers (common/safetensors.h),
// which see the first bytes of every user-supplied checkpoint and adapter.
//
// Each input is read two ways:
//  * as a whole file: ParseSafetensorsPrefix on bytes [0, 8) with the input
//    size as the file size, then ParseSafetensorsHeader on the N bytes it
//    names — exactly what a loader does;
//  * as "data size + header": bytes [0, 8) are a little-endian data-section
//    size (masked to 48 bits) and the rest is the header JSON, so mutations
//    of the JSON are not undone by a stale length prefix.
// Every accepted header must satisfy the documented invariants and survive a
// BuildSafetensorsHeader round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

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

// The contract of ParseSafetensorsHeader, checked on its output.
void CheckHeader(const SafetensorsHeader& h, uint64_t json_size, uint64_t file_size) {
  FUZZ_CHECK(h.header_bytes == json_size);
  FUZZ_CHECK(h.data_offset == 8 + json_size);
  const uint64_t data_size = file_size - h.data_offset;
  uint64_t cursor = 0;
  for (const SafetensorsEntry& t : h.tensors) {
    FUZZ_CHECK(t.begin == cursor);  // sorted, contiguous, from 0
    FUZZ_CHECK(t.begin <= t.end);
    FUZZ_CHECK(t.shape.size() <= static_cast<size_t>(kMaxTensorRank));
    unsigned __int128 numel = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0);
      numel *= static_cast<uint64_t>(d);
      if (numel == 0) break;
    }
    FUZZ_CHECK(numel * DTypeSize(t.dtype) == t.end - t.begin);
    cursor = t.end;
  }
  FUZZ_CHECK(cursor == data_size);
}

// Parse -> Build -> Parse must give back the same tensors and metadata.
void CheckRoundTrip(const SafetensorsHeader& h, uint64_t data_size) {
  std::vector<SafetensorsWriteEntry> entries;
  entries.reserve(h.tensors.size());
  for (const SafetensorsEntry& t : h.tensors) {
    entries.push_back({t.name, t.dtype, t.shape, t.end - t.begin});
  }
  const std::string prefix = BuildSafetensorsHeader(entries, h.metadata);
  FUZZ_CHECK(prefix.size() >= 8 && prefix.size() % 8 == 0);
  const uint64_t file_size = prefix.size() + data_size;
  absl::StatusOr<uint64_t> n =
      ParseSafetensorsPrefix(absl::string_view(prefix).substr(0, 8), file_size);
  FUZZ_CHECK(n.ok());
  FUZZ_CHECK(*n == prefix.size() - 8);
  absl::StatusOr<SafetensorsHeader> again =
      ParseSafetensorsHeader(absl::string_view(prefix).substr(8), file_size);
  if (!again.ok()) {
    std::fprintf(stderr, "round trip rejected: %s\n",
                 std::string(again.status().message()).c_str());
  }
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->metadata == h.metadata);
  FUZZ_CHECK(again->tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const SafetensorsEntry& a = h.tensors[i];
    const SafetensorsEntry& b = again->tensors[i];
    FUZZ_CHECK(std::tie(a.name, a.dtype, a.shape, a.begin, a.end) ==
               std::tie(b.name, b.dtype, b.shape, b.begin, b.end));
  }
}

void ParseAndCheck(absl::string_view json, uint64_t file_size) {
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(json, file_size);
  if (!h.ok()) {
    FUZZ_CHECK(h.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  CheckHeader(*h, json.size(), file_size);
  CheckRoundTrip(*h, file_size - 8 - json.size());
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const absl::string_view in(reinterpret_cast<const char*>(data), size);

  // 1. As a whole file.
  absl::StatusOr<uint64_t> n = ParseSafetensorsPrefix(in.substr(0, 8), static_cast<uint64_t>(size));
  if (n.ok()) {
    FUZZ_CHECK(*n <= size - 8);
    ParseAndCheck(in.substr(8, *n), size);
  } else {
    FUZZ_CHECK(n.status().code() == absl::StatusCode::kInvalidArgument);
  }

  // 2. As a data-section size and a header.
  if (size < 8) return 0;
  uint64_t data_size = 0;
  for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
  data_size &= (uint64_t{1} << 48) - 1;
  const absl::string_view json = in.substr(8);
  ParseAndCheck(json, 8 + json.size() + data_size);
  return 0;
}
