#include "common/safetensors.h"

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_depth.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "nlohmann/json.hpp"

namespace weightd {
namespace {

using Json = nlohmann::json;

// Error messages quote names from untrusted files: capped and escaped.
std::string Quote(absl::string_view s) { return QuoteForMessage(s); }

// Returns the offset of the first byte that is not part of a well-formed
// UTF-8 sequence (RFC 3629: no overlongs, no surrogates, <= U+10FFFF), or
// npos when all of `s` is valid.
size_t FindInvalidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;  // bounds for the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3;
      lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      len = 3;
    } else if (c == 0xED) {
      len = 3;
      hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4;
      lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4;
      hi = 0x8F;
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return absl::string_view::npos;
}

std::string OffsetsString(uint64_t begin, uint64_t end) {
  return absl::StrCat("[", begin, ", ", end, "]");
}

// nlohmann's messages start with "[json.exception.parse_error.101] ".
std::string JsonErrorMessage(const nlohmann::detail::exception& ex) {
  absl::string_view what = ex.what();
  if (!what.empty() && what.front() == '[') {
    size_t close = what.find("] ");
    if (close != absl::string_view::npos) what.remove_prefix(close + 2);
  }
  // It quotes the last token read, which may be a whole (huge) string.
  return TruncateMessage(what, 4 * kMaxQuotedBytes);
}

// Also rejects NUL bytes: JSON never needs one outside an escape, and
// nlohmann's lexer takes a raw NUL for the end of input, which would let
// anything after it through unchecked.
absl::Status CheckUtf8(absl::string_view text, absl::string_view what) {
  size_t bad = FindInvalidUtf8(text);
  if (bad != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not valid UTF-8 (bad byte at offset ", bad, ")"));
  }
  size_t nul = text.find('\0');
  if (nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " contains a NUL byte at offset ", nul));
  }
  return absl::OkStatus();
}

