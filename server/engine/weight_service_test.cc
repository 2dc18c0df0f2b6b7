// WeightService on its own (no gRPC, no sockets): load, fetch, leases and
// their tensor ranges (what a push writes), the fetch-table cache, release,
// unload while leased, and the errors of each — the behaviour the Python
// suites reach through the daemon, checked here against bytes computed
// independently (torch.chunk rows of a known tensor).
#include "server/engine/weight_service.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"

namespace weightd {
namespace {

// A [rows, cols] F32 tensor whose element k is k + 0.5.
std::vector<float> Ramp(int rows, int cols) {
  std::vector<float> v(static_cast<size_t>(rows) * cols);
  for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(k) + 0.5f;
  return v;
}

class WeightServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weight_service_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    // "w": F32 [5, 3]; "b": F32 [4]
    w_ = Ramp(5, 3);
    b_ = Ramp(4, 1);
    path_ = root_ + "/m.safetensors";
    ASSERT_TRUE(WriteSafetensorsFile(path_, {{"w", DType::kF32, {5, 3}, F32Bytes(w_)},
                                             {"b", DType::kF32, {4}, F32Bytes(b_)}})
                    .ok());
    WeightServiceOptions options;
    options.model_roots = {root_};
    options.data_socket_path = "/nonexistent/data.sock";
    auto service = WeightService::Create(std::move(options));
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = std::move(*service);
  }
  void TearDown() override {
    service_.reset();
    ::unlink(path_.c_str());
    ::rmdir(root_.c_str());
  }

  FetchParams Rank(int world, int rank) {
    FetchParams p;
    p.model = "m";
    p.mesh = MeshCoord{{world}, {rank}};
    return p;
  }

  std::string root_, path_;
  std::vector<float> w_, b_;
  std::unique_ptr<WeightService> service_;
};

TEST_F(WeightServiceTest, FetchServesTorchChunkRowsUnderALeaseWithTheirRanges) {
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  // torch.chunk(w, 2, 0): rows 0..2 and 3..4.
  auto r = service_->Fetch(Rank(2, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  const FetchTable& table = *r->table;
  ASSERT_EQ(table.tensors.size(), 2u);
  ASSERT_NE(table.ranges, nullptr);
  ASSERT_EQ(table.ranges->size(), 2u);
  auto lease = service_->leases()->Use(
      r->lease.id, absl::string_view(reinterpret_cast<const char*>(r->lease.token.data()), 16));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ((*lease)->tensors, table.ranges);  // a push writes exactly these
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const FetchedTensor& t = table.tensors[i];
    const LeaseTensor& range = (*table.ranges)[i];
    EXPECT_EQ(range.buffer, t.segment);
    EXPECT_EQ(range.offset, t.offset);
    EXPECT_EQ(range.length, t.length);
    const uint8_t* bytes = (*lease)->buffers[t.segment]->host_data() + t.offset;
    if (t.name == "w") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
      EXPECT_EQ(t.global_offset, (std::vector<int64_t>{3, 0}));
      ASSERT_EQ(t.length, 6u * 4);
      EXPECT_EQ(std::memcmp(bytes, w_.data() + 9, t.length), 0);
    } else {
      EXPECT_EQ(t.name, "b");
      EXPECT_EQ(t.shape, (std::vector<int64_t>{2}));
      ASSERT_EQ(t.length, 2u * 4);
      EXPECT_EQ(std::memcmp(bytes, b_.data() + 2, t.length), 0);
    }
  }
  EXPECT_EQ(table.bytes, 8u * 4);
  EXPECT_EQ(service_->leases()->size(), 1u);
  absl::string_view token(reinterpret_cast<const char*>(r->lease.token.data()), 16);
  EXPECT_TRUE(service_->Release(r->lease.id, token).ok());
  EXPECT_EQ(service_->leases()->size(), 0u);
  EXPECT_EQ(service_->Release(r->lease.id, token).code(), absl::StatusCode::kNotFound);
}

TEST_F(WeightServiceTest, ARepeatedFetchIsTheCachedTableWithItsOwnLease) {
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  FetchParams p = Rank(3, 2);
  p.dtype = DType::kBF16;
  auto first = service_->Fetch(p);
  auto second = service_->Fetch(p);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->table, second->table);
  EXPECT_NE(first->lease.id, second->lease.id);
  for (const FetchedTensor& t : first->table->tensors) {
    EXPECT_EQ(t.dtype, DType::kBF16);
    EXPECT_EQ(t.length, static_cast<uint64_t>(NumElements(t.shape)) * 2);
  }
  EXPECT_EQ(service_->Stats().fetches, 2u);
}

TEST_F(WeightServiceTest, UnloadingKeepsLeasedBytesAndRefusesNewFetches) {
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  auto r = service_->Fetch(Rank(1, 0));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(service_->UnloadModel("m").ok());
  EXPECT_EQ(service_->Fetch(Rank(1, 0)).status().code(), absl::StatusCode::kNotFound);
  auto lease = service_->leases()->Use(
      r->lease.id, absl::string_view(reinterpret_cast<const char*>(r->lease.token.data()), 16));
  ASSERT_TRUE(lease.ok());
  const FetchedTensor& w = r->table->tensors[0];
  EXPECT_EQ(std::memcmp((*lease)->buffers[w.segment]->host_data() + w.offset, w_.data(), w.length),
            0);
}

