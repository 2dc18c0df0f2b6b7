#include "common/untrusted_text.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "common/json_depth.h"

namespace weightd {
namespace {

TEST(QuoteForMessageTest, EscapesAndCaps) {
  EXPECT_EQ(QuoteForMessage("a\"b\\c\nd\x7f"), "\"a\\\"b\\\\c\\x0ad\\x7f\"");
  EXPECT_EQ(QuoteForMessage(std::string(300, 'x'), 4), "\"xxxx...\"");
  // Never splits a UTF-8 sequence: "é" is C3 A9.
  EXPECT_EQ(QuoteForMessage("a\xc3\xa9z", 2), "\"a...\"");
  EXPECT_EQ(QuoteForMessage(std::string(1 << 20, 'n')).size(),
            kMaxQuotedBytes + 5);
}

TEST(FindControlCharacterTest, FindsC0DelAndC1ButNotOtherText) {
  unsigned code = 0;
  EXPECT_EQ(FindControlCharacter("layers.0.q_proj.weight"),
            absl::string_view::npos);
  EXPECT_EQ(FindControlCharacter("caf\xc3\xa9 \xe2\x80\xa8 \xf0\x9f\x98\x80"),
            absl::string_view::npos);
  EXPECT_EQ(FindControlCharacter("ab\ncd", &code), 2u);
  EXPECT_EQ(code, 0x0Au);
  EXPECT_EQ(FindControlCharacter("x\x1b[2J", &code), 1u);
  EXPECT_EQ(code, 0x1Bu);
  EXPECT_EQ(FindControlCharacter("x\x7f", &code), 1u);
  EXPECT_EQ(code, 0x7Fu);
  EXPECT_EQ(FindControlCharacter("xy\xc2\x9b", &code), 2u);  // U+009B CSI
  EXPECT_EQ(code, 0x9Bu);
  EXPECT_EQ(FindControlCharacter("\xc2\xa0"), absl::string_view::npos);  // NBSP
  EXPECT_EQ(FindControlCharacter(std::string("a\0b", 3), &code), 1u);
  EXPECT_EQ(code, 0u);
}

TEST(CheckNoControlCharactersTest, NamesTheCharacterAndWhere) {
  EXPECT_TRUE(CheckNoControlCharacters("w.bias", "tensor").ok());
  absl::Status s = CheckNoControlCharacters("w\ttensor: x", "tensor");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "tensor \"w\\x09tensor: x\" contains control character U+0009 at "
            "byte 1 (names must be printable)");
}

TEST(TruncateMessageTest, KeepsShortTextAndBoundsLongText) {
  EXPECT_EQ(TruncateMessage("short", 64), "short");
  const std::string long_text(100000, 'm');
  const std::string cut = TruncateMessage(long_text, 1000);
  EXPECT_LE(cut.size(), 1000u);
  EXPECT_TRUE(absl::StartsWith(cut, "mmmm"));
  EXPECT_TRUE(absl::EndsWith(cut, " more bytes]")) << cut;
  // Multi-byte text is cut between sequences.
  std::string e;
  for (int i = 0; i < 1000; ++i) e += "\xc3\xa9";
  const std::string ce = TruncateMessage(e, 101);
  const size_t body = ce.find(" ... [");
  ASSERT_NE(body, std::string::npos);
  EXPECT_EQ(body % 2, 0u);
}

TEST(JsonDepthTest, CountsArraysAndObjectsOutsideStrings) {
  EXPECT_TRUE(CheckJsonDepth("{\"a\": [[1], {\"b\": []}]}", "doc").ok());
  EXPECT_TRUE(CheckJsonDepth(std::string(64, '[') + std::string(64, ']'), "d").ok());
  absl::Status s =
      CheckJsonDepth(std::string(65, '[') + std::string(65, ']'), "doc");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "doc nests deeper than 64 levels (at byte 64)");
  // Brackets in strings, escaped quotes included, do not count.
  EXPECT_TRUE(CheckJsonDepth("[\"" + std::string(1000, '[') + "\\\"" +
                                 std::string(1000, '{') + "\"]",
                             "d")
                  .ok());
  // Deep and unterminated (what a parser would hold before failing).
  EXPECT_FALSE(CheckJsonDepth("{\"x\": " + std::string(100000, '['), "d").ok());
  // Sequential siblings do not add up.
  std::string wide;
  for (int i = 0; i < 10000; ++i) wide += "[[]],";
  EXPECT_TRUE(CheckJsonDepth("[" + wide + "1]", "d").ok());
}

}  // namespace
}  // namespace weightd