std::string Uint128String(unsigned __int128 v) {
  if (v == 0) return "0";
  std::string out;
  while (v != 0) {
    out.push_back(static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  }
  return std::string(out.rbegin(), out.rend());
}

constexpr absl::string_view kMetadataKey = "__metadata__";

// A SAX handler that checks the header against the safetensors schema as it
// streams, so memory stays proportional to the tensors and metadata, never
// to whatever else a hostile header contains, and builds the entries.
class HeaderHandler {
 public:
  HeaderHandler(uint64_t data_size, SafetensorsHeader* out)
      : data_size_(data_size), out_(out) {}

  const absl::Status& error() const { return error_; }
  bool done() const { return state_ == State::kDone; }

  // --- SAX interface (nlohmann::json_sax) ---
  bool null() { return Unexpected("null"); }
  bool boolean(bool v) { return Unexpected(v ? "true" : "false"); }
  bool number_integer(int64_t v) {
    if (v >= 0) return number_unsigned(static_cast<uint64_t>(v));  // "-0"
    if (state_ == State::kShape) {
      return FailTensor(absl::StrCat("shape dim ", v, " is negative"));
    }
    if (state_ == State::kOffsets) {
      return FailTensor(absl::StrCat("data_offsets entry ", v, " is negative"));
    }
    return Unexpected(absl::StrCat("the number ", v));
  }
  bool number_unsigned(uint64_t v) {
    if (state_ == State::kShape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return FailTensor(absl::StrCat("shape dim ", v, " is too large"));
      }
      if (entry_.shape.size() >= static_cast<size_t>(kMaxTensorRank)) {
        return FailTensor(
            absl::StrCat("shape has more than ", kMaxTensorRank, " dims"));
      }
      entry_.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (state_ == State::kOffsets) {
      if (num_offsets_ >= 2) {
        return FailTensor("data_offsets has more than 2 entries");
      }
      (num_offsets_ == 0 ? entry_.begin : entry_.end) = v;
      ++num_offsets_;
      return true;
    }
    return Unexpected(absl::StrCat("the number ", v));
  }
  bool number_float(double, const std::string& text) {
    if (state_ == State::kShape) {
      return FailTensor(absl::StrCat("shape dim ", text,
                                     " is not a non-negative 64-bit integer"));
    }
    if (state_ == State::kOffsets) {
      return FailTensor(absl::StrCat("data_offsets entry ", text,
                                     " is not a non-negative 64-bit integer"));
    }
    return Unexpected(absl::StrCat("the number ", text));
  }
  bool string(std::string& v) {
    if (state_ == State::kEntry && field_ == Field::kDtype) {
      absl::StatusOr<DType> dtype = ParseSafetensorsDType(v);
      if (!dtype.ok()) return FailTensor(dtype.status().message());
      entry_.dtype = *dtype;
      return true;
    }
    if (state_ == State::kMetadata) {
      out_->metadata.emplace(std::move(metadata_key_), std::move(v));
      return true;
    }
    return Unexpected("a string");
  }
  bool binary(Json::binary_t&) { return Unexpected("binary data"); }

  bool start_object(size_t) {
    if (state_ == State::kStart) {
      state_ = State::kRoot;
      return true;
    }
    if (state_ == State::kRoot) {
      if (key_ == kMetadataKey) {
        state_ = State::kMetadata;
      } else {
        state_ = State::kEntry;
        entry_ = SafetensorsEntry();
        entry_.name = key_;
        seen_fields_ = 0;
        num_offsets_ = 0;
      }
      return true;
    }
    return Unexpected("an object");
  }
  bool key(std::string& k) {
    switch (state_) {
      case State::kRoot:
        if (!names_.insert(k).second) {
          return Fail(k == kMetadataKey
                          ? absl::StrCat("duplicate ", kMetadataKey)
                          : absl::StrCat("duplicate tensor ", Quote(k)));
        }
        if (absl::Status s = CheckNoControlCharacters(k, "tensor"); !s.ok()) {
          error_ = std::move(s);
          return false;
        }
        key_ = std::move(k);
        return true;
      case State::kEntry: {
        if (k == "dtype") {
          field_ = Field::kDtype;
        } else if (k == "shape") {
          field_ = Field::kShape;
        } else if (k == "data_offsets") {
          field_ = Field::kOffsets;
        } else {
          return FailTensor(absl::StrCat("unexpected field ", Quote(k),
                                         " (expected dtype, shape, "
                                         "data_offsets)"));
        }
        const unsigned bit = 1u << static_cast<int>(field_);
        if (seen_fields_ & bit) {
          return FailTensor(absl::StrCat("duplicate field ", Quote(k)));
        }
        seen_fields_ |= bit;
        return true;
      }
      case State::kMetadata:
        if (out_->metadata.count(k) != 0) {
          return Fail(absl::StrCat(kMetadataKey, ": duplicate key ", Quote(k)));
        }
        metadata_key_ = std::move(k);
        return true;
      default:
        return Fail("unexpected object key");  // unreachable for valid JSON
    }
  }
  bool end_object() {
    switch (state_) {
      case State::kRoot:
        state_ = State::kDone;
        return true;
      case State::kMetadata:
        state_ = State::kRoot;
        return true;
      case State::kEntry:
        if (!FinishEntry()) return false;
        state_ = State::kRoot;
        return true;
      default:
        return Fail("unexpected end of object");
    }
  }
  bool start_array(size_t) {
    if (state_ == State::kEntry && field_ == Field::kShape) {
      state_ = State::kShape;
      return true;
    }
    if (state_ == State::kEntry && field_ == Field::kOffsets) {
      state_ = State::kOffsets;
      return true;
    }
    return Unexpected("an array");
  }
  bool end_array() {
    if (state_ == State::kShape) {
      state_ = State::kEntry;
      return true;
    }
    if (state_ == State::kOffsets) {
      if (num_offsets_ != 2) {
        return FailTensor(absl::StrCat("data_offsets has ", num_offsets_,
                                       " entries; expected [begin, end]"));
      }
      state_ = State::kEntry;
      return true;
    }
    return Fail("unexpected end of array");
  }
  bool parse_error(size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) {
    std::string msg = absl::StrCat("header is not valid JSON (byte ", position,
                                   "): ", JsonErrorMessage(ex));
    if (state_ == State::kEntry || state_ == State::kShape ||
        state_ == State::kOffsets) {
      return FailTensor(msg);
    }
    return Fail(msg);
  }

 private:
  enum class State {
    kStart,
    kRoot,
    kEntry,
    kShape,
    kOffsets,
    kMetadata,
    kDone
  };
  enum class Field { kDtype = 0, kShape = 1, kOffsets = 2 };

  bool Fail(absl::string_view msg) {
    error_ = absl::InvalidArgumentError(msg);
    return false;
  }
  bool FailTensor(absl::string_view msg) {
    return Fail(absl::StrCat("tensor ", Quote(entry_.name), ": ", msg));
  }

  // A value of the wrong kind (`what`) where the schema wants something else.
  bool Unexpected(absl::string_view what) {
    switch (state_) {
      case State::kStart:
        return Fail(
            absl::StrCat("header is not a JSON object (found ", what, ")"));
      case State::kRoot:
        if (key_ == kMetadataKey) {
          return Fail(absl::StrCat(kMetadataKey, " is not an object (found ",
                                   what, ")"));
        }
        return Fail(absl::StrCat("tensor ", Quote(key_),
                                 ": entry is not an object (found ", what,
                                 ")"));
      case State::kEntry:
        switch (field_) {
          case Field::kDtype:
            return FailTensor(
                absl::StrCat("dtype is not a string (found ", what, ")"));
          case Field::kShape:
            return FailTensor(absl::StrCat(
                "shape is not an array of non-negative integers (found ", what,
                ")"));
          case Field::kOffsets:
            return FailTensor(absl::StrCat(
                "data_offsets is not an array of two non-negative integers "
                "(found ",
                what, ")"));
        }
        break;
      case State::kShape:
        return FailTensor(absl::StrCat(
            "shape is not an array of non-negative integers (found ", what,
            ")"));
      case State::kOffsets:
        return FailTensor(absl::StrCat(
            "data_offsets is not an array of two non-negative integers (found ",
            what, ")"));
      case State::kMetadata:
        return Fail(absl::StrCat(kMetadataKey, ": value of ",
                                 Quote(metadata_key_),
                                 " is not a string (found ", what, ")"));
      case State::kDone:
        break;
    }
    return Fail(absl::StrCat("unexpected ", what));
  }

  bool FinishEntry() {
    static constexpr const char* kFieldNames[] = {"dtype", "shape",
                                                  "data_offsets"};
    for (int f = 0; f < 3; ++f) {
      if (!(seen_fields_ & (1u << f))) {
        return FailTensor(
            absl::StrCat("missing field \"", kFieldNames[f], "\""));
      }
    }
    // Every non-zero dim's product must fit in int64 even when another dim
    // is 0, so that strides computed downstream cannot overflow.
    unsigned __int128 product = 1;
    bool has_zero = false;
    for (int64_t d : entry_.shape) {
      if (d == 0) {
        has_zero = true;
        continue;
      }
      product *= static_cast<uint64_t>(d);
      if (product >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return FailTensor(absl::StrCat("shape ", ShapeString(entry_.shape),
                                       " has too many elements"));
      }
    }
    const unsigned __int128 numel = has_zero ? 0 : product;
    const unsigned __int128 needed = numel * DTypeSize(entry_.dtype);
    const std::string offsets = OffsetsString(entry_.begin, entry_.end);
    if (entry_.begin > entry_.end) {
      return FailTensor(
          absl::StrCat("data_offsets ", offsets, " end before they begin"));
    }
    if (entry_.end > data_size_) {
      return FailTensor(absl::StrCat("data_offsets ", offsets,
                                     " end past the data section (", data_size_,
                                     " bytes)"));
    }
    const uint64_t held = entry_.end - entry_.begin;
    if (needed != held) {
      return FailTensor(absl::StrCat(
          "data_offsets ", offsets, " hold ", held, " bytes but shape ",
          ShapeString(entry_.shape), " of ", DTypeName(entry_.dtype), " needs ",
          Uint128String(needed)));
    }
    out_->tensors.push_back(std::move(entry_));
    return true;
  }

  const uint64_t data_size_;
  SafetensorsHeader* const out_;
  absl::Status error_;
  State state_ = State::kStart;
  std::unordered_set<std::string> names_;  // root keys seen
  std::string key_;                        // current root key
  std::string metadata_key_;
  SafetensorsEntry entry_;  // being built (kEntry, kShape, kOffsets)
  Field field_ = Field::kDtype;
  unsigned seen_fields_ = 0;
  int num_offsets_ = 0;
};

// Checks that the sorted tensors tile [0, data_size) exactly.
absl::Status CheckCoverage(const std::vector<SafetensorsEntry>& tensors,
                           uint64_t data_size) {
  uint64_t cursor = 0;
  const SafetensorsEntry* last = nullptr;  // the tensor that ends at cursor
  for (const SafetensorsEntry& t : tensors) {
    const std::string offsets = OffsetsString(t.begin, t.end);
    if (t.begin > cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quote(t.name), ": data_offsets ", offsets,
          " leave a gap of ", t.begin - cursor, " bytes after ",
          last == nullptr ? std::string("the start of the data section")
                          : absl::StrCat("tensor ", Quote(last->name), " ",
                                         OffsetsString(last->begin, last->end)),
          "; the data section must be fully covered"));
    }
    if (t.begin < cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quote(t.name), ": data_offsets ", offsets,
                       " overlap tensor ", Quote(last->name), " ",
                       OffsetsString(last->begin, last->end)));
    }
    if (t.end > cursor || last == nullptr) last = &t;
    cursor = t.end;
  }
  if (cursor != data_size) {
    if (last == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("header lists no tensors but the data section holds ",
                       data_size, " bytes"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "tensors end at ", cursor, " (tensor ", Quote(last->name),
        ") but the data section holds ", data_size, " bytes; ",
        data_size - cursor, " trailing bytes are not covered by any tensor"));
  }
  return absl::OkStatus();
}

