#include "common/shard.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"

namespace weightd {
namespace {

using Shape = std::vector<int64_t>;

#define EXPECT_INVALID(expr, substr)                                      \
  do {                                                                    \
    auto wd_result_ = (expr);                                             \
    ASSERT_FALSE(wd_result_.ok()) << #expr;                               \
    absl::Status wd_s_ = wd_result_.status();                             \
    EXPECT_EQ(wd_s_.code(), absl::StatusCode::kInvalidArgument) << wd_s_; \
    EXPECT_TRUE(absl::StrContains(wd_s_.message(), substr)) << wd_s_;     \
  } while (0)

std::vector<int64_t> Lengths(int64_t n, int64_t parts) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < parts; ++i)
    out.push_back(ChunkOf(n, parts, i).length);
  return out;
}

std::vector<int64_t> Starts(int64_t n, int64_t parts) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < parts; ++i) out.push_back(ChunkOf(n, parts, i).start);
  return out;
}

ShardBox Plan(const Shape& global, const Shape& mesh, const Shape& coord,
              const std::vector<Placement>& placements) {
  absl::StatusOr<ShardBox> box =
      PlanShard(global, MeshCoord{mesh, coord}, placements);
  EXPECT_TRUE(box.ok()) << box.status();
  return box.ok() ? *box : ShardBox{};
}

const Placement R = Placement::Replicate();
Placement S(int d) { return Placement::Shard(d); }

// ---- ChunkOf ----

TEST(ChunkOfTest, UnevenSplitLeavesShortTail) {
  EXPECT_EQ(Lengths(10, 4), (Shape{3, 3, 3, 1}));
  EXPECT_EQ(Starts(10, 4), (Shape{0, 3, 6, 9}));
}

TEST(ChunkOfTest, UnevenSplitLeavesEmptyTail) {
  EXPECT_EQ(Lengths(5, 4), (Shape{2, 2, 1, 0}));
  EXPECT_EQ(Starts(5, 4), (Shape{0, 2, 4, 5}));
  EXPECT_EQ(Lengths(2, 4), (Shape{1, 1, 0, 0}));
  EXPECT_EQ(Starts(2, 4), (Shape{0, 1, 2, 2}));
  // torch.chunk(arange(9), 4) -> 3,3,3 and nothing for the fourth.
  EXPECT_EQ(Lengths(9, 4), (Shape{3, 3, 3, 0}));
  EXPECT_EQ(Starts(9, 4), (Shape{0, 3, 6, 9}));
}

TEST(ChunkOfTest, ZeroLengthDimGivesEmptyChunks) {
  EXPECT_EQ(Lengths(0, 4), (Shape{0, 0, 0, 0}));
  EXPECT_EQ(Starts(0, 4), (Shape{0, 0, 0, 0}));
}

TEST(ChunkOfTest, EvenSplitAndSinglePart) {
  EXPECT_EQ(Lengths(8, 4), (Shape{2, 2, 2, 2}));
  EXPECT_EQ(Lengths(7, 1), (Shape{7}));
  EXPECT_EQ(Lengths(3, 3), (Shape{1, 1, 1}));
}

TEST(ChunkOfTest, HugeDimDoesNotOverflow) {
  const int64_t n = INT64_MAX;
  const int64_t parts = 3;
  int64_t total = 0;
  for (int64_t i = 0; i < parts; ++i) {
    ChunkRange r = ChunkOf(n, parts, i);
    EXPECT_EQ(r.start, total);
    EXPECT_GE(r.length, 0);
    total += r.length;
  }
  EXPECT_EQ(total, n);
}

// ---- PlanShard ----

TEST(PlanShardTest, OneDimMeshShardsRows) {
  EXPECT_EQ(Plan({10, 6}, {4}, {0}, {S(0)}), (ShardBox{{0, 0}, {3, 6}}));
  EXPECT_EQ(Plan({10, 6}, {4}, {3}, {S(0)}), (ShardBox{{9, 0}, {1, 6}}));
  EXPECT_EQ(Plan({10, 6}, {4}, {2}, {S(1)}), (ShardBox{{0, 4}, {10, 2}}));
  EXPECT_EQ(Plan({10, 6}, {4}, {3}, {S(1)}), (ShardBox{{0, 6}, {10, 0}}));
  EXPECT_EQ(Plan({10, 6}, {4}, {1}, {R}), (ShardBox{{0, 0}, {10, 6}}));
}

