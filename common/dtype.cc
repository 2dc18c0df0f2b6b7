#include "common/dtype.h"

#include <array>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace weightd {
namespace {

struct DTypeRow {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr std::array<DTypeRow, kNumDTypes> kRows = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
}};

}  // namespace

size_t DTypeSize(DType dtype) { return kRows[static_cast<int>(dtype)].size; }

absl::Status CheckShapeFits(absl::Span<const int64_t> shape,
                            size_t bytes_per_element) {
  constexpr unsigned __int128 kMax = std::numeric_limits<int64_t>::max();
  unsigned __int128 product = 1;
  bool has_zero = false;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape [", absl::StrJoin(shape, ", "), "] has a negative dim"));
    }
    if (d == 0) {
      has_zero = true;
      continue;
    }
    // Both factors are < 2^63 here, so the 128-bit product cannot wrap.
    product *= static_cast<uint64_t>(d);
    if (product > kMax) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ", "),
                       "] is too large (its element count overflows int64)"));
    }
  }
  if (!has_zero && product * bytes_per_element > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape [", absl::StrJoin(shape, ", "), "] is too large (",
        bytes_per_element, " bytes per element overflow int64)"));
  }
  return absl::OkStatus();
}

absl::string_view DTypeName(DType dtype) {
  return kRows[static_cast<int>(dtype)].name;
}

absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  for (const DTypeRow& row : kRows) {
    if (row.name == name) return row.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", absl::CHexEscape(name), "\""));
}

absl::StatusOr<std::optional<DType>> ParseRequestDType(absl::string_view name) {
  std::string upper = absl::AsciiStrToUpper(name);
  if (upper == "KEEP" || upper.empty()) return std::optional<DType>();
  for (const DTypeRow& row : kRows) {
    if (row.name == upper) return std::optional<DType>(row.dtype);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", absl::CHexEscape(name),
      "\" (expected keep|f32|f16|bf16|f64|f8_e4m3|f8_e5m2|i64|i32|i16|i8|u8|bool)"));
}

bool IsFloating(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return true;
    default:
      return false;
  }
}

bool CanCast(DType src, DType dst) {
  if (src == dst) return true;
  return IsFloating(src) && IsFloating(dst);
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace weightd
