#include "common/safetensors.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

#define EXPECT_INVALID(expr, substr)                                      \
  do {                                                                    \
    auto wd_result_ = (expr);                                             \
    ASSERT_FALSE(wd_result_.ok()) << #expr;                               \
    absl::Status wd_s_ = wd_result_.status();                             \
    EXPECT_EQ(wd_s_.code(), absl::StatusCode::kInvalidArgument) << wd_s_; \
    EXPECT_TRUE(absl::StrContains(wd_s_.message(), substr))               \
        << "message: " << wd_s_.message() << "\nwanted: " << substr;      \
  } while (0)

// A whole file: header from BuildSafetensorsHeader plus `data` bytes of
// data (by default exactly what the entries need).
std::string MakeFile(const std::vector<SafetensorsWriteEntry>& entries,
                     const std::map<std::string, std::string>& metadata = {}) {
  std::string file = BuildSafetensorsHeader(entries, metadata);
  uint64_t total = 0;
  for (const auto& e : entries) total += e.length;
  for (uint64_t i = 0; i < total; ++i) file.push_back(static_cast<char>(i));
  return file;
}

// Parses a whole file the way a loader does: prefix, then header.
absl::StatusOr<SafetensorsHeader> ParseFile(absl::string_view file) {
  absl::StatusOr<uint64_t> n =
      ParseSafetensorsPrefix(file.substr(0, 8), file.size());
  if (!n.ok()) return n.status();
  return ParseSafetensorsHeader(file.substr(8, *n), file.size());
}

// Parses a hand-written header followed by `data_size` bytes of data.
absl::StatusOr<SafetensorsHeader> ParseJson(absl::string_view json,
                                            uint64_t data_size) {
  return ParseSafetensorsHeader(json, 8 + json.size() + data_size);
}

std::string Prefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out;
}

// One well-formed entry as JSON text.
std::string Entry(absl::string_view name, absl::string_view dtype,
                  absl::string_view shape, uint64_t b, uint64_t e) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype,
                      "\",\"shape\":", shape, ",\"data_offsets\":[", b, ",", e,
                      "]}");
}

// ---------------------------------------------------------------------------
// Well-formed files

TEST(SafetensorsTest, BuildThenParseRoundTrips) {
  std::vector<SafetensorsWriteEntry> entries = {
      {"model.embed.weight", DType::kF32, {4, 3}, 48},
      {"model.norm.weight", DType::kBF16, {3}, 6},
      {"lm_head.bias", DType::kI64, {2}, 16},
      {"scale", DType::kF64, {}, 8},
      {"mask", DType::kBool, {1, 5}, 5},
  };
  std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                 {"note", "hi \"there\""}};
  std::string file = MakeFile(entries, metadata);
  absl::StatusOr<SafetensorsHeader> h = ParseFile(file);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_offset, 8 + h->header_bytes);
  EXPECT_EQ(h->data_offset % 8, 0u);
  EXPECT_EQ(h->data_offset + 48 + 6 + 16 + 8 + 5, file.size());
  EXPECT_EQ(h->metadata, metadata);
  ASSERT_EQ(h->tensors.size(), entries.size());
  // Entries laid out in the given order, so sorted-by-begin is that order
  // (even though the JSON object's keys come out sorted by name).
  uint64_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& t = h->tensors[i];
    EXPECT_EQ(t.name, entries[i].name);
    EXPECT_EQ(t.dtype, entries[i].dtype);
    EXPECT_EQ(t.shape, entries[i].shape);
    EXPECT_EQ(t.begin, offset);
    EXPECT_EQ(t.end, offset + entries[i].length);
    offset += entries[i].length;
  }
}

TEST(SafetensorsTest, HeaderIsPaddedWithSpacesToMultipleOfEight) {
  for (int len = 1; len < 20; ++len) {
    std::string name(len, 'n');
    std::string header =
        BuildSafetensorsHeader({{name, DType::kU8, {len}, uint64_t(len)}});
    ASSERT_EQ(header.size() % 8, 0u);
    uint64_t n = header.size() - 8;
    EXPECT_EQ(header.substr(0, 8), Prefix(n));
    EXPECT_EQ(header[8], '{');
    size_t close = header.rfind('}');
    ASSERT_NE(close, std::string::npos);
    EXPECT_LT(header.size() - 1 - close, 8u);
    for (size_t i = close + 1; i < header.size(); ++i)
      EXPECT_EQ(header[i], ' ');
  }
}

