#include "common/untrusted_text.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace weightd {
namespace {

bool IsContinuationByte(char c) {
  return (static_cast<unsigned char>(c) & 0xC0) == 0x80;
}

// The largest n <= max that does not split a UTF-8 sequence of `s`.
size_t Utf8Cut(absl::string_view s, size_t max) {
  if (max >= s.size()) return s.size();
  size_t n = max;
  // A sequence is at most 4 bytes: never back off further than that, so
  // text that is not UTF-8 is still cut near `max`.
  for (int k = 0; k < 4 && n > 0 && IsContinuationByte(s[n]); ++k) --n;
  return IsContinuationByte(s[n]) ? max : n;
}

}  // namespace

std::string QuoteForMessage(absl::string_view s, size_t max_bytes) {
  const size_t n = Utf8Cut(s, max_bytes);
  std::string out = "\"";
  out.reserve(n + 8);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20 || c == 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (n < s.size()) out += "...";
  out += "\"";
  return out;
}

size_t FindControlCharacter(absl::string_view s, unsigned* code) {
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    unsigned cp = 0x100;  // none
    if (c < 0x20 || c == 0x7F) {
      cp = c;
    } else if (c == 0xC2 && i + 1 < s.size()) {
      const unsigned char c2 = static_cast<unsigned char>(s[i + 1]);
      if (c2 >= 0x80 && c2 <= 0x9F) cp = c2;
    }
    if (cp != 0x100) {
      if (code != nullptr) *code = cp;
      return i;
    }
  }
  return absl::string_view::npos;
}

absl::Status CheckNoControlCharacters(absl::string_view name,
                                      absl::string_view what) {
  unsigned code = 0;
  const size_t at = FindControlCharacter(name, &code);
  if (at == absl::string_view::npos) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s %s contains control character U+%04X at byte %d (names must be "
      "printable)",
      what, QuoteForMessage(name), code, at));
}

std::string TruncateMessage(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  // The marker is at most 31 bytes (" ... [" + 20 digits + " more bytes]").
  constexpr size_t kMarker = 40;
  const size_t keep = Utf8Cut(text, max_bytes > kMarker ? max_bytes - kMarker : 0);
  return absl::StrCat(text.substr(0, keep), " ... [", text.size() - keep,
                      " more bytes]");
}

}  // namespace weightd