TEST(PlanShardTest, HsdpReplicateThenShard) {
  // (replicate, shard) mesh: both replicas get the same rows.
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(Plan({10, 4}, {2, 2}, {i, 0}, {R, S(0)}),
              (ShardBox{{0, 0}, {5, 4}}));
    EXPECT_EQ(Plan({10, 4}, {2, 2}, {i, 1}, {R, S(0)}),
              (ShardBox{{5, 0}, {5, 4}}));
  }
}

TEST(PlanShardTest, TwoDimsShardedOnDifferentMeshDims) {
  EXPECT_EQ(Plan({10, 7}, {2, 2}, {0, 0}, {S(0), S(1)}),
            (ShardBox{{0, 0}, {5, 4}}));
  EXPECT_EQ(Plan({10, 7}, {2, 2}, {0, 1}, {S(0), S(1)}),
            (ShardBox{{0, 4}, {5, 3}}));
  EXPECT_EQ(Plan({10, 7}, {2, 2}, {1, 0}, {S(0), S(1)}),
            (ShardBox{{5, 0}, {5, 4}}));
  EXPECT_EQ(Plan({10, 7}, {2, 2}, {1, 1}, {S(0), S(1)}),
            (ShardBox{{5, 4}, {5, 3}}));
}

TEST(PlanShardTest, DoubleSplitOfOneDimSplitsThePiece) {
  // 10 rows: first 5/5, then each 5 into 3/2.
  EXPECT_EQ(Plan({10}, {2, 2}, {0, 0}, {S(0), S(0)}), (ShardBox{{0}, {3}}));
  EXPECT_EQ(Plan({10}, {2, 2}, {0, 1}, {S(0), S(0)}), (ShardBox{{3}, {2}}));
  EXPECT_EQ(Plan({10}, {2, 2}, {1, 0}, {S(0), S(0)}), (ShardBox{{5}, {3}}));
  EXPECT_EQ(Plan({10}, {2, 2}, {1, 1}, {S(0), S(0)}), (ShardBox{{8}, {2}}));
  // Not the same as 4-way chunking of the whole (3,3,3,1).
  EXPECT_NE(Plan({10}, {2, 2}, {1, 0}, {S(0), S(0)}),
            Plan({10}, {4}, {2}, {S(0)}));
}

TEST(PlanShardTest, DoubleSplitCanLeaveEmptyPieces) {
  // 3 rows over 2x2: 2/1, then 2 -> 1/1 and 1 -> 1/0.
  EXPECT_EQ(Plan({3, 2}, {2, 2}, {1, 0}, {S(0), S(0)}),
            (ShardBox{{2, 0}, {1, 2}}));
  EXPECT_EQ(Plan({3, 2}, {2, 2}, {1, 1}, {S(0), S(0)}),
            (ShardBox{{3, 0}, {0, 2}}));
}

TEST(PlanShardTest, ZeroDimTensorIsAlwaysWhole) {
  EXPECT_EQ(Plan({}, {4}, {2}, {S(0)}), (ShardBox{}));
  EXPECT_EQ(Plan({}, {2, 2}, {1, 1}, {S(3), S(0)}), (ShardBox{}));
  EXPECT_EQ(ShardBox{}.NumElements(), 1);  // a scalar
}

TEST(PlanShardTest, EmptyDims) {
  EXPECT_EQ(Plan({0, 5}, {4}, {3}, {S(0)}), (ShardBox{{0, 0}, {0, 5}}));
  EXPECT_EQ(Plan({4, 0}, {4}, {1}, {S(0)}), (ShardBox{{1, 0}, {1, 0}}));
  EXPECT_EQ(Plan({2, 3}, {4}, {3}, {S(0)}), (ShardBox{{2, 0}, {0, 3}}));
  EXPECT_EQ((ShardBox{{2, 0}, {0, 3}}).NumElements(), 0);
}

TEST(PlanShardTest, ShardDimOutOfRange) {
  MeshCoord mesh{{4}, {0}};
  std::vector<Placement> p = {S(2)};
  EXPECT_INVALID(PlanShard(Shape{10, 6}, mesh, p), "dim 2");
  EXPECT_INVALID(PlanShard(Shape{10, 6}, mesh, p), "ndim 2");
  p = {S(1)};
  EXPECT_INVALID(PlanShard(Shape{10}, mesh, p), "ndim 1");
}