TEST(SafetensorsTest, EmptyFileHasNoTensors) {
  std::string file = MakeFile({});
  EXPECT_EQ(file.size(), 16u);  // "{}" padded to 8
  absl::StatusOr<SafetensorsHeader> h = ParseFile(file);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->tensors.empty());
  EXPECT_TRUE(h->metadata.empty());
}

TEST(SafetensorsTest, ZeroSizeTensorsAnywhere) {
  std::vector<SafetensorsWriteEntry> entries = {
      {"empty_first", DType::kF32, {0, 4}, 0}, {"a", DType::kF16, {2}, 4},
      {"empty_mid", DType::kF16, {3, 0}, 0},   {"b", DType::kU8, {3}, 3},
      {"empty_last", DType::kI32, {0}, 0},
  };
  absl::StatusOr<SafetensorsHeader> h = ParseFile(MakeFile(entries));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 5u);
  EXPECT_EQ(h->tensors[0].name, "empty_first");
  EXPECT_EQ(h->tensors[1].name, "a");
  EXPECT_EQ(h->tensors[2].name, "empty_mid");
  EXPECT_EQ(h->tensors[3].name, "b");
  EXPECT_EQ(h->tensors[4].name, "empty_last");
  EXPECT_EQ(h->tensors[4].begin, 7u);
  EXPECT_EQ(h->tensors[4].end, 7u);
}

TEST(SafetensorsTest, TensorsSortedByOffsetNotByName) {
  std::string json = absl::StrCat("{", Entry("a", "F32", "[1]", 8, 12), ",",
                                  Entry("b", "F32", "[2]", 0, 8), ",",
                                  Entry("c", "U8", "[4]", 12, 16), "}");
  absl::StatusOr<SafetensorsHeader> h = ParseJson(json, 16);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->tensors[0].name, "b");
  EXPECT_EQ(h->tensors[1].name, "a");
  EXPECT_EQ(h->tensors[2].name, "c");
  EXPECT_EQ(h->header_bytes, json.size());
}

TEST(SafetensorsTest, AcceptsWhitespaceUnicodeNamesAndFieldOrder) {
  std::string json =
      "{ \"caf\\u00e9\" : { \"shape\" : [ 2 ] , \"data_offsets\" : [0, 2],"
      " \"dtype\" : \"F8_E4M3\" },\n \"\xe6\x97\xa5\xf0\x9f\x98\x80\":"
      "{\"dtype\":\"F8_E5M2\",\"shape\":[],\"data_offsets\":[2,3]},"
      "\"__metadata__\":{}}   ";
  absl::StatusOr<SafetensorsHeader> h = ParseJson(json, 3);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "caf\xc3\xa9");
  EXPECT_EQ(h->tensors[0].dtype, DType::kF8E4M3);
  EXPECT_EQ(h->tensors[1].name, "\xe6\x97\xa5\xf0\x9f\x98\x80");
  EXPECT_TRUE(h->tensors[1].shape.empty());
}

TEST(SafetensorsTest, PrefixAcceptsExactFit) {
  absl::StatusOr<uint64_t> n = ParseSafetensorsPrefix(Prefix(8), 16);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 8u);
  n = ParseSafetensorsPrefix(Prefix(kMaxSafetensorsHeaderBytes),
                             kMaxSafetensorsHeaderBytes + 8);
  ASSERT_TRUE(n.ok()) << n.status();
}

// ---------------------------------------------------------------------------
// Malformed files: every one is INVALID_ARGUMENT with a message that says why.

TEST(SafetensorsMalformedTest, PrefixLargerThanLimit) {
  EXPECT_INVALID(ParseSafetensorsPrefix(Prefix(kMaxSafetensorsHeaderBytes + 1),
                                        1ull << 40),
                 "exceeds the limit of 104857600 bytes");
  EXPECT_INVALID(ParseSafetensorsPrefix(Prefix(UINT64_MAX), 1ull << 40),
                 "exceeds the limit");
}

TEST(SafetensorsMalformedTest, PrefixPastEndOfFile) {
  EXPECT_INVALID(ParseSafetensorsPrefix(Prefix(9), 16),
                 "header length 9 runs past the end of the file (16 bytes)");
  EXPECT_INVALID(ParseSafetensorsPrefix(Prefix(1), 8), "runs past the end");
}

