#include "server/store/peer_source.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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

std::string PeerVerify::ToString() const {
  if (fraction <= 0) return "samples";
  if (fraction >= 1) return "all";
  return absl::StrCat(fraction * 100, "%");
}

absl::StatusOr<PeerVerify> ParsePeerVerify(absl::string_view s) {
  if (s == "samples" || s.empty()) return PeerVerify{0};
  if (s == "all") return PeerVerify{1};
  double percent = 0;
  if (absl::ConsumeSuffix(&s, "%") && absl::SimpleAtod(s, &percent) && percent > 0 &&
      percent <= 100) {
    return PeerVerify{percent / 100};
  }
  return absl::InvalidArgumentError(
      "--peer-verify: expected samples, all or a percentage of the bytes (0%..100%, e.g. 10%)");
}

uint64_t PeerQuery::AnswerBound() const {
  // Per repeated bytes field: a tag and a varint length (at most 11 bytes),
  // then the field; the copy id likewise; 64 bytes to spare.
  uint64_t bound = 64 + 11 + 16;
  for (uint64_t n : tensors_per_file) bound += 11 + 16 * n;
  bound += (11 + 16) * samples.size();
  // A partial holder's flag and ranges (each: tag, length, three varints).
  bound += 2 + kMaxPartialRanges * (2 + 1 + 5 + 1 + 10 + 1 + 10);
  return bound;
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

absl::Status CheckPeerSamples(const std::vector<CheckpointRange>& samples) {
  if (samples.size() > kMaxPeerSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat(samples.size(), " samples (at most ", kMaxPeerSamples, ")"));
  }
  for (const CheckpointRange& r : samples) {
    if (r.length > kMaxPeerSampleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("a sample of ", r.length, " bytes (at most 1 MiB)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace weightd
