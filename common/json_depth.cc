#include "common/json_depth.h"

#include "absl/strings/str_cat.h"

namespace weightd {

absl::Status CheckJsonDepth(absl::string_view text, absl::string_view what,
                            size_t max_depth) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          return absl::InvalidArgumentError(absl::StrCat(
              what, " nests deeper than ", max_depth, " levels (at byte ", i,
              ")"));
        }
        break;
      case ']':
      case '}':
        // Unbalanced closers are the parser's to report.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace weightd