// --- Index parsing ---

// Rejects anything but a plain file name in the checkpoint's directory.
absl::Status CheckShardFileName(absl::string_view tensor,
                                absl::string_view file) {
  absl::string_view why;
  if (file.empty()) {
    why = "is empty";
  } else if (file.front() == '/') {
    why = "is an absolute path";
  } else if (file == ".") {
    why = "is not a file name";
  } else if (file == ".." || file.find("/../") != absl::string_view::npos ||
             absl::string_view(file).substr(0, 3) == "../" ||
             (file.size() >= 3 && file.substr(file.size() - 3) == "/..")) {
    why = "has a \"..\" component";
  } else if (file.find('/') != absl::string_view::npos ||
             file.find('\\') != absl::string_view::npos) {
    why = "is not a plain file name (no directories allowed)";
  } else if (file.find('\0') != absl::string_view::npos) {
    why = "contains a NUL byte";
  } else if (FindControlCharacter(file) != absl::string_view::npos) {
    why = "contains a control character";
  }
  if (why.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "weight_map: tensor ", Quote(tensor), ": file ", Quote(file), " ", why));
}

// Streams an HF index: "weight_map" must be an object of strings; anything
// else at the top level ("metadata" and friends) is checked for well-formed
// JSON and duplicate keys, then ignored. Nesting is capped so a hostile file
// cannot make us keep a deep stack.
class IndexHandler {
 public:
  static constexpr size_t kMaxDepth = kMaxJsonDepth;

