#include "server/store/peer_source.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightd {

const char* LoadSourceName(LoadSource s) {
  switch (s) {
    case LoadSource::kAuto: return "auto";
    case LoadSource::kStorage: return "storage";
    case LoadSource::kPeers: return "peers";
  }
  return "?";
}

absl::StatusOr<LoadSource> ParseLoadSource(absl::string_view s) {
  if (s == "auto" || s.empty()) return LoadSource::kAuto;
  if (s == "storage") return LoadSource::kStorage;
  if (s == "peers") return LoadSource::kPeers;
  return absl::InvalidArgumentError(
      absl::StrCat("--source: expected auto, storage or peers, got \"", s, "\""));
}

Digest CheckpointKey(const std::vector<CheckpointFileId>& files) {
  DigestBuilder b;
  auto u64 = [&b](uint64_t v) {
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(v >> (8 * i));
    b.Update(le, 8);
  };
  for (const CheckpointFileId& f : files) {
    u64(f.name.size());
    b.Update(f.name.data(), f.name.size());
    u64(f.size);
    b.Update(f.header.bytes.data(), f.header.bytes.size());
  }
  return b.Finish();
}

}  // namespace weightd
