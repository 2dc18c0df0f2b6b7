#include "server/materialize/materializer.h"

#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "server/kernels/cast.h"

namespace weightd {
namespace {

// A stored F32 tensor of `shape` with values 0, 1, 2, ... in its own segment.
struct Fixture {
  std::unique_ptr<HostMemoryManager> memory;
  std::shared_ptr<MemoryAccount> account;
  StoredTensor tensor;

  explicit Fixture(std::vector<int64_t> shape, HostMemoryManager::Options options = {})
      : memory(std::make_unique<HostMemoryManager>(options)), account(memory->account()) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    auto seg = Segment::Create(account, "base", std::max<int64_t>(n * 4, 1), false);
    EXPECT_TRUE(seg.ok());
    for (int64_t i = 0; i < n; ++i) {
      float v = static_cast<float>(i);
      std::memcpy((*seg)->mutable_data() + i * 4, &v, 4);
    }
    EXPECT_TRUE((*seg)->Seal().ok());
    tensor.name = "t";
    tensor.dtype = DType::kF32;
    tensor.shape = shape;
    tensor.length = n * 4;
    tensor.buffer = SegmentPtr(std::move(*seg));
    tensor.digest = DigestBytes(tensor.buffer->host_data(), tensor.length);
  }
};

// The element values a box holds, by brute force.
std::vector<float> Expected(const std::vector<int64_t>& shape, const ShardBox& box) {
  std::vector<float> out;
  size_t nd = shape.size();
  std::vector<int64_t> idx(nd, 0);
  int64_t total = box.NumElements();
  for (int64_t k = 0; k < total; ++k) {
    int64_t lin = 0;
    for (size_t d = 0; d < nd; ++d) lin = lin * shape[d] + box.offset[d] + idx[d];
    out.push_back(static_cast<float>(lin));
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

MaterializeItem Item(const StoredTensor& t, ShardBox box, DType out) {
  MaterializeItem item;
  item.name = t.name;
  item.slices.push_back(PartSlice{&t, t.dtype, t.shape, std::move(box), {}});
  item.out_dtype = out;
  return item;
}

std::vector<float> Read(const MaterializedTensor& s) {
  std::vector<float> out(s.length / 4);
  if (!out.empty()) std::memcpy(out.data(), s.buffer->host_data() + s.offset, s.length);
  return out;
}

TEST(MaterializerTest, ContiguousSameDtypeIsAViewIntoTheBase) {
  Fixture f({10, 4});
  Materializer m({f.memory.get(), 2});
  ShardBox box{{3, 0}, {3, 4}};
  auto r = m.Materialize({Item(f.tensor, box, DType::kF32)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].view);
  EXPECT_EQ((*r)[0].buffer, f.tensor.buffer);
  EXPECT_EQ((*r)[0].offset, 3u * 4 * 4);
  EXPECT_EQ(Read((*r)[0]), Expected(f.tensor.shape, box));
  EXPECT_EQ((*r)[0].digest, DigestBytes(f.tensor.host_data() + 48, 48));
}

TEST(MaterializerTest, ColumnSliceIsPackedAndCached) {
  Fixture f({5, 6});
  Materializer m({f.memory.get(), 2});
  ShardBox box{{0, 2}, {5, 2}};
  auto r1 = m.Materialize({Item(f.tensor, box, DType::kF32)});
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_FALSE((*r1)[0].view);
  EXPECT_TRUE((*r1)[0].buffer->ShareableFd().ok());
  EXPECT_EQ(Read((*r1)[0]), Expected(f.tensor.shape, box));
  auto r2 = m.Materialize({Item(f.tensor, box, DType::kF32)});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ((*r2)[0].buffer, (*r1)[0].buffer) << "identical requests share one copy";
  EXPECT_EQ(m.stats().hits, 1u);
}

TEST(MaterializerTest, ResultsAreSharedWithinAScopeAndNeverAcrossScopes) {
  // Issue #16 F1: two checkpoints hold a tensor with identical bytes (same
  // digest), one read by a private scope, the other public. A client maps
  // whole segments, so neither a view nor a packed segment may cross.
  Fixture secret({6, 4});
  Fixture shared({6, 4});
  ASSERT_EQ(secret.tensor.digest, shared.tensor.digest);
  Materializer m({secret.memory.get(), 2});
  const std::string kPrivate = "7{5:uid:7}";
  ShardBox rows{{2, 0}, {2, 4}};   // contiguous: a view
  ShardBox cols{{0, 1}, {6, 2}};   // strided: packed
  auto p = m.Materialize({Item(secret.tensor, rows, DType::kF32),
                          Item(secret.tensor, cols, DType::kF32)}, "", kPrivate);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[0].buffer, secret.tensor.buffer);
  auto q = m.Materialize({Item(shared.tensor, rows, DType::kF32),
                          Item(shared.tensor, cols, DType::kF32)}, "", "");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)[0].buffer, shared.tensor.buffer) << "a view into the other scope's base";
  EXPECT_NE((*q)[1].buffer, (*p)[1].buffer) << "a packed segment of the other scope";
  EXPECT_EQ(Read((*q)[1]), Read((*p)[1]));
  EXPECT_EQ(m.stats().hits, 0u);
  // Within one scope, identical requests still share one copy.
  auto p2 = m.Materialize({Item(shared.tensor, rows, DType::kF32),
                           Item(shared.tensor, cols, DType::kF32)}, "", kPrivate);
  ASSERT_TRUE(p2.ok()) << p2.status();
  EXPECT_EQ((*p2)[1].buffer, (*p)[1].buffer);
  EXPECT_EQ(m.stats().hits, 2u);
}