  explicit IndexHandler(SafetensorsIndex* out) : out_(out) {}

  const absl::Status& error() const { return error_; }
  bool done() const { return done_; }
  bool saw_weight_map() const { return saw_weight_map_; }

  bool null() { return Value("null"); }
  bool boolean(bool v) { return Value(v ? "true" : "false"); }
  bool number_integer(int64_t v) {
    return Value(absl::StrCat("the number ", v));
  }
  bool number_unsigned(uint64_t v) {
    return Value(absl::StrCat("the number ", v));
  }
  bool number_float(double, const std::string& s) {
    return Value(absl::StrCat("the number ", s));
  }
  bool binary(Json::binary_t&) { return Value("binary data"); }
  bool string(std::string& v) {
    if (in_weight_map_ && frames_.size() == 2) {
      absl::Status s = CheckShardFileName(key_, v);
      if (s.ok()) s = CheckNoControlCharacters(key_, "weight_map: tensor");
      if (!s.ok()) return Fail(s);
      if (seen_files_.insert(v).second) out_->files.push_back(v);
      out_->weight_map.emplace(std::move(key_), std::move(v));
      return true;
    }
    return Value("a string");
  }
  bool start_object(size_t) {
    if (frames_.empty()) {
      frames_.emplace_back();
      return true;
    }
    if (frames_.size() == 1 && key_ == "weight_map") {
      in_weight_map_ = true;
      saw_weight_map_ = true;
    } else if (frames_.size() == 1 && key_ == "metadata") {
      // any object
    } else if (!Value("an object")) {
      return false;
    }
    return Push();
  }
  bool key(std::string& k) {
    Frame& f = frames_.back();
    if (!f.keys.insert(k).second) {
      if (frames_.size() == 1) {
        return Fail(absl::StrCat("duplicate key ", Quote(k)));
      }
      if (in_weight_map_ && frames_.size() == 2) {
        return Fail(absl::StrCat("weight_map: duplicate tensor ", Quote(k)));
      }
      return Fail(absl::StrCat(Quote(top_key_), ": duplicate key ", Quote(k)));
    }
    if (frames_.size() == 1) top_key_ = k;
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    frames_.pop_back();
    if (frames_.empty()) {
      done_ = true;
    } else if (frames_.size() == 1) {
      in_weight_map_ = false;
    }
    return true;
  }
  bool start_array(size_t) {
    if (frames_.empty()) return Value("an array");
    if (!Value("an array")) return false;
    return Push();
  }
  bool end_array() {
    frames_.pop_back();
    return true;
  }
  bool parse_error(size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) {
    return Fail(absl::StrCat("index is not valid JSON (byte ", position,
                             "): ", JsonErrorMessage(ex)));
  }

