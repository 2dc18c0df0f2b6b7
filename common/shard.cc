#include "common/shard.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace weightd {
namespace {

constexpr int kMaxMeshDims = 8;
// Shard dims beyond this cannot exist (safetensors rank limit is 16).
constexpr int kMaxShardDim = 15;

// Parses a non-negative decimal integer: digits only (no sign, no spaces),
// no overflow.
bool ParseNonNegative(absl::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(text, out) && *out >= 0;
}

std::string Quoted(absl::string_view text) {
  return absl::StrCat("\"", text, "\"");
}

}  // namespace

absl::StatusOr<Placement> ParsePlacement(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  if (t == "R" || t == "Replicate()") return Placement::Replicate();
  absl::string_view digits;
  if (absl::StartsWith(t, "Shard(") && absl::EndsWith(t, ")")) {
    digits = t.substr(6, t.size() - 7);
  } else if (t.size() >= 2 && t.front() == 'S') {
    digits = t.substr(1);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid placement ", Quoted(text),
                     " (expected R, S<dim>, Replicate() or Shard(<dim>))"));
  }
  int64_t dim = 0;
  if (!ParseNonNegative(digits, &dim) ||
      (digits.size() > 1 && digits.front() == '0')) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid placement ", Quoted(text),
                     ": the shard dim must be a non-negative integer"));
  }
  if (dim > kMaxShardDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid placement ", Quoted(text), ": shard dim ", dim,
                     " exceeds the maximum of ", kMaxShardDim));
  }
  return Placement::Shard(static_cast<int>(dim));
}

absl::StatusOr<std::vector<Placement>> ParsePlacements(absl::string_view text) {
  std::vector<Placement> out;
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("empty placement list");
  }
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    if (absl::StripAsciiWhitespace(part).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty entry in placement list ", Quoted(text)));
    }
    absl::StatusOr<Placement> p = ParsePlacement(part);
    if (!p.ok()) return p.status();
    out.push_back(*p);
  }
  if (out.size() > static_cast<size_t>(kMaxMeshDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement list ", Quoted(text), " has ", out.size(),
                     " entries; at most ", kMaxMeshDims, " mesh dims"));
  }
  return out;
}

std::string PlacementsToString(absl::Span<const Placement> placements) {
  return absl::StrJoin(placements, ",",
                       [](std::string* out, const Placement& p) {
                         if (p.is_shard()) {
                           absl::StrAppend(out, "S", p.shard_dim);
                         } else {
                           out->append("R");
                         }
                       });
}

absl::Status MeshCoord::Validate() const {
  if (shape.empty() || shape.size() > static_cast<size_t>(kMaxMeshDims)) {
    return absl::InvalidArgumentError(absl::StrCat("mesh has ", shape.size(),
                                                   " dims; 1 to ", kMaxMeshDims,
                                                   " are supported"));
  }
  if (coord.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinate has ", coord.size(),
                     " entries but the mesh has ", shape.size(), " dims"));
  }
  int64_t world = 1;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh dim ", k, " has size ", shape[k], "; sizes must be >= 1"));
    }
    if (world > std::numeric_limits<int64_t>::max() / shape[k]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh [", absl::StrJoin(shape, "x"), "] has too many ranks"));
    }
    world *= shape[k];
  }
  for (size_t k = 0; k < shape.size(); ++k) {
    if (coord[k] < 0 || coord[k] >= shape[k]) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", coord[k], " is out of range for mesh dim ", k,
                       " of size ", shape[k]));
    }
  }
  return absl::OkStatus();
}

int64_t MeshCoord::FlatRank() const {
  int64_t rank = 0;
  for (size_t k = 0; k < shape.size() && k < coord.size(); ++k) {
    rank = rank * shape[k] + coord[k];
  }
  return rank;
}

int64_t MeshCoord::WorldSize() const {
  int64_t world = 1;
  for (int64_t s : shape) world *= s;
  return world;
}

