#include "server/state/published_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "server/store/checkpoint_loader.h"

namespace weightd {
namespace {

namespace fs = std::filesystem;

class PublishedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightd-published-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto opened = StateDir::Open(dir_, ::geteuid());
    ASSERT_TRUE(opened.ok()) << opened.status();
    state_dir_ = *opened;
    memory_ = std::make_unique<HostMemoryManager>(HostMemoryManager::Options{});
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A host tensor of `n` F32 values base, base + 1, ...
  std::shared_ptr<const StoredTensor> Tensor(const std::string& name, int n, float base) {
    auto seg = memory_->Allocate(static_cast<uint64_t>(n) * 4 + 1, {.purpose = "test"});
    EXPECT_TRUE(seg.ok()) << seg.status();
    for (int i = 0; i < n; ++i) {
      const float v = base + static_cast<float>(i);
      std::memcpy((*seg)->mutable_data() + 4 * i, &v, 4);
    }
    EXPECT_TRUE((*seg)->Seal().ok());
    auto t = std::make_shared<StoredTensor>();
    t->name = name;
    t->dtype = DType::kF32;
    t->shape = {n};
    t->buffer = SegmentPtr(std::move(*seg));
    t->length = static_cast<uint64_t>(n) * 4;
    t->digest = DigestBytes(t->host_data(), t->length);
    return t;
  }

  std::vector<std::string> Files(const std::string& dir) {
    std::vector<std::string> out;
    if (!fs::exists(dir)) return out;
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string dir_;
  std::shared_ptr<const StateDir> state_dir_;
  std::unique_ptr<HostMemoryManager> memory_;
};

TEST_F(PublishedStoreTest, AFileWrittenLoadsBackAsTheSameTensors) {
  const std::string path = dir_ + "/a.safetensors";
  std::vector<std::shared_ptr<const StoredTensor>> tensors = {Tensor("b", 3, 1.0f),
                                                              Tensor("a", 5, 10.0f)};
  ASSERT_TRUE(WriteSafetensorsFile(*state_dir_, "a.safetensors", tensors).ok());
  EXPECT_EQ(Files(dir_), std::vector<std::string>{"a.safetensors"});  // no temporary left
  CheckpointLoadOptions options;
  options.memory = memory_.get();
  auto loaded = LoadCheckpoint(path, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ((*loaded)->tensors().size(), 2u);
  for (const auto& t : tensors) {
    const StoredTensor* got = (*loaded)->Find(t->name);
    ASSERT_NE(got, nullptr) << t->name;
    EXPECT_EQ(got->shape, t->shape);
    EXPECT_EQ(got->digest, t->digest);
  }
  // A name twice: refused, nothing written over the file.
  EXPECT_EQ(WriteSafetensorsFile(*state_dir_, "a.safetensors", {tensors[0], tensors[0]}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Files(dir_), std::vector<std::string>{"a.safetensors"});
  // An empty file loads as no tensors.
  ASSERT_TRUE(WriteSafetensorsFile(*state_dir_, "empty.safetensors", {}).ok());
  auto empty = LoadCheckpoint(dir_ + "/empty.safetensors", options);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE((*empty)->tensors().empty());
}

TEST_F(PublishedStoreTest, NewerSavesSupersedeOlderOnesAndForgetRemovesAModelsFiles) {
  const std::string dir = dir_ + "/published";
  {
    PublishedStore store(state_dir_);
    EXPECT_NE(store.FileName("m", 3), store.FileName("n", 3));
    EXPECT_EQ(store.PathFor("m", 3), dir + "/" + store.FileName("m", 3));
    ASSERT_TRUE(store.PathOf(store.FileName("m", 3)).ok());
    for (const std::string bad : {"", "../x.safetensors", "a/b.safetensors", ".tmp-1",
                                  "x.json"}) {
      EXPECT_EQ(store.PathOf(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    }
    store.Save("m", 2, {Tensor("w", 4, 0.0f)});
    ASSERT_TRUE(store.WaitIdle(absl::Seconds(30)));
    store.Save("n", 7, {Tensor("w", 4, 1.0f)});
    store.Save("m", 3, {Tensor("w", 4, 2.0f)});
    ASSERT_TRUE(store.WaitIdle(absl::Seconds(30)));
    // m's generation 2 is superseded by 3: removed once 3 is written.
    std::vector<std::string> want = {store.FileName("m", 3), store.FileName("n", 7)};
    std::sort(want.begin(), want.end());
    EXPECT_EQ(Files(dir), want);
    EXPECT_EQ(store.stats().saved, 3u);
    store.Forget("m");
    ASSERT_TRUE(store.WaitIdle(absl::Seconds(30)));
    EXPECT_EQ(Files(dir), std::vector<std::string>{store.FileName("n", 7)});
    // A restore keeps what it restored and removes the rest.
    auto published = state_dir_->Subdir("published", /*create=*/false);
    ASSERT_TRUE(published.ok()) << published.status();
    ASSERT_TRUE(WriteSafetensorsFile(**published, "stale.safetensors", {}).ok());
    store.KeepOnly({store.FileName("n", 7)});
    EXPECT_EQ(Files(dir), std::vector<std::string>{store.FileName("n", 7)});
    // Saves still queued when the store is destroyed are written first.
    store.Save("q", 1, {Tensor("w", 1 << 16, 3.0f)});
  }
  EXPECT_EQ(Files(dir).size(), 2u);
}

}  // namespace
}  // namespace weightd