TEST(PlanShardTest, PlacementCountMustMatchMesh) {
  MeshCoord mesh{{2, 2}, {0, 0}};
  std::vector<Placement> p = {S(0)};
  EXPECT_INVALID(PlanShard(Shape{10}, mesh, p),
                 "1 placements (S0) for a mesh of 2 dims");
}

TEST(PlanShardTest, InvalidMeshIsRejected) {
  std::vector<Placement> p = {S(0)};
  EXPECT_INVALID(PlanShard(Shape{10}, MeshCoord{{4}, {4}}, p),
                 "rank 4 is out of range for mesh dim 0 of size 4");
  EXPECT_INVALID(PlanShard(Shape{10}, MeshCoord{{4}, {-1}}, p),
                 "rank -1 is out of range for mesh dim 0 of size 4");
}

TEST(PlanShardTest, NegativeGlobalDimIsRejected) {
  std::vector<Placement> p = {S(0)};
  EXPECT_INVALID(PlanShard(Shape{10, -1}, MeshCoord{{4}, {0}}, p),
                 "tensor dim 1 has negative size -1");
}

TEST(PlanShardTest, InvalidPlacementValueIsRejected) {
  std::vector<Placement> p = {Placement{-2}};
  EXPECT_INVALID(PlanShard(Shape{10}, MeshCoord{{4}, {0}}, p),
                 "invalid placement shard_dim -2");
}

// Independent model: materialise the indices of each dim and split the list
// the way torch.chunk does (pieces of ceil(len/m), fewer pieces when the
// list runs out), taking this rank's piece for each mesh dim in order.
ShardBox Simulate(const Shape& global, const MeshCoord& mesh,
                  const std::vector<Placement>& placements) {
  ShardBox box;
  if (global.empty()) return box;
  for (size_t d = 0; d < global.size(); ++d) {
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < global[d]; ++i) idx.push_back(i);
    int64_t base = 0;  // offset of idx[0] when idx is empty
    for (size_t k = 0; k < placements.size(); ++k) {
      if (placements[k].shard_dim != static_cast<int>(d)) continue;
      const int64_t m = mesh.shape[k];
      const int64_t len = static_cast<int64_t>(idx.size());
      const int64_t c = (len + m - 1) / m;
      std::vector<std::vector<int64_t>> pieces;
      for (int64_t i = 0; i < len; ++i) {
        if (pieces.empty() || static_cast<int64_t>(pieces.back().size()) == c) {
          pieces.emplace_back();
        }
        pieces.back().push_back(idx[i]);
      }
      const int64_t r = mesh.coord[k];
      if (r < static_cast<int64_t>(pieces.size())) {
        idx = pieces[r];
      } else {
        // DTensor pads with empty pieces placed after the data.
        base = idx.empty() ? base : idx.back() + 1;
        idx.clear();
      }
    }
    box.offset.push_back(idx.empty() ? base : idx.front());
    box.shape.push_back(static_cast<int64_t>(idx.size()));
  }
  return box;
}

std::string Describe(const Shape& global, const MeshCoord& mesh,
                     const std::vector<Placement>& placements) {
  return "global [" + absl::StrJoin(global, ",") + "] mesh [" +
         absl::StrJoin(mesh.shape, "x") + "] coord [" +
         absl::StrJoin(mesh.coord, ",") + "] placements " +
         PlacementsToString(placements);
}

TEST(PlanShardTest, MatchesNestedChunkSimulation) {
  std::mt19937 rng(12345);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 20000; ++iter) {
    Shape global(uniform(0, 3));
    for (int64_t& g : global) g = uniform(0, 13);
    MeshCoord mesh;
    mesh.shape.resize(uniform(1, 3));
    std::vector<Placement> placements;
    for (int64_t& s : mesh.shape) {
      s = uniform(1, 5);
      mesh.coord.push_back(uniform(0, s - 1));
      if (global.empty() || uniform(0, 3) == 0) {
        placements.push_back(R);
      } else {
        placements.push_back(S(static_cast<int>(
            uniform(0, static_cast<int64_t>(global.size()) - 1))));
      }
    }
    absl::StatusOr<ShardBox> got = PlanShard(global, mesh, placements);
    ASSERT_TRUE(got.ok()) << got.status() << " "
                          << Describe(global, mesh, placements);
    ASSERT_EQ(*got, Simulate(global, mesh, placements))
        << Describe(global, mesh, placements);
  }
}

