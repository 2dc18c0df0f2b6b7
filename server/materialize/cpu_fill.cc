#include "server/materialize/cpu_fill.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"
#include "common/status_macros.h"

namespace weightd {
namespace {

constexpr float kFp8E4M3Max = 448.0f;

// The bytes at `offset` of `buffer` (those of tensor `name`), which this
// backend reads with the CPU. An empty host buffer (a checkpoint of empty
// tensors) is mapped nowhere: null, with nothing to read.
absl::StatusOr<const uint8_t*> HostBytes(const Buffer& buffer, uint64_t offset,
                                         absl::string_view name) {
  if (buffer.kind() != MemoryKind::kHost) {
    return absl::UnimplementedError(absl::StrCat(
        "tensor \"", name, "\" is in ", MemoryKindName(buffer.kind()),
        " memory; the CPU fill backend reads host memory only"));
  }
  const uint8_t* base = buffer.host_data();
  return base == nullptr ? nullptr : base + offset;
}

absl::StatusOr<const uint8_t*> HostBytes(const StoredTensor& t) {
  return HostBytes(*t.buffer, t.offset, t.name);
}

// Floats per block when a slice is computed in fp32: small enough to stay
// in cache and to reuse one buffer per thread (fresh pages cost more here
// than the arithmetic), large enough for efficient GEMMs.
constexpr int64_t kBlockFloats = 1 << 18;

// Calls fn(box, values, n) for consecutive row blocks of the slice, with the
// fp32 values of each block (patches applied) in box order.
absl::Status ForEachFloatBlock(
    const PartSlice& s,
    const std::function<absl::Status(const ShardBox&, float*, int64_t)>& fn) {
  const int64_t total = s.box.NumElements();
  if (total == 0) return absl::OkStatus();
  BaseRowReader base = [&s](int64_t row_begin, int64_t row_end, float* out) -> absl::Status {
    if (s.shape.empty() || row_begin < 0 || row_end > s.shape[0] || row_begin > row_end) {
      return absl::InternalError("base row read out of range");
    }
    int64_t cols = 1;
    for (size_t d = 1; d < s.shape.size(); ++d) cols *= s.shape[d];
    if (s.stored == nullptr) {
      std::fill(out, out + (row_end - row_begin) * cols, 0.0f);
      return absl::OkStatus();
    }
    ShardBox rows;
    rows.offset.assign(s.shape.size(), 0);
    rows.offset[0] = row_begin;
    rows.shape = s.shape;
    rows.shape[0] = row_end - row_begin;
    WD_ASSIGN_OR_RETURN(const uint8_t* src, HostBytes(*s.stored));
    return CopyBox(src, s.stored->dtype, s.shape, rows,
                   reinterpret_cast<uint8_t*>(out), DType::kF32);
  };
  const int64_t rows = s.box.shape.empty() ? 1 : s.box.shape[0];
  const int64_t per_row = total / rows;
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(rows, kBlockFloats / std::max<int64_t>(per_row, 1)));
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(block * per_row));
  for (int64_t r = 0; r < rows; r += block) {
    ShardBox sub = s.box;
    if (!sub.shape.empty()) {
      sub.offset[0] += r;
      sub.shape[0] = std::min(block, rows - r);
    }
    const int64_t n = sub.NumElements();
    if (s.stored != nullptr) {
      WD_ASSIGN_OR_RETURN(const uint8_t* src, HostBytes(*s.stored));
      WD_RETURN_IF_ERROR(CopyBox(src, s.stored->dtype, s.shape, sub,
                                 reinterpret_cast<uint8_t*>(acc.data()), DType::kF32));
    } else {
      std::fill(acc.begin(), acc.begin() + n, 0.0f);
    }
    for (const AppliedPatch& p : s.patches) {
      WD_RETURN_IF_ERROR(p.patch->Apply(sub, s.shape, p.strength, base, acc.data()));
    }
    WD_RETURN_IF_ERROR(fn(sub, acc.data(), n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyBox(const uint8_t* src, DType src_dtype,
                     absl::Span<const int64_t> global_shape, const ShardBox& box,
                     uint8_t* dst, DType dst_dtype) {
  const size_t ndim = global_shape.size();
  const int64_t total = box.NumElements();
  if (total == 0) return absl::OkStatus();
  const size_t in_size = DTypeSize(src_dtype);
  const size_t out_size = DTypeSize(dst_dtype);
  if (ndim == 0) return CastBuffer(src_dtype, src, dst_dtype, dst, 1);
  // The innermost dims the box covers whole collapse into one run together
  // with the last partial dim.
  size_t k = ndim;  // first dim of the collapsed run
  int64_t run = 1;
  while (k > 0) {
    --k;
    run *= box.shape[k];
    if (box.shape[k] != global_shape[k]) break;
  }
  std::vector<int64_t> stride(ndim, 1);
  for (size_t d = ndim - 1; d > 0; --d) stride[d - 1] = stride[d] * global_shape[d];
  std::vector<int64_t> idx(k, 0);  // odometer over the box's outer dims
  const int64_t runs = total / run;
  for (int64_t r = 0; r < runs; ++r) {
    int64_t elem = box.offset[k] * stride[k];
    for (size_t d = 0; d < k; ++d) elem += (box.offset[d] + idx[d]) * stride[d];
    WD_RETURN_IF_ERROR(CastBuffer(src_dtype, src + elem * in_size, dst_dtype,
                                  dst + r * run * out_size, static_cast<size_t>(run)));
    for (size_t d = k; d-- > 0;) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status FillItem(const MaterializeItem& item, uint8_t* dst, DigestBuilder* digest) {
  const size_t out_size = DTypeSize(item.out_dtype);
  if (item.scalar.has_value()) {
    WD_RETURN_IF_ERROR(CastBuffer(DType::kF32, &*item.scalar, item.out_dtype, dst, 1));
    if (digest != nullptr) digest->Update(dst, out_size);
    return absl::OkStatus();
  }
  if (item.fp8_scale.has_value() && item.out_dtype != DType::kF8E4M3) {
    return absl::InternalError("fp8 quantization needs F8_E4M3 output");
  }
  uint64_t off = 0;
  for (const PartSlice& s : item.slices) {
    const int64_t n = s.box.NumElements();
    if (n == 0) continue;
    uint8_t* out = dst + off;
    off += static_cast<uint64_t>(n) * out_size;
    if (s.stored != nullptr && s.patches.empty() && !item.fp8_scale.has_value()) {
      if (!CanCast(s.stored->dtype, item.out_dtype)) {
        return absl::InvalidArgumentError(absl::StrCat("cannot convert ",
                                                       DTypeName(s.stored->dtype), " to ",
                                                       DTypeName(item.out_dtype)));
      }
      WD_ASSIGN_OR_RETURN(const uint8_t* src, HostBytes(*s.stored));
      WD_RETURN_IF_ERROR(CopyBox(src, s.stored->dtype, s.shape, s.box, out,
                                 item.out_dtype));
      if (digest != nullptr) digest->Update(out, static_cast<size_t>(n) * out_size);
      continue;
    }
    if (s.stored == nullptr && s.patches.empty() && !item.fp8_scale.has_value()) {
      std::memset(out, 0, static_cast<size_t>(n) * out_size);  // zero in every dtype
      if (digest != nullptr) digest->Update(out, static_cast<size_t>(n) * out_size);
      continue;
    }
    if (!IsFloating(item.out_dtype) || !IsFloating(s.dtype)) {
      return absl::InvalidArgumentError("adapter patches apply only to floating tensors");
    }
    uint8_t* cursor = out;
    WD_RETURN_IF_ERROR(ForEachFloatBlock(s, [&](const ShardBox&, float* v, int64_t count) {
      if (item.fp8_scale.has_value()) {
        const float scale = *item.fp8_scale;
        for (int64_t i = 0; i < count; ++i) {
          float x = v[i] / scale;
          if (x > kFp8E4M3Max) x = kFp8E4M3Max;
          if (x < -kFp8E4M3Max) x = -kFp8E4M3Max;
          v[i] = x;
        }
      }
      WD_RETURN_IF_ERROR(CastBuffer(DType::kF32, v, item.out_dtype, cursor,
                                    static_cast<size_t>(count)));
      if (digest != nullptr) digest->Update(cursor, static_cast<size_t>(count) * out_size);
      cursor += static_cast<size_t>(count) * out_size;
      return absl::OkStatus();
    }));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> AbsMax(absl::Span<const PartSlice> slices) {
  float amax = 0.0f;
  for (const PartSlice& s : slices) {
    WD_RETURN_IF_ERROR(ForEachFloatBlock(s, [&](const ShardBox&, float* v, int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        float a = std::fabs(v[i]);
        if (a > amax) amax = a;  // NaN compares false: ignored
      }
      return absl::OkStatus();
    }));
  }
  return amax;
}

CpuFillBackend::CpuFillBackend(int threads)
    : threads_(std::max(1, threads)), helpers_(threads_ - 1, /*best_effort=*/true) {}

absl::StatusOr<std::vector<Digest>> CpuFillBackend::Run(absl::Span<const FillJob> jobs) {
  std::vector<Digest> digests(jobs.size());
  WD_RETURN_IF_ERROR(ParallelFor(&helpers_, jobs.size(), threads_, [&](size_t j) {
    const FillJob& job = jobs[j];
    if (job.dst == nullptr) {  // a view: its bytes are there already
      WD_ASSIGN_OR_RETURN(const uint8_t* bytes,
                          HostBytes(*job.view_of, job.view_offset, job.item->name));
      digests[j] = DigestBytes(bytes, job.length);
      return absl::OkStatus();
    }
    DigestBuilder digest;
    WD_RETURN_IF_ERROR_CTX(FillItem(*job.item, job.dst, &digest), "tensor \"", job.item->name, "\"");
    digests[j] = digest.Finish();
    return absl::OkStatus();
  }));
  return digests;
}

}  // namespace weightd
