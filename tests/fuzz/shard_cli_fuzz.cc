// Fuzzes the CLI-shape parsers of common/shard.h and common/dtype.h —
// ParseMeshShape, ParseCoord, ParsePlacements, ParseRequestDType: what
// weightctl and the Python client turn flags into — and PlanShard on what
// they accept.
//
// Input: up to five lines, "mesh\ncoord\nplacements\ndtype\nshape", shape
// being comma-separated signed 64-bit dims (rank <= 16). Missing lines are
// empty. When the mesh has at most kMaxWorld ranks, every rank's box is
// planned and the boxes must tile the tensor: inside it, and (when the
// element count fits) their sizes summing to numel x the replication factor.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/shard.h"

namespace weightd {
namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

constexpr int64_t kMaxWorld = 64;
// Element counts up to this are summed over ranks without overflow
// (kMaxWorld * 2^40 < 2^63).
constexpr int64_t kMaxCheckedElements = int64_t{1} << 40;

// Like a safetensors header, rejects shapes whose non-zero dims multiply
// past INT64_MAX (negative dims are kept: PlanShard must reject them).
bool ParseShape(absl::string_view text, std::vector<int64_t>* out) {
  if (text.empty()) return true;  // 0-dim
  int64_t product = 1;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || out->size() >= 16) return false;
    if (v > 0) {
      if (product > std::numeric_limits<int64_t>::max() / v) return false;
      product *= v;
    }
    out->push_back(v);
  }
  return true;
}

void CheckBox(absl::Span<const int64_t> shape, const ShardBox& box) {
  if (shape.empty()) {
    FUZZ_CHECK(box.offset.empty() && box.shape.empty());
    return;
  }
  FUZZ_CHECK(box.offset.size() == shape.size());
  FUZZ_CHECK(box.shape.size() == shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    FUZZ_CHECK(box.offset[d] >= 0 && box.shape[d] >= 0);
    FUZZ_CHECK(box.shape[d] <= shape[d] - box.offset[d]);
  }
  (void)IsContiguous(shape, box);
}

// Every rank's box, and their total size.
void CheckAllRanks(absl::Span<const int64_t> shape, const MeshCoord& mesh,
                   absl::Span<const Placement> placements) {
  const int64_t world = mesh.WorldSize();
  if (world > kMaxWorld) return;
  int64_t numel = 1;
  bool countable = true;
  for (int64_t d : shape) {
    if (d != 0 && numel > kMaxCheckedElements / d) countable = false;
    if (countable) numel *= d;
  }
  int64_t replication = 1;
  for (size_t k = 0; k < placements.size(); ++k) {
    if (!placements[k].is_shard() || shape.empty()) replication *= mesh.shape[k];
  }
  int64_t total = 0;
  MeshCoord m = mesh;
  for (int64_t rank = 0; rank < world; ++rank) {
    int64_t r = rank;
    for (size_t k = m.shape.size(); k-- > 0;) {
      m.coord[k] = r % m.shape[k];
      r /= m.shape[k];
    }
    FUZZ_CHECK(m.FlatRank() == rank);
    absl::StatusOr<ShardBox> box = PlanShard(shape, m, placements);
    FUZZ_CHECK(box.ok());  // the validity of a plan cannot depend on the rank
    CheckBox(shape, *box);
    if (countable) total += shape.empty() ? 1 : box->NumElements();
  }
  if (countable) FUZZ_CHECK(total == (shape.empty() ? 1 : numel) * replication);
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<absl::string_view> lines = absl::StrSplit(in, absl::MaxSplits('\n', 4));
  lines.resize(5);
  // Flags arrive as std::strings: never a null view (on which absl::StrSplit
  // yields no pieces at all, so the parsers would return empty lists).
  for (absl::string_view& line : lines) {
    if (line.data() == nullptr) line = absl::string_view("", 0);
  }

  absl::StatusOr<std::vector<int64_t>> mesh_shape = ParseMeshShape(lines[0]);
  absl::StatusOr<std::vector<int64_t>> coord = ParseCoord(lines[1]);
  absl::StatusOr<std::vector<Placement>> placements = ParsePlacements(lines[2]);
  absl::StatusOr<std::optional<DType>> dtype = ParseRequestDType(lines[3]);
  if (mesh_shape.ok()) {
    FUZZ_CHECK(!mesh_shape->empty() && mesh_shape->size() <= 8);
    for (int64_t s : *mesh_shape) FUZZ_CHECK(s >= 1);
  }
  if (coord.ok()) {
    FUZZ_CHECK(!coord->empty() && coord->size() <= 8);
    for (int64_t c : *coord) FUZZ_CHECK(c >= 0);
  }
  if (placements.ok()) {
    FUZZ_CHECK(!placements->empty() && placements->size() <= 8);
    // The canonical spelling parses back to the same list.
    const std::string text = PlacementsToString(*placements);
    absl::StatusOr<std::vector<Placement>> again = ParsePlacements(text);
    FUZZ_CHECK(again.ok() && *again == *placements);
  }
  if (dtype.ok() && dtype->has_value()) {
    // The CLI spelling is the safetensors name, lowercased.
    const std::string name = absl::AsciiStrToLower(DTypeName(**dtype));
    absl::StatusOr<std::optional<DType>> again = ParseRequestDType(name);
    FUZZ_CHECK(again.ok() && *again == *dtype);
  }

  std::vector<int64_t> shape;
  if (!mesh_shape.ok() || !ParseShape(lines[4], &shape)) return 0;
  MeshCoord mesh{*mesh_shape, coord.ok() ? *coord : std::vector<int64_t>(mesh_shape->size(), 0)};
  const std::vector<Placement> pl =
      placements.ok() ? *placements : DefaultPlacements(mesh.shape.size());
  absl::StatusOr<ShardBox> box = PlanShard(shape, mesh, pl);
  if (!box.ok()) {
    FUZZ_CHECK(box.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(mesh.Validate().ok());
  CheckBox(shape, *box);
  CheckAllRanks(shape, mesh, pl);
  return 0;
}
