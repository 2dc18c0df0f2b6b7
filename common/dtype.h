// Element types weightd stores and serves, named as safetensors names them.
#ifndef WEIGHTD_COMMON_DTYPE_H_
#define WEIGHTD_COMMON_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace weightd {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,  // e4m3fn (no infinities, one NaN pattern per sign)
  kF8E5M2,
};

inline constexpr int kNumDTypes = 12;

// Bytes per element.
size_t DTypeSize(DType dtype);

// The widest dtypes (F64, I64): a shape that fits at this size fits in every
// dtype a tensor may be cast to or served as.
inline constexpr size_t kMaxDTypeSize = 8;

// OK when every dim is >= 0, the product of the non-zero dims fits in int64
// (strides are built from them even when another dim is 0) and so does
// numel * bytes_per_element. Otherwise INVALID_ARGUMENT "shape [a, b] is too
// large (...)", for the caller to prefix with the tensor's name.
absl::Status CheckShapeFits(absl::Span<const int64_t> shape,
                            size_t bytes_per_element);

// "[a, b, c]", for messages.
std::string ShapeString(absl::Span<const int64_t> shape);

// The product of the dims (1 for a 0-dim shape). REQUIRES: it fits in
// int64 (CheckShapeFits, or shapes that already passed it).
int64_t NumElements(absl::Span<const int64_t> shape);

// The safetensors spelling: "F64", "F32", "F16", "BF16", "I64", ..., "BOOL",
// "F8_E4M3", "F8_E5M2".
absl::string_view DTypeName(DType dtype);

// Parses the safetensors spelling. NOT found -> INVALID_ARGUMENT naming it.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name);

// Parses the CLI/profile spelling, case-insensitive: "f32", "f16", "bf16",
// "f64", "f8_e4m3", "f8_e5m2", and the integer names. "keep" -> nullopt.
absl::StatusOr<std::optional<DType>> ParseRequestDType(absl::string_view name);

// F64, F32, F16, BF16, F8E4M3, F8E5M2.
bool IsFloating(DType dtype);

// True when CastBuffer supports src -> dst (identity always; float -> float
// for every pair except FP8 inputs to FP8 outputs of the other kind, which
// go through F32).
bool CanCast(DType src, DType dst);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_DTYPE_H_