TEST(MaterializerTest, BatchOfMissesSharesOneSegment) {
  Fixture f({8, 8});
  Materializer m({f.memory.get(), 2});
  std::vector<MaterializeItem> items;
  for (int i = 0; i < 4; ++i) items.push_back(Item(f.tensor, ShardBox{{0, 2 * i}, {8, 2}}, DType::kBF16));
  auto r = m.Materialize(items);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*r)[i].buffer, (*r)[0].buffer);
    EXPECT_EQ((*r)[i].length, 8u * 2 * 2);
    EXPECT_EQ((*r)[i].offset % 64, 0u);
  }
  EXPECT_EQ(m.stats().packed_segments, 1u);
}

TEST(MaterializerTest, CopyBoxMatchesBruteForceOnRandomBoxes) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 300; ++iter) {
    size_t nd = 1 + rng() % 4;
    std::vector<int64_t> shape(nd);
    for (auto& d : shape) d = 1 + rng() % 5;
    Fixture f(shape);
    ShardBox box;
    for (size_t d = 0; d < nd; ++d) {
      int64_t off = rng() % shape[d];
      box.offset.push_back(off);
      box.shape.push_back(rng() % (shape[d] - off + 1));
    }
    std::vector<float> out(std::max<int64_t>(box.NumElements(), 1));
    ASSERT_TRUE(CopyBox(f.tensor.host_data(), DType::kF32, shape, box,
                        reinterpret_cast<uint8_t*>(out.data()), DType::kF32).ok());
    out.resize(box.NumElements());
    EXPECT_EQ(out, Expected(shape, box)) << "iteration " << iter;
  }
}

TEST(MaterializerTest, EvictUnusedFreesOnlyUnheldSegments) {
  Fixture f({4, 4});
  Materializer m({f.memory.get(), 1});
  uint64_t base = f.account->used();
  auto held = m.Materialize({Item(f.tensor, ShardBox{{0, 0}, {4, 2}}, DType::kF32)});
  auto unheld = m.Materialize({Item(f.tensor, ShardBox{{0, 2}, {4, 2}}, DType::kF32)});
  ASSERT_TRUE(held.ok() && unheld.ok());
  unheld->clear();
  EXPECT_GT(m.EvictUnused(), 0u);
  EXPECT_GT(f.account->used(), base) << "the held shard stays";
  held->clear();
  m.EvictUnused();
  EXPECT_EQ(f.account->used(), base);
}

