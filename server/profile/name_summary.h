// Summarizing long lists of tensor names by pattern, for reports and error
// messages ("layers.{0..31}.mlp.gate_up.weight" instead of 32 lines).
//
// A name's integer components are its maximal runs of ASCII digits that have
// no leading zero ("0", "7", "31"; not "007") and at most 18 digits; every
// other character is literal. Names with the same literal text around their
// integer components form a group, rendered as the literal text with each
// integer position replaced by its value set: a single value as itself, more
// as "{...}" where runs of three or more consecutive values read "a..b"
// (`{0..3,7,9..12}`, `{0,2,5}`).
//
// A group whose value tuples fill the cross product of its per-position value
// sets is one line (`blocks.{0..11}.fc{1,2}.weight`). Otherwise the last
// integer position is split off: prefixes with the same set of last values
// are covered together, recursively (`layers.{0,1,3}.experts.{0..7}.w` plus
// `layers.2.experts.{0..4,6,7}.w`). Every name is covered by exactly one line.
//
// Thread-safe (pure functions).
#ifndef WEIGHTD_SERVER_PROFILE_NAME_SUMMARY_H_
#define WEIGHTD_SERVER_PROFILE_NAME_SUMMARY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace weightd {

// One pattern per line, at most `max_lines` of them followed by
// "... and N more" (N = patterns left out) when there are more. Duplicate
// names count once. Lines are ordered by their first name in natural order
// (digit runs compared as numbers). Empty input -> no lines.
std::vector<std::string> SummarizeNames(absl::Span<const std::string> names,
                                        size_t max_lines = 20);

// SummarizeNames joined with ", " (for one-line error messages).
std::string SummarizeNamesInline(absl::Span<const std::string> names,
                                 size_t max_lines = 20);

// A set of integers in the same notation, always braced unless it has one
// element: {3} -> "3", {0,1,2,3,7} -> "{0..3,7}". Order and duplicates of the
// input do not matter. Empty -> "{}".
std::string FormatIntegerSet(absl::Span<const int64_t> values);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PROFILE_NAME_SUMMARY_H_