absl::StatusOr<std::vector<int64_t>> ParseMeshShape(absl::string_view text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, 'x')) {
    int64_t v = 0;
    if (!ParseNonNegative(part, &v) || v == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "invalid mesh shape ", Quoted(text),
          " (expected positive sizes joined by 'x', e.g. 8 or 2x4)"));
    }
    out.push_back(v);
  }
  if (out.size() > static_cast<size_t>(kMaxMeshDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh shape ", Quoted(text), " has ", out.size(),
                     " dims; at most ", kMaxMeshDims, " are supported"));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParseCoord(absl::string_view text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!ParseNonNegative(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "invalid mesh coordinate ", Quoted(text),
          " (expected non-negative integers joined by ',', e.g. 1,3)"));
    }
    out.push_back(v);
  }
  if (out.size() > static_cast<size_t>(kMaxMeshDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh coordinate ", Quoted(text), " has ", out.size(),
                     " entries; at most ", kMaxMeshDims, " are supported"));
  }
  return out;
}

std::vector<Placement> DefaultPlacements(size_t mesh_dims) {
  std::vector<Placement> out(mesh_dims, Placement::Replicate());
  if (!out.empty()) out.back() = Placement::Shard(0);
  return out;
}

int64_t ShardBox::NumElements() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

ChunkRange ChunkOf(int64_t n, int64_t parts, int64_t index) {
  // Out-of-contract arguments get an empty chunk rather than UB.
  if (n <= 0 || parts <= 0 || index < 0 || index >= parts) {
    return ChunkRange{0, 0};
  }
  // 128-bit so that n near INT64_MAX cannot overflow index * c.
  const __int128 c = n / parts + (n % parts != 0 ? 1 : 0);
  const __int128 lo = static_cast<__int128>(index) * c;
  const __int128 hi = lo + c;
  const __int128 start = std::min<__int128>(n, lo);
  const __int128 end = std::min<__int128>(n, hi);
  return ChunkRange{static_cast<int64_t>(start),
                    static_cast<int64_t>(end - start)};
}

absl::StatusOr<ShardBox> PlanShard(absl::Span<const int64_t> global_shape,
                                   const MeshCoord& mesh,
                                   absl::Span<const Placement> placements) {
  if (absl::Status s = mesh.Validate(); !s.ok()) return s;
  if (placements.size() != mesh.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        placements.size(), " placements (", PlacementsToString(placements),
        ") for a mesh of ", mesh.shape.size(), " dims"));
  }
  ShardBox box;
  // 0-dim tensors are always replicated (DTensor cannot shard a scalar).
  if (global_shape.empty()) return box;
  const int ndim = static_cast<int>(global_shape.size());
  for (int d = 0; d < ndim; ++d) {
    if (global_shape[d] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor dim ", d, " has negative size ", global_shape[d]));
    }
  }
  box.offset.assign(global_shape.size(), 0);
  box.shape.assign(global_shape.begin(), global_shape.end());
  for (size_t k = 0; k < placements.size(); ++k) {
    const Placement& p = placements[k];
    if (!p.is_shard()) {
      if (p.shard_dim != -1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "invalid placement shard_dim ", p.shard_dim, " for mesh dim ", k));
      }
      continue;
    }
    const int d = p.shard_dim;
    if (d >= ndim) {
      return absl::InvalidArgumentError(
          absl::StrCat("Shard(", d, ") on mesh dim ", k, ": dim ", d,
                       " is out of range for a tensor with ndim ", ndim));
    }
    const ChunkRange r = ChunkOf(box.shape[d], mesh.shape[k], mesh.coord[k]);
    box.offset[d] += r.start;
    box.shape[d] = r.length;
  }
  return box;
}

bool IsContiguous(absl::Span<const int64_t> global_shape, const ShardBox& box) {
  const size_t ndim = global_shape.size();
  if (box.shape.size() != ndim || box.offset.size() != ndim) return false;
  for (int64_t s : box.shape) {
    if (s == 0) return true;  // no elements: trivially one (empty) run
  }
  size_t d = 0;
  while (d < ndim && box.shape[d] == 1) ++d;  // single index: no stride jump
  if (d < ndim) ++d;                          // the one dim that may be partial
  for (; d < ndim; ++d) {
    if (box.offset[d] != 0 || box.shape[d] != global_shape[d]) return false;
  }
  return true;
}

}  // namespace weightd
