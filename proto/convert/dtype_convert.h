// weightd.v1.DType <-> DType: the one conversion the daemon and the clients
// share. The pairs are spelled out once; the static_asserts below fail the
// build if either enum gains, loses or renumbers a value without this table.
#ifndef WEIGHTD_PROTO_CONVERT_DTYPE_CONVERT_H_
#define WEIGHTD_PROTO_CONVERT_DTYPE_CONVERT_H_

#include <cstddef>
#include <optional>
#include <utility>

#include "common/dtype.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

inline constexpr std::pair<DType, v1::DType> kProtoDTypes[] = {
    {DType::kF64, v1::F64},         {DType::kF32, v1::F32},
    {DType::kF16, v1::F16},         {DType::kBF16, v1::BF16},
    {DType::kI64, v1::I64},         {DType::kI32, v1::I32},
    {DType::kI16, v1::I16},         {DType::kI8, v1::I8},
    {DType::kU8, v1::U8},           {DType::kBool, v1::BOOL},
    {DType::kF8E4M3, v1::F8_E4M3},  {DType::kF8E5M2, v1::F8_E5M2},
};

namespace dtype_convert_internal {
// Every DType once, every proto value once, none of them DTYPE_UNSPECIFIED.
constexpr bool TableIsABijection() {
  constexpr size_t n = std::size(kProtoDTypes);
  for (size_t i = 0; i < n; ++i) {
    if (kProtoDTypes[i].second == v1::DTYPE_UNSPECIFIED) return false;
    for (size_t j = i + 1; j < n; ++j) {
      if (kProtoDTypes[i].first == kProtoDTypes[j].first ||
          kProtoDTypes[i].second == kProtoDTypes[j].second) {
        return false;
      }
    }
  }
  return true;
}
}  // namespace dtype_convert_internal

static_assert(std::size(kProtoDTypes) == kNumDTypes, "a DType is missing from kProtoDTypes");
static_assert(v1::DType_MAX == kNumDTypes && v1::DType_MIN == v1::DTYPE_UNSPECIFIED,
              "weightd.v1.DType gained or lost a value: update kProtoDTypes");
static_assert(dtype_convert_internal::TableIsABijection(), "kProtoDTypes repeats a value");

constexpr v1::DType ToProtoDType(DType dtype) {
  for (const auto& [d, p] : kProtoDTypes) {
    if (d == dtype) return p;
  }
  return v1::DTYPE_UNSPECIFIED;  // unreachable: the table covers every DType
}

// nullopt for DTYPE_UNSPECIFIED and values this build does not know.
constexpr std::optional<DType> DTypeFromProto(v1::DType dtype) {
  for (const auto& [d, p] : kProtoDTypes) {
    if (p == dtype) return d;
  }
  return std::nullopt;
}

}  // namespace weightd

#endif  // WEIGHTD_PROTO_CONVERT_DTYPE_CONVERT_H_