TEST(MaterializerTest, SweptSegmentsAreFreedByTheDisposerNotUnderTheLock) {
  // A retired generation's packed segments are dropped by a sweep (after a
  // Release, on a gRPC thread): without a warm reserve their pages go back
  // on the disposer's thread. EvictUnused (the budget is short now) frees
  // at once.
  Fixture f({64, 64}, {.dispose_min_bytes = 1});
  Disposer& disposer = *f.memory->disposer();
  Materializer m({f.memory.get(), 1});
  const uint64_t base = f.account->used();
  MaterializeItem item;  // an FP8 scale companion: tagged with its generation
  item.name = "w_scale";
  item.out_dtype = DType::kF32;
  item.scalar = 0.5f;
  {
    auto r = m.Materialize({item}, "m#2");
    ASSERT_TRUE(r.ok()) << r.status();
  }
  ASSERT_GT(f.account->used(), base);
  m.RetireTag("m#2");
  EXPECT_EQ(disposer.disposed(), 1u) << "handed to the disposer's thread";
  disposer.Drain();
  EXPECT_EQ(f.account->used(), base);
  {
    auto r = m.Materialize({Item(f.tensor, ShardBox{{0, 32}, {64, 32}}, DType::kF32)});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_GT(m.EvictUnused(), 0u);
  EXPECT_EQ(f.account->used(), base) << "freed by the evicting call itself";
  EXPECT_EQ(disposer.disposed(), 1u);
}

TEST(MaterializerTest, AShortBudgetDropsUnusedCacheEntriesBeforeItRefuses) {
  // The cache's unused entries are in the memory manager's reclaimer chain:
  // any allocation short of budget (a load, an adapter, another fetch)
  // drops them first, and only what a holder still uses stays.
  const uint64_t kBase = 64 * 64 * 4;
  Fixture f({64, 64}, {.limit_bytes = 3 * kBase});
  Materializer m({f.memory.get(), 1});
  auto held = m.Materialize({Item(f.tensor, ShardBox{{0, 0}, {64, 64}}, DType::kBF16)});
  ASSERT_TRUE(held.ok()) << held.status();
  {
    auto unheld = m.Materialize({Item(f.tensor, ShardBox{{0, 0}, {64, 64}}, DType::kF16)});
    ASSERT_TRUE(unheld.ok()) << unheld.status();
  }
  ASSERT_EQ(m.stats().entries, 2u);
  const uint64_t used = f.account->used();  // base + two half-size casts
  ASSERT_EQ(used, 2 * kBase);
  // Needs more than is free: the unused F16 cast goes, the held one stays.
  auto seg = f.memory->Allocate(kBase + kBase / 4, {.purpose = "test"});
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(m.stats().entries, 1u);
  auto again = m.Materialize({Item(f.tensor, ShardBox{{0, 0}, {64, 64}}, DType::kBF16)});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0].buffer, (*held)[0].buffer) << "the held entry is still served";
  // More than even that frees: refused, naming what asked.
  auto refused = f.memory->Allocate(2 * kBase, {.purpose = "too much"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("too much"), std::string::npos) << refused.status();
}

TEST(MemoryAccountTest, ReclaimersRunByRankUntilTheShortfallIsCovered) {
  auto account = std::make_shared<MemoryAccount>(100);
  std::vector<std::string> calls;
  ASSERT_TRUE(account->Reserve(90, "test").ok());
  const uint64_t late = account->AddReclaimer(10, [&](uint64_t need) {
    calls.push_back("rank10:" + std::to_string(need));
    account->Return(50);
    return uint64_t{50};
  });
  const uint64_t early = account->AddReclaimer(0, [&](uint64_t need) {
    calls.push_back("rank0:" + std::to_string(need));
    account->Return(10);
    return uint64_t{10};
  });
  // 90 used + 40 asked = 30 short: rank 0 frees 10, rank 10 the other 20+.
  ASSERT_TRUE(account->Reserve(40, "test").ok());
  EXPECT_EQ(calls, (std::vector<std::string>{"rank0:30", "rank10:20"}));
  // Enough from the first: the second is not asked.
  calls.clear();
  ASSERT_TRUE(account->Reserve(25, "test").ok());  // 70 + 25 = 95: fits, no call
  EXPECT_TRUE(calls.empty());
  ASSERT_TRUE(account->Reserve(15, "test").ok());  // 95 + 15 = 110: 10 short
  EXPECT_EQ(calls, (std::vector<std::string>{"rank0:10"}));
  account->RemoveReclaimer(early);
  account->RemoveReclaimer(late);
  EXPECT_EQ(account->Reserve(200, "test").code(), absl::StatusCode::kResourceExhausted);
}

TEST(MaterializerTest, AnEmptyTensorInAnEmptySegmentIsAnEmptyView) {
  // A checkpoint whose tensors are all empty has one 0-byte segment, which
  // maps nowhere (no host_data()): still host memory, still served.
  auto memory = std::make_unique<HostMemoryManager>(HostMemoryManager::Options{});
  auto seg = Segment::Create(memory->account(), "base", 0, false);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_TRUE((*seg)->Seal().ok());
  StoredTensor t;
  t.name = "empty";
  t.dtype = DType::kF32;
  t.shape = {0, 4};
  t.buffer = SegmentPtr(std::move(*seg));
  t.digest = DigestBytes(nullptr, 0);
  Materializer m({memory.get(), 2});
  auto r = m.Materialize({Item(t, ShardBox{{0, 0}, {0, 4}}, DType::kF32),
                          Item(t, ShardBox{{0, 0}, {0, 2}}, DType::kBF16)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].view);
  EXPECT_EQ((*r)[0].length, 0u);
  EXPECT_EQ((*r)[0].digest, DigestBytes(nullptr, 0));
  EXPECT_EQ((*r)[1].length, 0u);
}

