#include "server/store/donated_checkpoints.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"

namespace weightd {
namespace {

// The donated memfds as segments, each the size the layout needs.
absl::StatusOr<std::vector<SegmentPtr>> AdoptSegments(DonatedCheckpoint& d,
                                                      const std::vector<uint64_t>& segment_sizes,
                                                      const AdoptOptions& options) {
  if (d.segment_target_bytes != options.segment_target_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the predecessor laid the files out in segments of up to ", d.segment_target_bytes,
        " bytes, this daemon in ", options.segment_target_bytes,
        " (--checkpoint-segment-bytes differs)"));
  }
  if (d.segment_fds.size() != segment_sizes.size() ||
      d.segment_pages.size() != segment_sizes.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the predecessor handed over ", d.segment_fds.size(), " segments for a layout of ",
        segment_sizes.size()));
  }
  std::vector<SegmentPtr> segments;
  for (size_t i = 0; i < segment_sizes.size(); ++i) {
    WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> seg,
                        options.memory->Adopt(std::move(d.segment_fds[i]), d.segment_pages[i],
                                              "checkpoint"));
    const uint64_t want = d.segment_pages[i] == PageKind::kSmall
                              ? segment_sizes[i]
                              : RoundUpToHugePage(segment_sizes[i]);
    if (seg->size() != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handed-over segment ", i, " holds ", seg->size(), " bytes; the layout needs ", want));
    }
    segments.push_back(SegmentPtr(std::move(seg)));
  }
  return segments;
}

// Each tensor on its segment with the predecessor's digest, where the
// predecessor had it; the indices of those to digest again.
absl::StatusOr<std::vector<size_t>> PlaceTensors(const DonatedCheckpoint& d,
                                                 const LoadLayout& layout,
                                                 const std::vector<SegmentPtr>& segments,
                                                 AdoptVerify verify,
                                                 std::vector<StoredTensor>& tensors) {
  std::vector<size_t> check;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = d.digests.find(tensors[i].name);
    if (it == d.digests.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the predecessor sent no digest for tensor \"", tensors[i].name, "\""));
    }
    auto place = d.places.find(tensors[i].name);
    if (place == d.places.end() ||
        place->second.segment != static_cast<int64_t>(layout.tensor_segment[i]) ||
        place->second.offset != tensors[i].offset || place->second.length != tensors[i].length) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor \"", tensors[i].name, "\" lies elsewhere in the predecessor's segments than "
          "in this daemon's layout"));
    }
    tensors[i].digest = it->second;
    tensors[i].buffer = segments[layout.tensor_segment[i]];
    const bool sampled = i % 16 == 0 || i + 1 == tensors.size();
    if (verify == AdoptVerify::kFull || (verify == AdoptVerify::kSample && sampled)) {
      check.push_back(i);
    }
  }
  return check;
}

// The tensors `check` names digested again: DATA_LOSS naming the first
// found whose bytes miss the predecessor's digest.
absl::Status VerifyDigests(const std::vector<StoredTensor>& tensors,
                           const std::vector<size_t>& check, int threads) {
  std::atomic<size_t> bad{SIZE_MAX};
  WD_RETURN_IF_ERROR(ParallelFor(nullptr, check.size(), threads, [&](size_t k) {
    const StoredTensor& t = tensors[check[k]];
    if (DigestBytes(t.host_data(), t.length) != t.digest) {
      size_t expected = SIZE_MAX;
      bad.compare_exchange_strong(expected, check[k]);
    }
    return absl::OkStatus();
  }));
  if (bad.load() != SIZE_MAX) {
    const StoredTensor& t = tensors[bad.load()];
    return absl::DataLossError(absl::StrCat("handed-over bytes of tensor \"", t.name, "\" (",
                                            t.file, ") do not match the predecessor's digest"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* AdoptVerifyName(AdoptVerify v) {
  switch (v) {
    case AdoptVerify::kFull: return "full";
    case AdoptVerify::kSample: return "sample";
    case AdoptVerify::kNone: return "none";
  }
  return "?";
}

void DonatedCheckpoints::Add(DonatedCheckpoint checkpoint) {
  absl::MutexLock lock(&mu_);
  std::string key = checkpoint.files_key;
  by_files_[std::move(key)] = std::move(checkpoint);
}

std::optional<DonatedCheckpoint> DonatedCheckpoints::Take(const std::string& files_key) {
  absl::MutexLock lock(&mu_);
  auto it = by_files_.find(files_key);
  if (it == by_files_.end()) return std::nullopt;
  DonatedCheckpoint d = std::move(it->second);
  by_files_.erase(it);
  return d;
}

size_t DonatedCheckpoints::DropUnused() {
  absl::MutexLock lock(&mu_);
  size_t n = by_files_.size();
  by_files_.clear();
  return n;
}

absl::StatusOr<AdoptedSegments> AdoptDonated(DonatedCheckpoint d, const LoadLayout& layout,
                                             const AdoptOptions& options) {
  AdoptedSegments out;
  WD_ASSIGN_OR_RETURN(out.segments, AdoptSegments(d, layout.segment_sizes, options));
  out.tensors = layout.tensors;
  WD_ASSIGN_OR_RETURN(std::vector<size_t> check,
                      PlaceTensors(d, layout, out.segments, options.verify, out.tensors));
  WD_RETURN_IF_ERROR(VerifyDigests(out.tensors, check, options.threads));
  return out;
}

}  // namespace weightd
