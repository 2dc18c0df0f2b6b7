// Bounding the nesting of JSON documents from users (adapter configs,
// profiles, HF index files) before any parser or recursive walk sees them:
// a 200 KB file of brackets nests 100,000 levels, enough to overflow a stack
// anywhere a value is walked recursively (dump, copy, compare).
#ifndef WEIGHTD_COMMON_JSON_DEPTH_H_
#define WEIGHTD_COMMON_JSON_DEPTH_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightd {

// No JSON the daemon reads needs more (the deepest, an HF index's
// "metadata", nests a handful of levels).
inline constexpr size_t kMaxJsonDepth = 64;

// INVALID_ARGUMENT "<what> nests deeper than 64 levels (at byte N)" when
// the arrays and objects of `text` nest deeper than `max_depth`. One linear
// scan with O(1) memory that skips string contents (escapes included); it
// does not otherwise validate: for text that is valid JSON up to some point
// it counts exactly what a parser would have held up to that point.
absl::Status CheckJsonDepth(absl::string_view text, absl::string_view what,
                            size_t max_depth = kMaxJsonDepth);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_JSON_DEPTH_H_
