// Text that comes from users (tensor and model names, file contents) on its
// way into error messages and listings: quoted with a length cap, checked for
// control characters, and whole messages cut to a bound.
//
// Thread-safe (pure functions).
#ifndef WEIGHTD_COMMON_UNTRUSTED_TEXT_H_
#define WEIGHTD_COMMON_UNTRUSTED_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightd {

// Longest piece of one untrusted string a message quotes.
inline constexpr size_t kMaxQuotedBytes = 200;

// `s` in double quotes for a message: '"' and '\' backslash-escaped, C0
// controls and DEL as \xHH, at most `max_bytes` of `s` (cut at a UTF-8
// boundary) followed by "..." when longer. Bytes of `s` that are not valid
// UTF-8 pass through.
std::string QuoteForMessage(absl::string_view s,
                            size_t max_bytes = kMaxQuotedBytes);

// Offset of the first control character in UTF-8 text `s` — C0 (U+0000 to
// U+001F), DEL (U+007F) or C1 (U+0080 to U+009F, encoded C2 80..C2 9F) — or
// npos when there is none. `code` (optional) receives its code point.
size_t FindControlCharacter(absl::string_view s, unsigned* code = nullptr);

// Tensor names end up on lines of `weightctl info`, in logs and in
// terminals: a name with a control character (a newline forges a line, an
// ESC drives the terminal) is INVALID_ARGUMENT
// "<what> "<quoted>" contains control character U+000A at byte 3".
absl::Status CheckNoControlCharacters(absl::string_view name,
                                      absl::string_view what);

// `text` when it fits in `max_bytes`, else its first bytes (cut at a UTF-8
// boundary) and " ... [N more bytes]", all within `max_bytes` (for
// max_bytes >= 64).
std::string TruncateMessage(absl::string_view text, size_t max_bytes);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_UNTRUSTED_TEXT_H_
