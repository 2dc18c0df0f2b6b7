#include "server/profile/name_summary.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace weightd {
namespace {

// Integer components longer than this stay literal (they would not fit an
// int64 and are not layer indices anyway).
constexpr size_t kMaxIntegerDigits = 18;

using Tuple = std::vector<int64_t>;
// One product-shaped line: a sorted, duplicate-free value set per position.
using Block = std::vector<std::vector<int64_t>>;

struct SplitName {
  std::vector<std::string> literals;  // values.size() + 1 pieces
  Tuple values;
};

SplitName Split(absl::string_view name) {
  SplitName out;
  std::string literal;
  size_t i = 0;
  while (i < name.size()) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(name[i]))) {
      literal.push_back(name[i++]);
      continue;
    }
    size_t j = i;
    while (j < name.size() &&
           absl::ascii_isdigit(static_cast<unsigned char>(name[j]))) {
      ++j;
    }
    const size_t len = j - i;
    if (len <= kMaxIntegerDigits && (len == 1 || name[i] != '0')) {
      int64_t value = 0;
      for (size_t k = i; k < j; ++k) value = value * 10 + (name[k] - '0');
      out.literals.push_back(std::move(literal));
      literal.clear();
      out.values.push_back(value);
    } else {
      literal.append(name.data() + i, len);
    }
    i = j;
  }
  out.literals.push_back(std::move(literal));
  return out;
}

// Covers `tuples` (sorted, unique, each of size k) with disjoint blocks.
void Cover(const std::vector<Tuple>& tuples, size_t k,
           std::vector<Block>* out) {
  if (k == 0) {
    out->push_back(Block{});
    return;
  }
  Block sets(k);
  for (const Tuple& t : tuples) {
    for (size_t i = 0; i < k; ++i) sets[i].push_back(t[i]);
  }
  bool grid = true;
  size_t product = 1;
  for (std::vector<int64_t>& s : sets) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    if (product > tuples.size() / s.size()) grid = false;
    if (grid) product *= s.size();
  }
  // Unique tuples inside the product of the sets fill it iff they are as many.
  if (grid && product == tuples.size()) {
    out->push_back(std::move(sets));
    return;
  }
  // Not a grid: split off the last position and cover together the prefixes
  // that share their set of last values.
  std::map<Tuple, std::vector<int64_t>> last_by_prefix;
  for (const Tuple& t : tuples) {
    last_by_prefix[Tuple(t.begin(), t.end() - 1)].push_back(t.back());
  }
  std::map<std::vector<int64_t>, std::vector<Tuple>> prefixes_by_last;
  for (auto& [prefix, last] : last_by_prefix) {
    prefixes_by_last[last].push_back(prefix);  // sorted: tuples were sorted
  }
  for (auto& [last, prefixes] : prefixes_by_last) {
    std::vector<Block> sub;
    Cover(prefixes, k - 1, &sub);
    for (Block& b : sub) {
      b.push_back(last);
      out->push_back(std::move(b));
    }
  }
}

// Renders a sorted, duplicate-free, non-empty set.
std::string FormatSortedSet(const std::vector<int64_t>& values) {
  if (values.size() == 1) return absl::StrCat(values[0]);
  std::vector<std::string> items;
  size_t i = 0;
  while (i < values.size()) {
    size_t j = i;
    while (j + 1 < values.size() && values[j + 1] == values[j] + 1) ++j;
    if (j - i >= 2) {
      items.push_back(absl::StrCat(values[i], "..", values[j]));
    } else {
      for (size_t k = i; k <= j; ++k) items.push_back(absl::StrCat(values[k]));
    }
    i = j + 1;
  }
  return absl::StrCat("{", absl::StrJoin(items, ","), "}");
}

// Natural order: digit runs compare as numbers, everything else bytewise.
bool NaturalLess(absl::string_view a, absl::string_view b) {
  auto is_digit = [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c));
  };
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && is_digit(a[ie])) ++ie;
      while (je < b.size() && is_digit(b[je])) ++je;
      absl::string_view da = a.substr(i, ie - i), db = b.substr(j, je - j);
      absl::string_view na = da, nb = db;
      while (na.size() > 1 && na.front() == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb.front() == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      if (da.size() != db.size()) return da.size() < db.size();
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) {
      return static_cast<unsigned char>(a[i]) <
             static_cast<unsigned char>(b[j]);
    }
    ++i;
    ++j;
  }
  return i == a.size() && j < b.size();
}

}  // namespace

std::string FormatIntegerSet(absl::Span<const int64_t> values) {
  std::vector<int64_t> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  if (sorted.empty()) return "{}";
  return FormatSortedSet(sorted);
}

std::vector<std::string> SummarizeNames(absl::Span<const std::string> names,
                                        size_t max_lines) {
  // literal pieces -> value tuples of the names made of them.
  std::map<std::vector<std::string>, std::vector<Tuple>> groups;
  for (const std::string& name : names) {
    SplitName split = Split(name);
    groups[std::move(split.literals)].push_back(std::move(split.values));
  }
  struct Line {
    std::string first;  // the smallest name it covers
    std::string text;
  };
  std::vector<Line> lines;
  for (auto& [literals, tuples] : groups) {
    std::sort(tuples.begin(), tuples.end());
    tuples.erase(std::unique(tuples.begin(), tuples.end()), tuples.end());
    std::vector<Block> blocks;
    Cover(tuples, literals.size() - 1, &blocks);
    for (const Block& block : blocks) {
      Line line{literals[0], literals[0]};
      for (size_t i = 0; i < block.size(); ++i) {
        absl::StrAppend(&line.first, block[i].front(), literals[i + 1]);
        absl::StrAppend(&line.text, FormatSortedSet(block[i]), literals[i + 1]);
      }
      lines.push_back(std::move(line));
    }
  }
  std::sort(lines.begin(), lines.end(), [](const Line& a, const Line& b) {
    if (a.first != b.first) return NaturalLess(a.first, b.first);
    return a.text < b.text;
  });
  std::vector<std::string> out;
  const size_t shown = std::min(max_lines, lines.size());
  out.reserve(shown + 1);
  for (size_t i = 0; i < shown; ++i) out.push_back(std::move(lines[i].text));
  if (lines.size() > shown) {
    out.push_back(absl::StrCat("... and ", lines.size() - shown, " more"));
  }
  return out;
}

std::string SummarizeNamesInline(absl::Span<const std::string> names,
                                 size_t max_lines) {
  return absl::StrJoin(SummarizeNames(names, max_lines), ", ");
}

}  // namespace weightd
