#include "server/push/push_plan.h"

#include <algorithm>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/memory/buffer.h"

namespace weightd {

namespace {

// Every array index MergeElement takes for `elements` elements of whole
// rows from merge.row_begin lies inside its term's array (a term that did
// not would read past it: on the GPU, a sticky error in the context).
bool MergeFits(const PushMerge& merge, uint64_t elements) {
  if (merge.cols < 1 || merge.row_begin < 0 || merge.terms.size() > 1024) return false;
  const uint64_t cols = static_cast<uint64_t>(merge.cols);
  if (elements % cols != 0) return false;
  if (elements == 0) return true;
  const uint64_t row_last = static_cast<uint64_t>(merge.row_begin) + elements / cols - 1;
  for (const MergeTerm& t : merge.terms) {
    if (t.kind == MergeTerm::kLowRank) {
      if (t.rank < 0 || t.x_r < 0 || t.x_k < 0 || t.y_k < 0 || t.y_c < 0) return false;
      if (t.rank == 0) continue;
      const uint64_t k = static_cast<uint64_t>(t.rank) - 1;
      if (t.x == nullptr || t.y == nullptr ||
          row_last * static_cast<uint64_t>(t.x_r) + k * static_cast<uint64_t>(t.x_k) >=
              t.x_len ||
          k * static_cast<uint64_t>(t.y_k) + (cols - 1) * static_cast<uint64_t>(t.y_c) >=
              t.y_len) {
        return false;
      }
    } else if (t.kind == MergeTerm::kAdd || t.kind == MergeTerm::kSet ||
               t.kind == MergeTerm::kCopy) {
      if (t.v == nullptr || t.v_row0 < 0 || merge.row_begin < t.v_row0 ||
          (row_last - static_cast<uint64_t>(t.v_row0) + 1) * cols > t.v_len) {
        return false;
      }
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status CheckLeaseTensors(const LeaseContents& lease) {
  if (lease.tensors == nullptr) return absl::OkStatus();
  for (size_t i = 0; i < lease.tensors->size(); ++i) {
    const LeaseTensor& t = (*lease.tensors)[i];
    if (t.length > 0 && (t.buffer >= lease.buffers.size() ||
                         t.offset > lease.buffers[t.buffer]->size() ||
                         t.length > lease.buffers[t.buffer]->size() - t.offset)) {
      return absl::InternalError(absl::StrCat("lease tensor ", i, " lies outside its segment"));
    }
    if (t.cast && t.merge != nullptr &&
        (!IsFloating(t.src_dtype) || !IsFloating(t.dst_dtype) ||
         !MergeFits(*t.merge, t.length / DTypeSize(t.src_dtype)))) {
      return absl::InternalError(absl::StrCat("lease tensor ", i, " has a merge that cannot be"));
    }
    if (t.cast && (!CanCast(t.src_dtype, t.dst_dtype) || t.length % DTypeSize(t.src_dtype) != 0)) {
      return absl::InternalError(absl::StrCat("lease tensor ", i, " has a cast from ",
                                              DTypeName(t.src_dtype), " to ",
                                              DTypeName(t.dst_dtype), " over ", t.length,
                                              " bytes, which cannot be"));
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
  // Runs back to back in source and destination; a cast is a run alone.
  std::vector<PushCopy> runs;
  for (size_t i : order) {
    const LeaseTensor& t = tensors[i];
    if (!runs.empty() && !t.cast) {
      PushCopy& last = runs.back();
      if (!last.cast && last.buffer == t.buffer && last.src_offset + last.length == t.offset &&
          last.dst_offset + last.length == layout.offsets[i]) {
        last.length += t.length;
        last.dst_length += t.length;
        continue;
      }
    }
    PushCopy run{t.buffer, t.offset, layout.offsets[i], t.length, 0};
    run.dst_length = PushLength(t);
    if (t.cast) {
      run.cast = true;
      run.src_dtype = t.src_dtype;
      run.dst_dtype = t.dst_dtype;
      run.merge = t.merge.get();
    }
    runs.push_back(run);
  }
  std::vector<PushCopy> out;
  std::vector<uint64_t> load(streams, 0);
  auto place = [&](PushCopy piece) {
    piece.stream = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[piece.stream] += std::max(piece.length, piece.dst_length);
    out.push_back(piece);
  };
  for (const PushCopy& run : runs) {
    if (!run.cast) {
      for (uint64_t done = 0; done < run.length; done += max_bytes) {
        PushCopy piece = run;
        piece.src_offset += done;
        piece.dst_offset += done;
        piece.length = std::min(max_bytes, run.length - done);
        piece.dst_length = piece.length;
        place(piece);
      }
      continue;
    }
    const uint64_t src_size = DTypeSize(run.src_dtype);
    const uint64_t dst_size = DTypeSize(run.dst_dtype);
    const uint64_t elements = run.length / src_size;
    const uint64_t per_piece =
        std::max<uint64_t>(options.max_cast_bytes / std::max(src_size, dst_size), 1);
    for (uint64_t done = 0; done < elements; done += per_piece) {
      const uint64_t e = std::min(per_piece, elements - done);
      PushCopy piece = run;
      piece.src_offset += done * src_size;
      piece.dst_offset += done * dst_size;
      piece.length = e * src_size;
      piece.dst_length = e * dst_size;
      piece.first_element = done;
      place(piece);
    }
  }
  return out;
}

absl::StatusOr<PushLayout> LayoutForPush(const LeaseContents& lease,
                                         absl::Span<const uint64_t> offsets) {
  std::vector<uint64_t> lengths;
  if (lease.tensors != nullptr) {
    lengths.reserve(lease.tensors->size());
    for (const LeaseTensor& t : *lease.tensors) lengths.push_back(PushLength(t));
  }
  if (offsets.empty()) return DefaultPushLayout(lengths);
  return CheckPushLayout(lengths, offsets);
}

absl::StatusOr<PushJob> MakePushJob(const LeaseContents& lease, const PushLayout& layout,
                                    const PushPlanOptions& options) {
  const size_t n = lease.tensors == nullptr ? 0 : lease.tensors->size();
  if (layout.offsets.size() != n) return absl::InternalError("push layout does not match the lease");
  WD_RETURN_IF_ERROR(CheckLeaseTensors(lease));
  PushJob job;
  job.size = layout.size;
  job.streams = std::max(options.streams, 1);
  job.max_cast_bytes = options.max_cast_bytes;
  if (n == 0) return job;
  std::unordered_map<const PushMerge*, int32_t> merges;  // each flattened once
  for (const PushCopy& copy : PlanPushCopies(*lease.tensors, layout, options)) {
    const uint8_t* base = lease.buffers[copy.buffer]->host_data();
    if (base == nullptr) {
      return absl::InternalError(absl::StrCat("push source segment ", copy.buffer,
                                              " is not in host memory"));
    }
    PushJobCopy out{.src = base + copy.src_offset,
                    .length = copy.length,
                    .dst_offset = copy.dst_offset,
                    .dst_length = copy.dst_length,
                    .stream = copy.stream,
                    .cast = copy.cast,
                    .src_dtype = copy.src_dtype,
                    .dst_dtype = copy.dst_dtype,
                    .first_element = copy.first_element};
    if (copy.cast) {
      // A scratch of max_cast_bytes holds every cast piece (the plan takes
      // one element a piece even where that is more).
      job.max_cast_bytes = std::max({job.max_cast_bytes, copy.length, copy.dst_length});
    }
    if (copy.merge != nullptr) {
      auto [it, added] = merges.try_emplace(copy.merge, static_cast<int32_t>(job.merges.size()));
      if (added) {
        job.merges.push_back(PushJobMerge{.cols = copy.merge->cols,
                                          .row_begin = copy.merge->row_begin,
                                          .terms = copy.merge->terms.data(),
                                          .num_terms =
                                              static_cast<uint32_t>(copy.merge->terms.size())});
      }
      out.merge = it->second;
    }
    job.copies.push_back(out);
  }
  return job;
}

}  // namespace weightd
