// Fuzzes the wire decoding of weightd.v1.FetchRequest and what the daemon
// does with it before touching a model: DecodeFetch (server/grpc/
// proto_convert.cc, the daemon's own), MeshCoord::Validate and PlanShard
// over a fixed table of tensor shapes — the path every Fetch RPC takes.
//
// The input is the serialized message. A message that parses must
// re-serialize to bytes that parse to the same message.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/shard.h"
#include "server/grpc/proto_convert.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {
namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

// Shapes of the kinds a checkpoint holds: scalar, vector, matrix, uneven,
// empty, and high-rank.
const std::vector<std::vector<int64_t>>& Shapes() {
  static const auto* const kShapes = new std::vector<std::vector<int64_t>>{
      {},
      {7},
      {64, 32},
      {5, 3},
      {0, 8},
      {1},
      {3, 1, 4, 1, 5},
      {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
      {int64_t{1} << 40, 3},
  };
  return *kShapes;
}

void Plan(const FetchParams& p) {
  if (!p.mesh.Validate().ok()) return;
  const std::vector<Placement> placements =
      p.placements.has_value() ? *p.placements : DefaultPlacements(p.mesh.shape.size());
  for (const std::vector<int64_t>& shape : Shapes()) {
    absl::StatusOr<ShardBox> box = PlanShard(shape, p.mesh, placements);
    if (!box.ok()) {
      FUZZ_CHECK(box.status().code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    if (shape.empty()) {
      FUZZ_CHECK(box->shape.empty() && box->offset.empty());
      continue;
    }
    FUZZ_CHECK(box->shape.size() == shape.size() && box->offset.size() == shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      FUZZ_CHECK(box->offset[d] >= 0 && box->shape[d] >= 0);
      FUZZ_CHECK(box->shape[d] <= shape[d] - box->offset[d]);
    }
    (void)box->NumElements();
    (void)IsContiguous(shape, *box);
  }
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  v1::FetchRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;

  const std::string wire = req.SerializeAsString();
  v1::FetchRequest again;
  FUZZ_CHECK(again.ParseFromString(wire));
  FUZZ_CHECK(again.SerializeAsString() == wire);

  absl::StatusOr<FetchParams> decoded = DecodeFetch(req);
  if (!decoded.ok()) {
    FUZZ_CHECK(decoded.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  if (decoded->dtype.has_value()) FUZZ_CHECK(ToProtoDType(*decoded->dtype) == req.dtype());
  Plan(*decoded);
  return 0;
}