 private:
  struct Frame {
    std::unordered_set<std::string> keys;  // unused for arrays
  };

  bool Fail(absl::string_view msg) {
    error_ = absl::InvalidArgumentError(msg);
    return false;
  }
  bool Fail(const absl::Status& s) {
    error_ = s;
    return false;
  }
  bool Push() {
    if (frames_.size() >= kMaxDepth) {
      return Fail(
          absl::StrCat("index nests deeper than ", kMaxDepth, " levels"));
    }
    frames_.emplace_back();
    return true;
  }
  // A value (of kind `what`) arriving at the current position; only a few
  // positions constrain it.
  bool Value(absl::string_view what) {
    if (frames_.empty()) {
      return Fail(
          absl::StrCat("index is not a JSON object (found ", what, ")"));
    }
    if (frames_.size() == 1 && key_ == "weight_map") {
      return Fail(
          absl::StrCat("weight_map is not an object (found ", what, ")"));
    }
    if (frames_.size() == 1 && key_ == "metadata") {
      return Fail(absl::StrCat("metadata is not an object (found ", what, ")"));
    }
    if (in_weight_map_ && frames_.size() == 2) {
      return Fail(absl::StrCat("weight_map: tensor ", Quote(key_),
                               ": file is not a string (found ", what, ")"));
    }
    return true;
  }