TEST(SafetensorsMalformedTest, FileTooSmallOrShortPrefix) {
  EXPECT_INVALID(ParseSafetensorsPrefix(Prefix(0), 7), "too small");
  EXPECT_INVALID(ParseSafetensorsPrefix("1234567", 100), "must be 8 bytes");
}

TEST(SafetensorsMalformedTest, HeaderDoesNotFitFile) {
  EXPECT_INVALID(ParseSafetensorsHeader("{}", 9), "does not fit in a file");
  EXPECT_INVALID(ParseSafetensorsHeader("{}", 3), "does not fit in a file");
}

TEST(SafetensorsMalformedTest, NotJson) {
  EXPECT_INVALID(ParseJson("{", 0), "header is not valid JSON");
  EXPECT_INVALID(ParseJson("{\"a\":}", 0), "header is not valid JSON");
  EXPECT_INVALID(ParseJson("{}x", 0), "header is not valid JSON");
  EXPECT_INVALID(ParseJson("{}{}", 0), "header is not valid JSON");
  // nlohmann would stop at a raw NUL and ignore what follows.
  EXPECT_INVALID(ParseJson(std::string("{}\0", 3), 0),
                 "header contains a NUL byte at offset 2");
  EXPECT_INVALID(ParseJson(std::string("{}\0{\"a\":1}", 10), 0), "NUL byte");
  EXPECT_INVALID(ParseJson("", 0), "must start with '{'");
}

TEST(SafetensorsMalformedTest, NotAnObject) {
  EXPECT_INVALID(ParseJson("[]", 0), "header is not a JSON object");
  EXPECT_INVALID(ParseJson("\"x\"", 0), "header is not a JSON object");
  EXPECT_INVALID(ParseJson(" {}", 0), "must start with '{'");
}

TEST(SafetensorsMalformedTest, JsonErrorInsideEntryNamesTensor) {
  EXPECT_INVALID(ParseJson("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,]", 0),
                 "tensor \"w\": header is not valid JSON");
}

TEST(SafetensorsMalformedTest, InvalidUtf8Name) {
  std::string json = "{" + Entry("a\xff", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1),
                 "header is not valid UTF-8 (bad byte at offset 3)");
  // Overlong encoding of '/'.
  json = "{" + Entry("a\xc0\xaf", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1), "not valid UTF-8");
  // UTF-8-encoded surrogate U+D800.
  json = "{" + Entry("a\xed\xa0\x80", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1), "not valid UTF-8");
  // Beyond U+10FFFF.
  json = "{" + Entry("a\xf4\x90\x80\x80", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1), "not valid UTF-8");
  // Truncated sequence.
  json = "{" + Entry("a\xe6\x97", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1), "not valid UTF-8");
}

TEST(SafetensorsMalformedTest, LoneSurrogateEscape) {
  std::string json = "{" + Entry("a\\ud800", "U8", "[1]", 0, 1) + "}";
  EXPECT_INVALID(ParseJson(json, 1), "header is not valid JSON");
}

TEST(SafetensorsMalformedTest, DuplicateTensorName) {
  std::string json =
      absl::StrCat("{", Entry("a.weight", "U8", "[1]", 0, 1), ",",
                   Entry("a.weight", "U8", "[1]", 1, 2), "}");
  EXPECT_INVALID(ParseJson(json, 2), "duplicate tensor \"a.weight\"");
}

TEST(SafetensorsMalformedTest, DuplicateField) {
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],"
                "\"data_offsets\":[0,1]}}",
                1),
      "tensor \"a\": duplicate field \"dtype\"");
}

TEST(SafetensorsMalformedTest, EntryNotAnObject) {
  EXPECT_INVALID(ParseJson("{\"a\":[1,2]}", 0),
                 "tensor \"a\": entry is not an object (found an array)");
  EXPECT_INVALID(ParseJson("{\"a\":null}", 0),
                 "tensor \"a\": entry is not an object (found null)");
}

TEST(SafetensorsMalformedTest, MissingField) {
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1),
      "tensor \"a\": missing field \"shape\"");
  EXPECT_INVALID(ParseJson("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1),
                 "tensor \"a\": missing field \"data_offsets\"");
  EXPECT_INVALID(ParseJson("{\"a\":{}}", 0),
                 "tensor \"a\": missing field \"dtype\"");
}

TEST(SafetensorsMalformedTest, ExtraField) {
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],"
                "\"offset\":3}}",
                1),
      "tensor \"a\": unexpected field \"offset\"");
}

