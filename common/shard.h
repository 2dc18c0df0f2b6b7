// Shard planning with torch DTensor semantics (docs/DESIGN.md §2.1).
//
// Shard(d) over m ranks follows torch.chunk: c = ceil(n/m), rank r gets
// [r*c, min(n, (r+1)*c)), empty when r*c >= n. Placements apply in mesh-dim
// order, each splitting the piece the previous ones left. 0-dim tensors are
// always replicated.
#ifndef WEIGHTD_COMMON_SHARD_H_
#define WEIGHTD_COMMON_SHARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace weightd {

struct Placement {
  // -1 = Replicate, otherwise Shard(shard_dim).
  int shard_dim = -1;

  static Placement Replicate() { return Placement{-1}; }
  static Placement Shard(int dim) { return Placement{dim}; }
  bool is_shard() const { return shard_dim >= 0; }
  bool operator==(const Placement& o) const { return shard_dim == o.shard_dim; }
};

// "R" or "S<d>" ("Shard(0)" and "Replicate()" accepted too).
absl::StatusOr<Placement> ParsePlacement(absl::string_view text);
// Comma-separated list, one entry per mesh dim: "R,S0".
absl::StatusOr<std::vector<Placement>> ParsePlacements(absl::string_view text);
std::string PlacementsToString(absl::Span<const Placement> placements);

// A device mesh and this rank's coordinate in it.
struct MeshCoord {
  std::vector<int64_t> shape;  // e.g. {W} or {replicate, shard}
  std::vector<int64_t> coord;  // same length as shape

  // Checks shape entries >= 1, coord inside shape, 1 <= dims <= 8.
  absl::Status Validate() const;
  // Row-major flat rank.
  int64_t FlatRank() const;
  int64_t WorldSize() const;
};

// "AxB" -> {A, B}; "W" -> {W}. Zero or negative sizes are INVALID_ARGUMENT.
absl::StatusOr<std::vector<int64_t>> ParseMeshShape(absl::string_view text);
// "i,j" -> {i, j}.
absl::StatusOr<std::vector<int64_t>> ParseCoord(absl::string_view text);

// Shard(0) on the last mesh dim and Replicate on the others (the seed's
// FSDP/HSDP default) for a mesh of `mesh_dims` dims.
std::vector<Placement> DefaultPlacements(size_t mesh_dims);

// The local piece of a tensor: a box [offset, offset + shape) per dim.
struct ShardBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> shape;

  int64_t NumElements() const;
  bool operator==(const ShardBox& o) const {
    return offset == o.offset && shape == o.shape;
  }
};

// [start, start+len) of chunk `index` of a dim of size `n` split `parts` ways.
struct ChunkRange {
  int64_t start;
  int64_t length;
};
ChunkRange ChunkOf(int64_t n, int64_t parts, int64_t index);

// The box of `global_shape` that `mesh` gets under `placements` (one per mesh
// dim). INVALID_ARGUMENT when placements.size() != mesh dims or a Shard dim is
// out of range for a tensor of ndim >= 1. 0-dim tensors get the whole tensor.
absl::StatusOr<ShardBox> PlanShard(absl::Span<const int64_t> global_shape,
                                   const MeshCoord& mesh,
                                   absl::Span<const Placement> placements);

// True when the box is one contiguous run of the row-major global tensor
// (every dim after the first non-trivially-sliced one is whole).
bool IsContiguous(absl::Span<const int64_t> global_shape, const ShardBox& box);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_SHARD_H_