TEST_F(WeightServiceTest, EachBadRequestGetsItsCode) {
  EXPECT_EQ(service_->LoadModel("m", "/etc/passwd", "", nullptr).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  EXPECT_EQ(service_->LoadModel("m", path_, "", nullptr).status().code(),
            absl::StatusCode::kAlreadyExists);
  FetchParams unknown = Rank(1, 0);
  unknown.model = "nope";
  EXPECT_EQ(service_->Fetch(unknown).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(service_->Fetch(Rank(2, 2)).status().code(), absl::StatusCode::kInvalidArgument);
  FetchParams twice = Rank(1, 0);
  twice.names = {"w", "w"};
  EXPECT_EQ(service_->Fetch(twice).status().code(), absl::StatusCode::kInvalidArgument);
  FetchParams missing = Rank(1, 0);
  missing.names = {"w", "zz"};
  auto miss = service_->Fetch(missing);
  EXPECT_EQ(miss.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(miss.status().message().find("zz"), std::string::npos) << miss.status();
  FetchParams gen = Rank(1, 0);
  gen.generation = 7;
  EXPECT_EQ(service_->Fetch(gen).status().code(), absl::StatusCode::kNotFound);
  // Nothing was leased by any of them.
  EXPECT_EQ(service_->leases()->size(), 0u);
}

}  // namespace
}  // namespace weightd

namespace weightd {
namespace {

// --state-dir's contract with the service: every change reaches the sink
// before any client can see it (so a crash never loses a change somebody
// saw), in the order clients see them, with consecutive sequence numbers.
TEST_F(WeightServiceTest, StateChangesReachTheSinkBeforeTheyAreVisible) {
  WeightService* svc = nullptr;
  std::vector<StateRecord> seen;
  std::vector<std::string> visible_at_sink;  // what List() showed inside the sink
  WeightServiceOptions options;
  options.model_roots = {root_};
  options.data_socket_path = "/nonexistent/data.sock";
  options.on_state_change = [&](const StateRecord& r) {
    seen.push_back(r);
    std::string models;
    for (const ModelSummary& m : svc->ListModels()) {
      models += m.name + "@" + std::to_string(m.generation) + " ";
    }
    visible_at_sink.push_back(models);
  };
  auto service = WeightService::Create(std::move(options));
  ASSERT_TRUE(service.ok()) << service.status();
  svc = service->get();
  auto loaded = svc->LoadModel("m", path_, "", nullptr);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto applied = svc->Apply("m", {}, 0);  // a new generation, same content
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_TRUE(svc->SetGenerationFloor("m", 10).ok());
  ASSERT_TRUE(svc->UnloadModel("m").ok());
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0].kind, StateRecord::Kind::kModelLoad);
  EXPECT_EQ(seen[0].content, loaded->content.Hex());
  EXPECT_EQ(visible_at_sink[0], "");     // not listed yet when journaled
  EXPECT_EQ(seen[1].kind, StateRecord::Kind::kApply);
  EXPECT_EQ(seen[1].generation, 2u);
  EXPECT_EQ(visible_at_sink[1], "m@1 ");  // generation 2 not served yet
  EXPECT_EQ(seen[2].kind, StateRecord::Kind::kFloor);
  EXPECT_EQ(seen[2].generation, 10u);
  EXPECT_EQ(visible_at_sink[3], "m@2 ");  // still listed while the unload is journaled
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i].seq, i + 1);
  // A failed change reaches no sink.
  EXPECT_FALSE(svc->UnloadModel("m").ok());
  EXPECT_EQ(seen.size(), 4u);
}

// Generation numbers never wrap: a floor past the largest is refused, and
// a model at the largest has no next generation (FAILED_PRECONDITION).
TEST_F(WeightServiceTest, GenerationFloorsAreBoundedAndNumbersNeverWrap) {
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  auto absurd = service_->SetGenerationFloor("m", ~uint64_t{0} - 1);
  EXPECT_EQ(absurd.code(), absl::StatusCode::kInvalidArgument) << absurd;
  ASSERT_TRUE(service_->SetGenerationFloor("m", kMaxGeneration).ok());
  auto last = service_->Apply("m", {}, 0);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->generation, kMaxGeneration);
  auto past = service_->Apply("m", {}, 0);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kFailedPrecondition) << past.status();
  EXPECT_EQ(service_->ListModels().at(0).generation, kMaxGeneration);
  // A fresh load numbers anew.
  ASSERT_TRUE(service_->UnloadModel("m").ok());
  ASSERT_TRUE(service_->LoadModel("m", path_, "", nullptr).ok());
  auto again = service_->Apply("m", {}, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->generation, 2u);
}

TEST_F(WeightServiceTest, RestoreLoadPublishesOnlyTheJournaledContent) {
  WeightService::RestoreExpect expect;
  expect.generation_floor = 7;
  // Wrong identity: refused, nothing served.
  auto refused = service_->RestoreLoadModel("m", path_, "", {}, expect);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_TRUE(service_->ListModels().empty());
  // The right one: served, and the next generation is numbered past the floor.
  auto probe = service_->LoadModel("probe", path_, "", nullptr);
  ASSERT_TRUE(probe.ok());
  expect.content = probe->content;
  auto loaded = service_->RestoreLoadModel("m", path_, "", {}, expect);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto next = service_->Apply("m", {}, 0);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->generation, 7u);
  // A restore apply re-creates a number below the floor, if its content matches.
  auto again = service_->RestoreApply("probe", {}, 5, probe->content);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->generation, 5u);
  Digest other = probe->content;
  other.bytes[0] ^= 1;
  auto mismatch = service_->RestoreApply("probe", {}, 9, other);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(service_->GetModel("probe")->summary.generation, 5u);  // nothing published
}

}  // namespace
}  // namespace weightd