TEST(SafetensorsMalformedTest, UnknownDtype) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F33", "[1]", 0, 4) + "}", 4),
                 "tensor \"a\": unknown dtype \"F33\"");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "f32", "[1]", 0, 4) + "}", 4),
                 "unknown dtype");
}

TEST(SafetensorsMalformedTest, DtypeNotAString) {
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}",
                4),
      "tensor \"a\": dtype is not a string (found the number 4)");
}

TEST(SafetensorsMalformedTest, ShapeFloat) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[2.0]", 0, 8) + "}", 8),
                 "tensor \"a\": shape dim 2.0 is not a non-negative 64-bit "
                 "integer");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[2e0]", 0, 8) + "}", 8),
                 "shape dim 2e0");
}

TEST(SafetensorsMalformedTest, ShapeNegative) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[2,-1]", 0, 8) + "}", 8),
                 "tensor \"a\": shape dim -1 is negative");
}

TEST(SafetensorsMalformedTest, ShapeNotAnArrayOfInts) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "2", 0, 8) + "}", 8),
                 "tensor \"a\": shape is not an array of non-negative integers "
                 "(found the number 2)");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[\"2\"]", 0, 8) + "}", 8),
                 "shape is not an array of non-negative integers (found a "
                 "string)");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[[2]]", 0, 8) + "}", 8),
                 "(found an array)");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[true]", 0, 8) + "}", 8),
                 "(found true)");
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "{}", 0, 8) + "}", 8),
                 "(found an object)");
}

TEST(SafetensorsMalformedTest, ShapeDimTooLarge) {
  EXPECT_INVALID(
      ParseJson("{" + Entry("a", "F32", "[9223372036854775808]", 0, 8) + "}",
                8),
      "shape dim 9223372036854775808 is too large");
  EXPECT_INVALID(
      ParseJson("{" + Entry("a", "F32", "[99999999999999999999]", 0, 8) + "}",
                8),
      "shape dim 99999999999999999999 is not a non-negative 64-bit integer");
}

TEST(SafetensorsMalformedTest, ShapeProductOverflows) {
  EXPECT_INVALID(
      ParseJson("{" + Entry("a", "F32", "[4294967296,4294967296]", 0, 8) + "}",
                8),
      "tensor \"a\": shape [4294967296, 4294967296] has too many elements");
  // Even with a zero dim, the other dims must not overflow together.
  EXPECT_INVALID(
      ParseJson(
          "{" + Entry("a", "F32", "[0,4294967296,4294967296]", 0, 0) + "}", 0),
      "has too many elements");
  // Fits in int64 elements but not in bytes of F64: still caught as a
  // mismatch, not an overflow.
  EXPECT_INVALID(
      ParseJson("{" + Entry("a", "F64", "[4611686018427387904]", 0, 8) + "}",
                8),
      "needs 36893488147419103232");
}

TEST(SafetensorsMalformedTest, ShapeLargerThanFile) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "F32", "[1000000]", 0, 8) + "}", 8),
                 "tensor \"a\": data_offsets [0, 8] hold 8 bytes but shape "
                 "[1000000] of F32 needs 4000000");
}

TEST(SafetensorsMalformedTest, RankTooLarge) {
  std::string shape = "[1";
  for (int i = 1; i <= kMaxTensorRank; ++i) shape += ",1";
  shape += "]";
  EXPECT_INVALID(ParseJson("{" + Entry("a", "U8", shape, 0, 1) + "}", 1),
                 "tensor \"a\": shape has more than 16 dims");
  // Exactly kMaxTensorRank is fine.
  shape = "[1";
  for (int i = 1; i < kMaxTensorRank; ++i) shape += ",1";
  shape += "]";
  EXPECT_TRUE(ParseJson("{" + Entry("a", "U8", shape, 0, 1) + "}", 1).ok());
}

TEST(SafetensorsMalformedTest, DataOffsetsWrongArity) {
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}",
                1),
      "tensor \"a\": data_offsets has 1 entries; expected [begin, end]");
  EXPECT_INVALID(
      ParseJson(
          "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}",
          1),
      "data_offsets has more than 2 entries");
  EXPECT_INVALID(
      ParseJson("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":1}}",
                1),
      "data_offsets is not an array of two non-negative integers");
}