TEST(PlanShardTest, RanksTileTheTensorExactly) {
  // With every mesh dim sharding, the ranks' boxes partition the tensor.
  const Shape global = {7, 5};
  const Shape mesh_shape = {2, 3};
  const std::vector<std::vector<Placement>> cases = {
      {S(0), S(1)}, {S(1), S(0)}, {S(0), S(0)}, {S(1), S(1)}};
  for (const auto& placements : cases) {
    std::vector<int> hits(35, 0);
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t j = 0; j < 3; ++j) {
        ShardBox b = Plan(global, mesh_shape, {i, j}, placements);
        for (int64_t r = b.offset[0]; r < b.offset[0] + b.shape[0]; ++r) {
          for (int64_t c = b.offset[1]; c < b.offset[1] + b.shape[1]; ++c) {
            ++hits[r * 5 + c];
          }
        }
      }
    }
    for (int h : hits) EXPECT_EQ(h, 1) << PlacementsToString(placements);
  }
}

// ---- MeshCoord ----

TEST(MeshCoordTest, FlatRankIsRowMajor) {
  MeshCoord m{{2, 4}, {1, 2}};
  EXPECT_TRUE(m.Validate().ok());
  EXPECT_EQ(m.FlatRank(), 6);
  EXPECT_EQ(m.WorldSize(), 8);
  MeshCoord m3{{2, 3, 4}, {1, 2, 3}};
  EXPECT_EQ(m3.FlatRank(), 1 * 12 + 2 * 4 + 3);
  EXPECT_EQ(m3.WorldSize(), 24);
}

TEST(MeshCoordTest, ValidateRejectsBadMeshes) {
  auto check = [](MeshCoord m, absl::string_view substr) {
    absl::Status s = m.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), substr)) << s;
  };
  check(MeshCoord{{}, {}}, "mesh has 0 dims");
  check(MeshCoord{Shape(9, 1), Shape(9, 0)}, "mesh has 9 dims");
  check(MeshCoord{{2, 0}, {0, 0}}, "mesh dim 1 has size 0");
  check(MeshCoord{{2, -3}, {0, 0}}, "mesh dim 1 has size -3");
  check(MeshCoord{{2, 2}, {0}}, "coordinate has 1 entries but the mesh has 2");
  check(MeshCoord{{4}, {4}}, "rank 4 is out of range for mesh dim 0 of size 4");
  check(MeshCoord{{4, 2}, {3, 2}},
        "rank 2 is out of range for mesh dim 1 of size 2");
  check(MeshCoord{{INT64_MAX, 2}, {0, 0}}, "too many ranks");
  EXPECT_TRUE((MeshCoord{Shape(8, 1), Shape(8, 0)}).Validate().ok());
}

// ---- Parsing ----

TEST(ParseMeshShapeTest, Accepts) {
  EXPECT_EQ(*ParseMeshShape("4"), (Shape{4}));
  EXPECT_EQ(*ParseMeshShape("2x3"), (Shape{2, 3}));
  EXPECT_EQ(*ParseMeshShape("1x2x3"), (Shape{1, 2, 3}));
}

TEST(ParseMeshShapeTest, Rejects) {
  for (const char* bad :
       {"", "0", "2x0", "2x", "x2", "-1", "2x-1", "+2", " 2", "2 ", "2x3x",
        "axb", "2.0", "2X3", "99999999999999999999", "9223372036854775808",
        "1x1x1x1x1x1x1x1x1"}) {
    EXPECT_INVALID(ParseMeshShape(bad), "mesh shape");
  }
}

TEST(ParseCoordTest, AcceptsAndRejects) {
  EXPECT_EQ(*ParseCoord("0"), (Shape{0}));
  EXPECT_EQ(*ParseCoord("1,2"), (Shape{1, 2}));
  for (const char* bad : {"", ",", "1,", ",1", "-1", "1,,2", "a", "1x2",
                          "99999999999999999999"}) {
    EXPECT_INVALID(ParseCoord(bad), "mesh coordinate");
  }
}

TEST(ParsePlacementTest, AcceptsShortAndTorchSpellings) {
  EXPECT_EQ(*ParsePlacement("R"), R);
  EXPECT_EQ(*ParsePlacement("Replicate()"), R);
  EXPECT_EQ(*ParsePlacement("S0"), S(0));
  EXPECT_EQ(*ParsePlacement("S15"), S(15));
  EXPECT_EQ(*ParsePlacement("Shard(0)"), S(0));
  EXPECT_EQ(*ParsePlacement("Shard(3)"), S(3));
}

