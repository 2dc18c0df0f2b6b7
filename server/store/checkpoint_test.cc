#include "server/store/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/safetensors.h"

namespace weightd {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightd-ckpt-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    memory_ = std::make_unique<HostMemoryManager>(HostMemoryManager::Options{});
    account_ = memory_->account();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a file of F32 tensors [n] each filled with `base + i`.
  std::string WriteFile(const std::string& name,
                        const std::vector<std::pair<std::string, int>>& tensors) {
    std::vector<SafetensorsWriteEntry> entries;
    std::string data;
    for (const auto& [tname, n] : tensors) {
      entries.push_back({tname, DType::kF32, {n}, static_cast<uint64_t>(n) * 4});
      for (int i = 0; i < n; ++i) {
        float v = static_cast<float>(tname.size() * 1000 + i);
        data.append(reinterpret_cast<const char*>(&v), 4);
      }
    }
    std::string path = dir_ + "/" + name;
    std::string blob = BuildSafetensorsHeader(entries) + data;
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    EXPECT_TRUE(WriteFull(fd.get(), blob.data(), blob.size()).ok());
    return path;
  }

  CheckpointLoadOptions Options() {
    CheckpointLoadOptions o;
    o.memory = memory_.get();
    o.read_chunk_bytes = 8;  // exercise chunking on tiny files
    return o;
  }

  std::string dir_;
  std::unique_ptr<HostMemoryManager> memory_;
  std::shared_ptr<MemoryAccount> account_;
};

TEST_F(CheckpointTest, LoadsSingleFileIntoSealedSegment) {
  std::string path = WriteFile("m.safetensors", {{"a", 3}, {"bb", 5}});
  auto ckpt = LoadCheckpoint(path, Options());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ((*ckpt)->tensors().size(), 2u);
  const StoredTensor* bb = (*ckpt)->Find("bb");
  ASSERT_NE(bb, nullptr);
  EXPECT_EQ(bb->shape, std::vector<int64_t>({5}));
  ASSERT_EQ((*ckpt)->host_segments().size(), 1u);
  const SegmentPtr& seg = (*ckpt)->host_segments()[0];
  EXPECT_EQ(bb->buffer, seg);
  EXPECT_TRUE(seg->sealed());
  float v;
  std::memcpy(&v, bb->host_data() + 8, 4);
  EXPECT_EQ(v, 2002.0f);
  EXPECT_EQ(bb->digest, DigestBytes(bb->host_data(), bb->length));
  // The seal forbids writes through any new mapping.
  EXPECT_FALSE(MappedRegion::Map(seg->fd(), seg->size(),
                                 MappedRegion::Mode::kReadWrite).ok());
  EXPECT_GT(account_->used(), 0u);
  ckpt->reset();
  EXPECT_EQ(account_->used(), 0u);
}

TEST_F(CheckpointTest, DirectoryOfFilesAndDuplicateAcrossFiles) {
  WriteFile("b.safetensors", {{"x", 2}});
  WriteFile("a.safetensors", {{"y", 2}});
  auto ckpt = LoadCheckpoint(dir_, Options());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->files().front(), dir_ + "/a.safetensors");
  EXPECT_NE((*ckpt)->Find("x"), nullptr);
  EXPECT_NE((*ckpt)->Find("y"), nullptr);

  WriteFile("c.safetensors", {{"x", 4}});
  auto dup = LoadCheckpoint(dir_, Options());
  ASSERT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("\"x\" appears in both"), std::string::npos)
      << dup.status();
  ckpt->reset();
  EXPECT_EQ(account_->used(), 0u) << "a failed load must free what it allocated";
}

TEST_F(CheckpointTest, IndexMustMatchFiles) {
  WriteFile("p1.safetensors", {{"a", 2}});
  WriteFile("p2.safetensors", {{"b", 2}});
  auto write_index = [&](const std::string& json) {
    std::string p = dir_ + "/model.safetensors.index.json";
    UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    ASSERT_TRUE(WriteFull(fd.get(), json.data(), json.size()).ok());
  };
  write_index(R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}})");
  auto ok = LoadCheckpoint(dir_, Options());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->files().size(), 2u);

  write_index(R"({"weight_map": {"a": "p2.safetensors", "b": "p1.safetensors"}})");
  EXPECT_EQ(LoadCheckpoint(dir_, Options()).status().code(), absl::StatusCode::kInvalidArgument);

  write_index(R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors", "c": "p2.safetensors"}})");
  auto missing = LoadCheckpoint(dir_, Options());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("\"c\""), std::string::npos) << missing.status();
}