  SafetensorsIndex* const out_;
  absl::Status error_;
  std::vector<Frame> frames_;
  std::string key_;      // last key read, at any depth
  std::string top_key_;  // last top-level key
  bool in_weight_map_ = false;
  bool saw_weight_map_ = false;
  bool done_ = false;
  std::unordered_set<std::string> seen_files_;
};

}  // namespace

absl::StatusOr<uint64_t> ParseSafetensorsPrefix(absl::string_view prefix8,
                                                uint64_t file_size) {
  if (prefix8.size() != 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header length prefix must be 8 bytes, got ", prefix8.size()));
  }
  if (file_size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("file of ", file_size,
                     " bytes is too small to hold the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<unsigned char>(prefix8[i]);
  }
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", n, " exceeds the limit of ",
                     kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (n > file_size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", n, " runs past the end of the file (",
                     file_size, " bytes)"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t file_size) {
  const uint64_t n = json.size();
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", n, " exceeds the limit of ",
                     kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (file_size < 8 || n > file_size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("header of ", n, " bytes does not fit in a file of ",
                     file_size, " bytes"));
  }
  WD_RETURN_IF_ERROR(CheckUtf8(json, "header"));
  // The reference implementation insists on this too (no leading space).
  if (json.empty() || json.front() != '{') {
    return absl::InvalidArgumentError(
        "header is not a JSON object (it must start with '{')");
  }

  SafetensorsHeader header;
  header.header_bytes = n;
  header.data_offset = 8 + n;
  const uint64_t data_size = file_size - 8 - n;
  HeaderHandler handler(data_size, &header);
  const bool ok =
      Json::sax_parse(json.data(), json.data() + json.size(), &handler);
  if (!ok || !handler.done()) {
    if (!handler.error().ok()) return handler.error();
    return absl::InvalidArgumentError("header is not valid JSON");
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.begin, a.end, a.name) <
                     std::tie(b.begin, b.end, b.name);
            });
  WD_RETURN_IF_ERROR(CheckCoverage(header.tensors, data_size));
  return header;
}

std::string BuildSafetensorsHeader(
    absl::Span<const SafetensorsWriteEntry> entries,
    const std::map<std::string, std::string>& metadata) {
  Json root = Json::object();
  uint64_t offset = 0;
  for (const SafetensorsWriteEntry& e : entries) {
    Json entry = Json::object();
    entry["dtype"] = std::string(DTypeName(e.dtype));
    entry["shape"] = e.shape;
    entry["data_offsets"] = {offset, offset + e.length};
    offset += e.length;
    root[e.name] = std::move(entry);
  }
  if (!metadata.empty()) root[std::string(kMetadataKey)] = metadata;
  // `replace` keeps dump() from throwing on a name that is not UTF-8.
  std::string text = root.dump(-1, ' ', /*ensure_ascii=*/false,
                               Json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  }
  out += text;
  return out;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(absl::string_view json) {
  WD_RETURN_IF_ERROR(CheckUtf8(json, "index"));
  SafetensorsIndex index;
  IndexHandler handler(&index);
  const bool ok =
      Json::sax_parse(json.data(), json.data() + json.size(), &handler);
  if (!ok || !handler.done()) {
    if (!handler.error().ok()) return handler.error();
    return absl::InvalidArgumentError("index is not valid JSON");
  }
  if (!handler.saw_weight_map()) {
    return absl::InvalidArgumentError("index has no \"weight_map\"");
  }
  if (index.weight_map.empty()) {
    return absl::InvalidArgumentError("index has an empty \"weight_map\"");
  }
  return index;
}

}  // namespace weightd
