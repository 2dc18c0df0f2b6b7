#include "server/transport/push_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace weightd {

absl::Status CheckLeaseTensors(const LeaseContents& lease) {
  if (lease.tensors == nullptr) return absl::OkStatus();
  for (size_t i = 0; i < lease.tensors->size(); ++i) {
    const LeaseTensor& t = (*lease.tensors)[i];
    if (t.length > 0 && (t.buffer >= lease.buffers.size() ||
                         t.offset > lease.buffers[t.buffer]->size() ||
                         t.length > lease.buffers[t.buffer]->size() - t.offset)) {
      return absl::InternalError(absl::StrCat("lease tensor ", i, " lies outside its segment"));
    }
  }
  return absl::OkStatus();
}

std::vector<PushCopy> PlanPushCopies(absl::Span<const LeaseTensor> tensors,
                                     const PushLayout& layout, const PushPlanOptions& options) {
  const uint64_t max_bytes = std::max<uint64_t>(options.max_copy_bytes, 1);
  const int streams = std::max(options.streams, 1);
  std::vector<size_t> order;
  for (size_t i = 0; i < tensors.size() && i < layout.offsets.size(); ++i) {
    if (tensors[i].length > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return layout.offsets[a] < layout.offsets[b];
  });
  // Runs back to back in source and destination.
  std::vector<PushCopy> runs;
  for (size_t i : order) {
    const LeaseTensor& t = tensors[i];
    if (!runs.empty()) {
      PushCopy& last = runs.back();
      if (last.buffer == t.buffer && last.src_offset + last.length == t.offset &&
          last.dst_offset + last.length == layout.offsets[i]) {
        last.length += t.length;
        continue;
      }
    }
    runs.push_back(PushCopy{t.buffer, t.offset, layout.offsets[i], t.length, 0});
  }
  std::vector<PushCopy> out;
  std::vector<uint64_t> load(streams, 0);
  for (const PushCopy& run : runs) {
    for (uint64_t done = 0; done < run.length; done += max_bytes) {
      PushCopy piece = run;
      piece.src_offset += done;
      piece.dst_offset += done;
      piece.length = std::min(max_bytes, run.length - done);
      piece.stream = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[piece.stream] += piece.length;
      out.push_back(piece);
    }
  }
  return out;
}

}  // namespace weightd