TEST(SafetensorsMalformedTest, DataOffsetsNotNonNegativeInts) {
  EXPECT_INVALID(
      ParseJson(
          "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}",
          1),
      "tensor \"a\": data_offsets entry -1 is negative");
  EXPECT_INVALID(
      ParseJson(
          "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.0]}}",
          1),
      "data_offsets entry 1.0 is not a non-negative 64-bit integer");
  EXPECT_INVALID(
      ParseJson(
          "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,\"1\"]}}",
          1),
      "data_offsets is not an array of two non-negative integers (found a "
      "string)");
}

TEST(SafetensorsMalformedTest, DataOffsetsReversed) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "U8", "[0]", 4, 0) + "}", 4),
                 "tensor \"a\": data_offsets [4, 0] end before they begin");
}

TEST(SafetensorsMalformedTest, DataOffsetsPastDataSection) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "U8", "[16]", 0, 16) + "}", 8),
                 "tensor \"a\": data_offsets [0, 16] end past the data section "
                 "(8 bytes)");
  EXPECT_INVALID(
      ParseJson("{" + Entry("a", "U8", "[1]", 0, UINT64_MAX) + "}", 8),
      "end past the data section");
}

TEST(SafetensorsMalformedTest, ByteCountMismatch) {
  EXPECT_INVALID(
      ParseJson("{" + Entry("a.weight", "F32", "[2,3]", 0, 12) + "}", 12),
      "tensor \"a.weight\": data_offsets [0, 12] hold 12 bytes but "
      "shape [2, 3] of F32 needs 24");
  // A scalar needs one element.
  EXPECT_INVALID(ParseJson("{" + Entry("s", "BF16", "[]", 0, 0) + "}", 0),
                 "shape [] of BF16 needs 2");
}

TEST(SafetensorsMalformedTest, Overlap) {
  std::string json = absl::StrCat("{", Entry("a", "U8", "[8]", 0, 8), ",",
                                  Entry("b", "U8", "[8]", 4, 12), "}");
  EXPECT_INVALID(ParseJson(json, 12),
                 "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" "
                 "[0, 8]");
  // A zero-size tensor strictly inside another overlaps it too.
  json = absl::StrCat("{", Entry("a", "U8", "[8]", 0, 8), ",",
                      Entry("z", "U8", "[0]", 4, 4), "}");
  EXPECT_INVALID(ParseJson(json, 8),
                 "tensor \"z\": data_offsets [4, 4] overlap");
  // Two tensors at the same place.
  json = absl::StrCat("{", Entry("a", "U8", "[8]", 0, 8), ",",
                      Entry("b", "U8", "[8]", 0, 8), "}");
  EXPECT_INVALID(ParseJson(json, 8), "overlap tensor \"a\"");
}

TEST(SafetensorsMalformedTest, GapBetweenTensors) {
  std::string json = absl::StrCat("{", Entry("a", "U8", "[8]", 0, 8), ",",
                                  Entry("b", "U8", "[4]", 12, 16), "}");
  EXPECT_INVALID(ParseJson(json, 16),
                 "tensor \"b\": data_offsets [12, 16] leave a gap of 4 bytes "
                 "after tensor \"a\" [0, 8]");
}

TEST(SafetensorsMalformedTest, FirstTensorNotAtZero) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "U8", "[4]", 4, 8) + "}", 8),
                 "tensor \"a\": data_offsets [4, 8] leave a gap of 4 bytes "
                 "after the start of the data section");
}

TEST(SafetensorsMalformedTest, TrailingBytesNotCovered) {
  EXPECT_INVALID(ParseJson("{" + Entry("a", "U8", "[4]", 0, 4) + "}", 12),
                 "tensors end at 4 (tensor \"a\") but the data section holds "
                 "12 bytes; 8 trailing bytes");
  EXPECT_INVALID(ParseJson("{}", 3),
                 "header lists no tensors but the data section holds 3 bytes");
  // A whole file with one byte appended.
  std::string file = MakeFile({{"a", DType::kU8, {2}, 2}}) + "x";
  EXPECT_INVALID(ParseFile(file), "1 trailing bytes");
}

TEST(SafetensorsMalformedTest, MetadataNotAnObject) {
  EXPECT_INVALID(ParseJson("{\"__metadata__\":\"x\"}", 0),
                 "__metadata__ is not an object (found a string)");
  EXPECT_INVALID(ParseJson("{\"__metadata__\":null}", 0),
                 "__metadata__ is not an object (found null)");
}