TEST(MaterializerTest, ViewCacheDoesNotKeepUnloadedBaseAlive) {
  auto f = std::make_unique<Fixture>(std::vector<int64_t>{4, 4});
  auto account = f->account;  // outlives f's memory manager
  HostMemoryManager memory({});  // the materializer's own: f goes first
  Materializer m({&memory, 1});
  {
    auto r = m.Materialize({Item(f->tensor, ShardBox{{0, 0}, {2, 4}}, DType::kF32)});
    ASSERT_TRUE(r.ok());
  }
  f.reset();
  EXPECT_EQ(account->used(), 0u);
}

}  // namespace
}  // namespace weightd

namespace weightd {
namespace {

// ΔW = a constant added to every element (enough to check plumbing; the
// LoRA math is tested with the adapter library).
class AddConstantPatch : public TensorPatch {
 public:
  explicit AddConstantPatch(float c) : c_(c) {}
  Kind kind() const override { return Kind::kAdd; }
  std::string CacheKey() const override { return absl::StrCat("add", c_); }
  std::vector<int64_t> shape() const override { return {}; }
  absl::Status Apply(const ShardBox& box, absl::Span<const int64_t>, float strength,
                     const BaseRowReader&, float* acc) const override {
    for (int64_t i = 0; i < box.NumElements(); ++i) acc[i] += strength * c_;
    return absl::OkStatus();
  }

 private:
  float c_;
};

TEST(MaterializerTest, MergedPartsConcatenateAlongDimZero) {
  Fixture a({2, 3}), b({4, 3});
  Materializer m({a.memory.get(), 2});
  MaterializeItem item;
  item.name = "qkv";
  item.out_dtype = DType::kF32;
  item.slices.push_back(PartSlice{&a.tensor, DType::kF32, {2, 3}, ShardBox{{1, 0}, {1, 3}}, {}});
  item.slices.push_back(PartSlice{&b.tensor, DType::kF32, {4, 3}, ShardBox{{2, 0}, {2, 3}}, {}});
  auto r = m.Materialize({item});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE((*r)[0].view);
  EXPECT_EQ(Read((*r)[0]), std::vector<float>({3, 4, 5, 6, 7, 8, 9, 10, 11}));
}

TEST(MaterializerTest, PatchesAccumulateInFp32AndRoundOnce) {
  Fixture f({2, 2});
  Materializer m({f.memory.get(), 1});
  MaterializeItem item = Item(f.tensor, ShardBox{{0, 0}, {2, 2}}, DType::kF32);
  item.slices[0].patches.push_back({std::make_shared<AddConstantPatch>(0.5f), 2.0f});
  item.slices[0].patches.push_back({std::make_shared<AddConstantPatch>(0.25f), 1.0f});
  auto r = m.Materialize({item});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Read((*r)[0]), std::vector<float>({1.25f, 2.25f, 3.25f, 4.25f}));
  // A different strength is a different cache entry.
  item.slices[0].patches[0].strength = 0.0f;
  auto r2 = m.Materialize({item});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(Read((*r2)[0]), std::vector<float>({0.25f, 1.25f, 2.25f, 3.25f}));
}

TEST(MaterializerTest, ZeroFilledPartAndFp8Quantization) {
  Fixture f({4});
  Materializer m({f.memory.get(), 1});
  MaterializeItem zeros;
  zeros.name = "new";
  zeros.out_dtype = DType::kBF16;
  zeros.slices.push_back(PartSlice{nullptr, DType::kF32, {3, 2}, ShardBox{{0, 0}, {3, 2}}, {}});
  MaterializeItem q = Item(f.tensor, ShardBox{{0}, {4}}, DType::kF8E4M3);
  q.fp8_scale = 3.0f / 448.0f;  // amax of 0,1,2,3 over 448
  auto amax = AbsMax(q.slices);
  ASSERT_TRUE(amax.ok());
  EXPECT_EQ(*amax, 3.0f);
  auto r = m.Materialize({zeros, q});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].length, 12u);
  for (uint64_t i = 0; i < 12; ++i) EXPECT_EQ((*r)[0].buffer->host_data()[(*r)[0].offset + i], 0);
  const uint8_t* q8 = (*r)[1].buffer->host_data() + (*r)[1].offset;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(q8[i], FloatToFp8E4M3(static_cast<float>(i) / (3.0f / 448.0f)));
  }
  EXPECT_EQ(q8[3], FloatToFp8E4M3(448.0f));
}

}  // namespace
}  // namespace weightd