TEST_F(CheckpointTest, BudgetExceededIsResourceExhaustedAndFreesAll) {
  std::string path = WriteFile("m.safetensors", {{"a", 4096}});
  CheckpointLoadOptions o = Options();
  HostMemoryManager small({.limit_bytes = 1024});
  o.memory = &small;
  auto r = LoadCheckpoint(path, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(small.stats().used_bytes, 0u);
}

TEST_F(CheckpointTest, TruncatedFileIsInvalidArgument) {
  std::string path = WriteFile("m.safetensors", {{"a", 16}});
  ASSERT_EQ(::truncate(path.c_str(), fs::file_size(path) - 4), 0);
  auto r = LoadCheckpoint(path, Options());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
}

// Per-tensor bookkeeping counts against the budget: a file of many tiny
// tensors is refused when their metadata does not fit, before any data is
// read, and the charge lives exactly as long as the checkpoint.
TEST_F(CheckpointTest, TensorMetadataIsChargedToTheBudget) {
  std::vector<std::pair<std::string, int>> many;
  for (int i = 0; i < 2000; ++i) many.push_back({"layer." + std::to_string(i) + ".w", 1});
  std::string path = WriteFile("many.safetensors", many);
  uint64_t metadata = 0;
  for (const auto& [name, n] : many) metadata += TensorMetadataBytes(name, 1);
  EXPECT_GE(metadata, 2000u * kTensorMetadataBytes);

  auto o = Options();
  auto loaded = LoadCheckpoint(path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->metadata_bytes(), metadata);
  EXPECT_EQ(account_->used(), metadata + 8192) << "the data (8000 bytes, in pages) + metadata";
  loaded->reset();
  EXPECT_EQ(account_->used(), 0u);

  // A budget the data alone fits in many times over, but not the metadata.
  HostMemoryManager small({.limit_bytes = metadata / 2});
  o.memory = &small;
  auto refused = LoadCheckpoint(path, o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("metadata of 2000 tensors"), std::string::npos)
      << refused.status();
  EXPECT_EQ(small.stats().used_bytes, 0u);
}

// A hand-over: the same files' segments from a predecessor are adopted (the
// same memory, no read) when they check out; a wrong digest, another
// layout or an unsealed memfd is refused and the files are read instead.
TEST_F(CheckpointTest, DonatedSegmentsAreAdoptedOnlyWhenTheyCheckOut) {
  const std::string path = WriteFile("a.safetensors", {{"w", 3000}, {"bias", 10}, {"c", 7}});
  ResidentCheckpoints resident;
  std::unique_ptr<MemoryCharge> charge;
  CheckpointLoadOptions o = Options();
  o.resident = &resident;
  o.shared_charge = &charge;
  auto a = LoadCheckpoint(path, o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ((*a)->host_segments().size(), 1u);
  auto snapshot = resident.Snapshot();
  ASSERT_EQ(snapshot.size(), 1u);
  auto inode = [](int fd) {
    struct stat st;
    EXPECT_EQ(::fstat(fd, &st), 0);
    return st.st_ino;
  };
  auto donation = [&](uint64_t target) {
    DonatedCheckpoint d;
    d.files_key = snapshot[0].first;
    d.segment_target_bytes = target;
    for (const SegmentPtr& seg : (*a)->host_segments()) {
      d.segment_fds.emplace_back(::fcntl(seg->fd(), F_DUPFD_CLOEXEC, 0));
      d.segment_pages.push_back(seg->pages());
    }
    for (const StoredTensor& t : (*a)->tensors()) {
      d.digests[t.name] = t.digest;
      d.places[t.name] = {0, t.offset, t.length};  // one segment
    }
    return d;
  };
  auto same_tensors = [&](const Checkpoint& b) {
    ASSERT_EQ(b.tensors().size(), (*a)->tensors().size());
    for (size_t i = 0; i < b.tensors().size(); ++i) {
      const StoredTensor& x = (*a)->tensors()[i];
      const StoredTensor& y = b.tensors()[i];
      EXPECT_EQ(x.name, y.name);
      EXPECT_EQ(x.digest, y.digest) << x.name;
      ASSERT_EQ(x.length, y.length);
      EXPECT_EQ(std::memcmp(x.host_data(), y.host_data(), x.length), 0) << x.name;
    }
  };
  const ino_t original = inode((*a)->host_segments()[0]->fd());
  // Loads `file` with `d` donated: the checkpoint, and what became of `d`.
  struct Outcome {
    std::shared_ptr<const Checkpoint> loaded;
    uint64_t adopted = 0, refused = 0;
    size_t unused = 0;
  };
  auto load_with = [&](DonatedCheckpoint d, AdoptVerify verify, const std::string& file) {
    DonatedCheckpoints donated(verify);
    donated.Add(std::move(d));
    CheckpointLoadOptions o2 = Options();
    o2.donated = &donated;
    auto b = LoadCheckpoint(file, o2);
    EXPECT_TRUE(b.ok()) << b.status();
    return Outcome{b.ok() ? *b : nullptr, donated.adopted(), donated.refused(),
                   donated.DropUnused()};
  };
  // Refused: the files are read into new memory, the same bytes.
  auto expect_read_instead = [&](DonatedCheckpoint d, AdoptVerify verify) {
    Outcome r = load_with(std::move(d), verify, path);
    ASSERT_NE(r.loaded, nullptr);
    EXPECT_EQ(r.refused, 1u);
    EXPECT_EQ(r.adopted, 0u);
    EXPECT_NE(inode(r.loaded->host_segments()[0]->fd()), original) << "read into new memory";
    same_tensors(*r.loaded);
  };

  for (AdoptVerify verify : {AdoptVerify::kFull, AdoptVerify::kSample, AdoptVerify::kNone}) {
    Outcome r = load_with(donation(o.segment_target_bytes), verify, path);
    ASSERT_NE(r.loaded, nullptr);
    EXPECT_EQ(r.adopted, 1u) << AdoptVerifyName(verify);
    EXPECT_EQ(r.refused, 0u);
    EXPECT_EQ(inode(r.loaded->host_segments()[0]->fd()), original) << "the very same memory";
    same_tensors(*r.loaded);
    EXPECT_EQ(r.unused, 0u) << "taken by the load";
  }

  // A digest that does not match the bytes.
  DonatedCheckpoint wrong_digest = donation(o.segment_target_bytes);
  wrong_digest.digests["bias"].bytes[0] ^= 1;
  expect_read_instead(std::move(wrong_digest), AdoptVerify::kFull);
  // A tensor the predecessor had elsewhere (another layout).
  DonatedCheckpoint elsewhere = donation(o.segment_target_bytes);
  elsewhere.places["c"].offset += 4;
  expect_read_instead(std::move(elsewhere), AdoptVerify::kNone);
  // Laid out with another --checkpoint-segment-bytes.
  expect_read_instead(donation(o.segment_target_bytes * 2), AdoptVerify::kNone);
  // A memfd anyone may still write, whatever it holds.
  {
    DonatedCheckpoint d = donation(o.segment_target_bytes);
    const uint64_t size = (*a)->host_segments()[0]->size();
    UniqueFd open_fd(::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_TRUE(open_fd.valid());
    ASSERT_EQ(::ftruncate(open_fd.get(), static_cast<off_t>(size)), 0);
    ASSERT_EQ(::pwrite(open_fd.get(), (*a)->host_segments()[0]->data(), size, 0),
              static_cast<ssize_t>(size));
    d.segment_fds[0] = std::move(open_fd);
    expect_read_instead(std::move(d), AdoptVerify::kNone);
  }
  // Files other than the donation's: it stays unused.
  const std::string other = WriteFile("b.safetensors", {{"w", 3000}, {"bias", 10}, {"c", 7}});
  Outcome r = load_with(donation(o.segment_target_bytes), AdoptVerify::kNone, other);
  ASSERT_NE(r.loaded, nullptr);
  EXPECT_EQ(r.adopted + r.refused, 0u);
  EXPECT_EQ(r.unused, 1u);
}

}  // namespace
}  // namespace weightd