TEST(SafetensorsMalformedTest, MetadataValueNotAString) {
  EXPECT_INVALID(ParseJson("{\"__metadata__\":{\"a\":\"b\",\"n\":1}}", 0),
                 "__metadata__: value of \"n\" is not a string (found the "
                 "number 1)");
  EXPECT_INVALID(ParseJson("{\"__metadata__\":{\"o\":{}}}", 0),
                 "value of \"o\" is not a string (found an object)");
}

TEST(SafetensorsMalformedTest, MetadataDuplicates) {
  EXPECT_INVALID(ParseJson("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0),
                 "__metadata__: duplicate key \"k\"");
  EXPECT_INVALID(ParseJson("{\"__metadata__\":{},\"__metadata__\":{}}", 0),
                 "duplicate __metadata__");
}

TEST(SafetensorsMalformedTest, NamesInMessagesAreEscapedAndCapped) {
  std::string long_name(1000, 'x');
  std::string json = "{\"" + long_name + "\":1}";
  absl::StatusOr<SafetensorsHeader> h = ParseJson(json, 0);
  ASSERT_FALSE(h.ok());
  EXPECT_LT(h.status().message().size(), 400u) << h.status();
  EXPECT_TRUE(absl::StrContains(h.status().message(), "...\""));
  EXPECT_INVALID(ParseJson("{\"a\\nb\":1}", 0), "tensor \"a\\x0ab\"");
}

// Every truncation and every single-byte corruption of a valid header must
// either parse or be rejected with INVALID_ARGUMENT — never crash (run under
// ASan/UBSan in the sanitizer presets).
TEST(SafetensorsMalformedTest, CorruptedHeadersNeverCrash) {
  std::string file = MakeFile({{"w", DType::kF16, {2, 2}, 8},
                               {"b", DType::kF32, {0}, 0},
                               {"c", DType::kI8, {3}, 3}},
                              {{"k", "v"}});
  const uint64_t n = file.size();
  const std::string header = file.substr(8, file.size() - 8 - 11);
  for (size_t len = 0; len <= header.size(); ++len) {
    absl::StatusOr<SafetensorsHeader> h =
        ParseSafetensorsHeader(header.substr(0, len), n);
    if (!h.ok()) {
      EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  const char kBytes[] = {'0', '9', '-', '.', '"', '[',  ']',    '{',
                         '}', ',', ':', ' ', 'e', '\0', '\x80', '\xff'};
  for (size_t i = 0; i < header.size(); ++i) {
    for (char c : kBytes) {
      std::string mutated = header;
      mutated[i] = c;
      absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(mutated, n);
      if (!h.ok()) {
        EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
}

TEST(SafetensorsMalformedTest, DeepNestingIsRejectedCheaply) {
  std::string json =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":" + std::string(1 << 20, '[');
  EXPECT_INVALID(ParseJson(json, 0), "(found an array)");
  json = "{\"__metadata__\":{\"k\":" + std::string(1 << 20, '[');
  EXPECT_INVALID(ParseJson(json, 0), "is not a string");
}

TEST(SafetensorsMalformedTest, ControlCharactersInNamesAreRejected) {
  for (const char* name : {"a\\nb", "a\\tb", "a\\u001b[2Jb", "a\\u007fb",
                           "a\\u0085b", "a\\u009bb", "a\x7f" "b", "a\xc2\x9b" "b"}) {
    EXPECT_INVALID(ParseJson(absl::StrCat("{", Entry(name, "U8", "[1]", 0, 1), "}"),
                             1),
                   "contains control character U+00");
  }
  // Other unicode, NBSP and spaces included, is fine.
  EXPECT_TRUE(ParseJson(absl::StrCat("{", Entry("caf\xc3\xa9 \xc2\xa0x", "U8", "[1]", 0, 1),
                                     "}"),
                        1)
                  .ok());
  EXPECT_INVALID(ParseSafetensorsIndex(
                     R"({"weight_map": {"a\nb": "f.safetensors"}})"),
                 "weight_map: tensor \"a\\x0ab\" contains control character");
  EXPECT_INVALID(ParseSafetensorsIndex(
                     R"({"weight_map": {"a": "f\u001b.safetensors"}})"),
                 "contains a control character");
}

// ---------------------------------------------------------------------------
// Index files

TEST(SafetensorsIndexTest, ParsesWeightMapAndFilesInFirstSeenOrder) {
  absl::StatusOr<SafetensorsIndex> idx = ParseSafetensorsIndex(R"({
    "metadata": {"total_size": 1234, "nested": {"x": [1, 2, {"y": null}]}},
    "weight_map": {
      "z.weight": "model-00002-of-00002.safetensors",
      "a.weight": "model-00001-of-00002.safetensors",
      "m.weight": "model-00002-of-00002.safetensors"
    }
  })");
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_EQ(idx->files,
            (std::vector<std::string>{"model-00002-of-00002.safetensors",
                                      "model-00001-of-00002.safetensors"}));
  EXPECT_EQ(idx->weight_map.size(), 3u);
  EXPECT_EQ(idx->weight_map.at("a.weight"), "model-00001-of-00002.safetensors");
}

TEST(SafetensorsIndexTest, MetadataIsOptional) {
  absl::StatusOr<SafetensorsIndex> idx =
      ParseSafetensorsIndex(R"({"weight_map": {"a": "m.safetensors"}})");
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_EQ(idx->files, (std::vector<std::string>{"m.safetensors"}));
}

TEST(SafetensorsIndexTest, Rejects) {
  EXPECT_INVALID(ParseSafetensorsIndex("{"), "index is not valid JSON");
  EXPECT_INVALID(ParseSafetensorsIndex("[]"), "index is not a JSON object");
  EXPECT_INVALID(ParseSafetensorsIndex("{}"), "index has no \"weight_map\"");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"metadata": {}})"),
                 "index has no \"weight_map\"");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"weight_map": {}})"),
                 "empty \"weight_map\"");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"weight_map": []})"),
                 "weight_map is not an object (found an array)");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"weight_map": {"a": 1}})"),
                 "weight_map: tensor \"a\": file is not a string");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"weight_map": {"a": ["f"]}})"),
                 "weight_map: tensor \"a\": file is not a string");
  EXPECT_INVALID(ParseSafetensorsIndex(R"({"metadata": 3, "weight_map": {}})"),
                 "metadata is not an object");
  EXPECT_INVALID(
      ParseSafetensorsIndex(R"({"weight_map": {"a": "f", "a": "g"}})"),
      "weight_map: duplicate tensor \"a\"");
  EXPECT_INVALID(ParseSafetensorsIndex(
                     R"({"weight_map": {"a": "f"}, "weight_map": {"b": "g"}})"),
                 "duplicate key \"weight_map\"");
  EXPECT_INVALID(ParseSafetensorsIndex(
                     R"({"metadata": {"k": 1, "k": 2}, "weight_map": {}})"),
                 "\"metadata\": duplicate key \"k\"");
  EXPECT_INVALID(ParseSafetensorsIndex("{\"weight_map\": {\"a\xff\": \"f\"}}"),
                 "index is not valid UTF-8");
  EXPECT_INVALID(ParseSafetensorsIndex("{\"metadata\": {\"a\":" +
                                       std::string(100000, '[')),
                 "index nests deeper than 64 levels");
  EXPECT_INVALID(
      ParseSafetensorsIndex("{\"other\": " + std::string(100000, '[')),
      "index nests deeper than 64 levels");
  EXPECT_INVALID(ParseSafetensorsIndex(
                     std::string("{\"weight_map\": {\"a\": \"f\"}}\0x", 29)),
                 "index contains a NUL byte");
}

TEST(SafetensorsIndexTest, RejectsFileNamesOutsideTheDirectory) {
  struct Case {
    const char* file;
    const char* why;
  };
  for (const Case& c : std::vector<Case>{
           {"../x.safetensors", "has a \"..\" component"},
           {"..", "has a \"..\" component"},
           {"a/../../x", "has a \"..\" component"},
           {"a/..", "has a \"..\" component"},
           {"/etc/passwd", "is an absolute path"},
           {"sub/x.safetensors", "is not a plain file name"},
           {"sub\\\\x.safetensors", "is not a plain file name"},
           {".", "is not a file name"},
           {"", "is empty"},
           {"a\\u0000b", "contains a NUL byte"},  // escaped, so valid JSON
       }) {
    std::string json = absl::StrCat(
        R"({"weight_map": {"t": "ok.safetensors", "w": ")", c.file, "\"}}");
    EXPECT_INVALID(ParseSafetensorsIndex(json), c.why);
    EXPECT_INVALID(ParseSafetensorsIndex(json), "weight_map: tensor \"w\"");
  }
}

}  // namespace
}  // namespace weightd