TEST(ParsePlacementTest, Rejects) {
  for (const char* bad :
       {"", "S", "S-1", "S16", "S1x", "Shard()", "Shard(-1)", "Shard(16)",
        "Shard(1", "r", "X", "Replicate", "S01", "S99999999999999999999"}) {
    EXPECT_INVALID(ParsePlacement(bad), "invalid placement");
  }
}

TEST(ParsePlacementsTest, CommaSeparated) {
  EXPECT_EQ(*ParsePlacements("R,S0"), (std::vector<Placement>{R, S(0)}));
  EXPECT_EQ(*ParsePlacements("S0"), (std::vector<Placement>{S(0)}));
  EXPECT_EQ(*ParsePlacements("Shard(1),Replicate()"),
            (std::vector<Placement>{S(1), R}));
  EXPECT_INVALID(ParsePlacements(""), "empty placement list");
  EXPECT_INVALID(ParsePlacements("R,"), "empty entry");
  EXPECT_INVALID(ParsePlacements(",R"), "empty entry");
  EXPECT_INVALID(ParsePlacements("R,,S0"), "empty entry");
  EXPECT_INVALID(ParsePlacements("R,Q"), "invalid placement \"Q\"");
}

TEST(PlacementsToStringTest, RoundTrips) {
  std::vector<Placement> p = {R, S(0), S(12)};
  EXPECT_EQ(PlacementsToString(p), "R,S0,S12");
  EXPECT_EQ(*ParsePlacements(PlacementsToString(p)), p);
  EXPECT_EQ(PlacementsToString({}), "");
}

TEST(DefaultPlacementsTest, ShardsLastMeshDim) {
  EXPECT_EQ(DefaultPlacements(0), (std::vector<Placement>{}));
  EXPECT_EQ(DefaultPlacements(1), (std::vector<Placement>{S(0)}));
  EXPECT_EQ(DefaultPlacements(2), (std::vector<Placement>{R, S(0)}));
  EXPECT_EQ(DefaultPlacements(3), (std::vector<Placement>{R, R, S(0)}));
}

// ---- IsContiguous ----

TEST(IsContiguousTest, Cases) {
  const Shape g = {4, 6};
  EXPECT_TRUE(IsContiguous(g, {{0, 0}, {4, 6}}));   // whole
  EXPECT_TRUE(IsContiguous(g, {{1, 0}, {2, 6}}));   // row range
  EXPECT_TRUE(IsContiguous(g, {{1, 2}, {1, 3}}));   // part of one row
  EXPECT_FALSE(IsContiguous(g, {{0, 0}, {4, 3}}));  // column shard
  EXPECT_FALSE(IsContiguous(g, {{0, 3}, {2, 3}}));
  EXPECT_TRUE(IsContiguous(g, {{0, 6}, {4, 0}}));  // empty
  EXPECT_TRUE(IsContiguous(g, {{4, 0}, {0, 6}}));  // empty
  EXPECT_TRUE(IsContiguous({}, {{}, {}}));         // scalar

  const Shape g3 = {3, 4, 5};
  EXPECT_TRUE(IsContiguous(g3, {{1, 0, 0}, {2, 4, 5}}));
  EXPECT_TRUE(IsContiguous(g3, {{1, 1, 0}, {1, 2, 5}}));
  EXPECT_TRUE(IsContiguous(g3, {{1, 1, 2}, {1, 1, 3}}));
  EXPECT_FALSE(IsContiguous(g3, {{1, 1, 0}, {2, 2, 5}}));
  EXPECT_FALSE(IsContiguous(g3, {{0, 0, 1}, {1, 4, 4}}));
  // Trailing size-1 dims that are whole do not break contiguity.
  EXPECT_TRUE(IsContiguous({8, 1}, {{2, 0}, {3, 1}}));
  EXPECT_TRUE(IsContiguous({1, 8}, {{0, 2}, {1, 3}}));
  // Mismatched ranks are not a valid box.
  EXPECT_FALSE(IsContiguous(g, {{0}, {4}}));
}

TEST(IsContiguousTest, RowShardsAreContiguousColumnShardsAreNot) {
  const Shape g = {10, 6};
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_TRUE(IsContiguous(g, Plan(g, {4}, {r}, {S(0)})));
  }
  EXPECT_FALSE(IsContiguous(g, Plan(g, {4}, {0}, {S(1)})));
  EXPECT_TRUE(IsContiguous(g, Plan(g, {4}, {3}, {S(1)})));  // empty piece
}

}  // namespace
}  // namespace weightd
