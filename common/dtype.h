// Element types weightd stores and serves, named as safetensors names them.
#ifndef WEIGHTD_COMMON_DTYPE_H_
#define WEIGHTD_COMMON_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

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
