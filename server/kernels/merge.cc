#include "server/kernels/merge.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"
#include "common/status_macros.h"

namespace weightd {

absl::Status MergeBufferHost(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             size_t count, uint64_t first, int64_t row_begin, int64_t cols,
                             absl::Span<const MergeTerm> terms) {
  if (!IsFloating(src_dtype) || !IsFloating(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("a merge needs floating dtypes, not ",
                                                   DTypeName(src_dtype), " -> ",
                                                   DTypeName(dst_dtype)));
  }
  if (cols < 1) return absl::InvalidArgumentError("a merge needs rows of at least 1 element");
  constexpr size_t kBlock = 4096;
  float acc[kBlock];
  const size_t in = DTypeSize(src_dtype), out = DTypeSize(dst_dtype);
  for (size_t done = 0; done < count; done += kBlock) {
    const size_t n = std::min(kBlock, count - done);
    WD_RETURN_IF_ERROR(
        CastBuffer(src_dtype, static_cast<const uint8_t*>(src) + done * in, DType::kF32, acc, n));
    for (size_t i = 0; i < n; ++i) {
      const int64_t e = static_cast<int64_t>(first + done + i);
      acc[i] = MergeElement(acc[i], terms.data(), static_cast<int>(terms.size()),
                            row_begin + e / cols, e % cols, cols);
    }
    WD_RETURN_IF_ERROR(
        CastBuffer(DType::kF32, acc, dst_dtype, static_cast<uint8_t*>(dst) + done * out, n));
  }
  return absl::OkStatus();
}

}  // namespace weightd
