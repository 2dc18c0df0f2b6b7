// Status propagation macros. Every fallible function in weightd returns
// absl::Status or absl::StatusOr<T>; these two macros are the only sugar.
#ifndef WEIGHTD_COMMON_STATUS_MACROS_H_
#define WEIGHTD_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define WD_CONCAT_INNER_(a, b) a##b
#define WD_CONCAT_(a, b) WD_CONCAT_INNER_(a, b)

// Returns from the current function when `expr` (an absl::Status) is not OK.
#define WD_RETURN_IF_ERROR(expr)                          \
  do {                                                    \
    ::absl::Status wd_status_ = (expr);                   \
    if (!wd_status_.ok()) return wd_status_;              \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define WD_ASSIGN_OR_RETURN(lhs, rexpr) \
  WD_ASSIGN_OR_RETURN_IMPL_(WD_CONCAT_(wd_statusor_, __LINE__), lhs, rexpr)

#define WD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                              \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace weightd {

// Returns `status` with `context: ` prepended to its message (same code).
inline absl::Status Annotate(const absl::Status& status,
                             absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

}  // namespace weightd

// Like WD_RETURN_IF_ERROR, adding `context` (anything StrCat takes) to the
// message as the error rises.
#define WD_RETURN_IF_ERROR_CTX(expr, ...)                          \
  do {                                                             \
    ::absl::Status wd_status_ = (expr);                            \
    if (!wd_status_.ok())                                          \
      return ::weightd::Annotate(wd_status_,                       \
                                 ::absl::StrCat(__VA_ARGS__));     \
  } while (0)

#endif  // WEIGHTD_COMMON_STATUS_MACROS_H_
