#include "server/store/checkpoint_loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"

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
  // `bias` changes the bytes, not the header.
  std::string WriteFile(const std::string& name,
                        const std::vector<std::pair<std::string, int>>& tensors,
                        float bias = 0) {
    const std::string path = dir_ + "/" + name;
    EXPECT_TRUE(WriteSafetensorsFile(path, RampTensors(tensors, bias)).ok());
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

TEST_F(CheckpointTest, TensorsHeldElsewhereAreSharedAndTheRestRepacked) {
  // Tensor bytes depend on the name's length and the index only: "a" and
  // "bb" of ft are base's.
  auto base = LoadCheckpoint(
      WriteFile("base.safetensors", {{"a", 1000}, {"bb", 1000}, {"ccc", 1000}}), Options());
  ASSERT_TRUE(base.ok()) << base.status();
  const std::shared_ptr<const Checkpoint> held = *base;
  auto from_base = [&](const Checkpoint& c) {
    std::vector<std::optional<HeldElsewhere>> out(c.tensors().size());
    for (size_t i = 0; i < out.size(); ++i) {
      const StoredTensor& t = c.tensors()[i];
      const StoredTensor* h = held->Find(t.name);
      if (h != nullptr && h->digest == t.digest) {
        out[i] = HeldElsewhere{h->buffer, h->offset, "base"};
      }
    }
    return out;
  };
  const uint64_t used_before = account_->used();
  CheckpointLoadOptions o = Options();
  o.find_held = from_base;
  auto ft = LoadCheckpoint(
      WriteFile("ft.safetensors", {{"a", 1000}, {"bb", 1000}, {"dddd", 1000}}), o);
  ASSERT_TRUE(ft.ok()) << ft.status();
  const Checkpoint& c = **ft;
  EXPECT_EQ(c.bytes_held_elsewhere(), 8000u);
  EXPECT_EQ(c.total_bytes(), 12000u);
  EXPECT_TRUE(c.file_info().empty()) << "not laid out by file any more";
  ASSERT_EQ(c.host_segments().size(), 1u);
  EXPECT_LT(c.host_segments()[0]->size(), 8192u) << "only the rest is stored";
  EXPECT_EQ(c.Find("a")->buffer, held->Find("a")->buffer);
  EXPECT_EQ(c.Find("a")->offset, held->Find("a")->offset);
  EXPECT_EQ(c.Find("bb")->buffer, held->Find("bb")->buffer);
  const StoredTensor* d = c.Find("dddd");
  EXPECT_EQ(d->buffer, c.host_segments()[0]);
  EXPECT_TRUE(c.host_segments()[0]->sealed());
  EXPECT_EQ(DigestBytes(d->host_data(), d->length), d->digest);
  float v;
  std::memcpy(&v, d->host_data() + 4 * 7, 4);
  EXPECT_EQ(v, 4007.0f);
  // What was read is freed: the rest's segment and the metadata stay.
  EXPECT_LT(account_->used() - used_before, 8192u + 3 * kTensorMetadataBytes + 4096u);

  // Shared bytes of at most 1/8: kept as read, laid out by file.
  CheckpointLoadOptions few = Options();
  few.find_held = [&](const Checkpoint& c2) {
    std::vector<std::optional<HeldElsewhere>> out(c2.tensors().size());
    const StoredTensor* a = c2.Find("a");
    for (size_t i = 0; i < out.size(); ++i) {
      if (&c2.tensors()[i] == a) {
        out[i] = HeldElsewhere{held->Find("a")->buffer, held->Find("a")->offset, "base"};
      }
    }
    return out;
  };
  auto big = LoadCheckpoint(WriteFile("big.safetensors", {{"a", 1000}, {"zzzzz", 7000}}), few);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ((*big)->bytes_held_elsewhere(), 0u);
  EXPECT_EQ((*big)->file_info().size(), 1u);
  EXPECT_EQ((*big)->Find("a")->buffer, (*big)->host_segments()[0]);

  // A finder that answers for other tensors is a bug, said so.
  CheckpointLoadOptions wrong = Options();
  wrong.find_held = [](const Checkpoint&) { return std::vector<std::optional<HeldElsewhere>>{}; };
  auto bad = LoadCheckpoint(dir_ + "/ft.safetensors", wrong);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
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


// Peers in memory, answering as a daemon's FindCheckpoint and
// ReadCheckpoint do (DescribeHolding, FindHeldBytes), with faults: a peer
// that fails every range, one that flips a bit of every range, one that
// reports a wrong digest for its first tensor, and liars that answer the
// question's samples truthfully and send other bytes, with those bytes'
// digests, everywhere else (kLieOutsideSamples) or in one tensor no sample
// touches (kLieInOneTensor).
class MemoryPeers : public CheckpointPeers {
 public:
  struct Peer {
    std::string address;
    std::shared_ptr<const Checkpoint> held;
    enum Fault { kNone, kFail, kFlip, kWrongDigest, kLieOutsideSamples, kLieInOneTensor } fault =
        kNone;
  };
  void Add(Peer p) { peers_.push_back(std::move(p)); }
  int reads(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return reads_[address];
  }
  // The peers' answers were given for this many tensors per file.
  std::vector<uint64_t> asked_shape() {
    absl::MutexLock lock(&mu_);
    return asked_shape_;
  }

  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override {
    {
      absl::MutexLock lock(&mu_);
      asked_shape_ = query.tensors_per_file;
    }
    std::vector<PeerHolding> out;
    for (const Peer& p : peers_) {
      if (p.held->content_key() != query.key) continue;
      auto h = DescribeHolding(*p.held, query.samples);
      EXPECT_TRUE(h.ok()) << h.status();
      if (!h.ok()) continue;
      h->peer = p.address;
      if (p.fault == Peer::kWrongDigest) h->tensor_digests[0][0].bytes[0] ^= 1;
      if (p.fault == Peer::kLieOutsideSamples || p.fault == Peer::kLieInOneTensor) {
        Lie(p, query.samples, *h);
      }
      out.push_back(std::move(*h));
    }
    return out;
  }
  absl::Status ReadRange(const std::string& address, const Digest& key, const Digest& copy,
                         const CheckpointRange& range, uint8_t* dest,
                         const char** transport) override {
    if (transport != nullptr) *transport = "memory";
    {
      absl::MutexLock lock(&mu_);
      reads_[address]++;
    }
    for (const Peer& p : peers_) {
      if (p.address != address) continue;
      if (p.fault == Peer::kFail) return absl::UnavailableError("connection reset");
      EXPECT_EQ(copy, p.held->copy_id());
      auto held = FindHeldBytes(*p.held, range, kMaxPeerRangeBytes);
      if (!held.ok()) return held.status();
      std::memcpy(dest, held->buffer->host_data() + held->offset, range.length);
      if (p.fault == Peer::kFlip && range.length > 0) dest[range.length / 2] ^= 0x10;
      absl::MutexLock lock(&mu_);
      auto lie = lies_.find(address);
      if (lie != lies_.end()) {
        std::memcpy(dest, lie->second[range.file].data() + range.offset, range.length);
      }
      return absl::OkStatus();
    }
    return absl::NotFoundError(address);
  }
  // Bytes a liar sent that are not storage's.
  uint64_t lied_bytes(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return lied_[address];
  }

 private:
  // The liar's bytes (per file: storage's with bytes flipped outside the
  // samples, or in one tensor that no sample touches) and its answer's
  // digests of them.
  void Lie(const Peer& p, const std::vector<CheckpointRange>& samples, PeerHolding& h) {
    const Checkpoint& c = *p.held;
    std::vector<std::string> files;
    uint64_t lied = 0;
    for (size_t f = 0; f < c.file_info().size(); ++f) {
      const CheckpointFileInfo& fi = c.file_info()[f];
      const uint8_t* data = c.host_segments()[fi.segment]->host_data() + fi.segment_offset;
      std::string bytes(reinterpret_cast<const char*>(data), fi.data_length);
      std::vector<char> sampled(fi.data_length, 0);
      for (const CheckpointRange& r : samples) {
        if (r.file == f) std::fill_n(sampled.begin() + r.offset, r.length, 1);
      }
      // This file's tensors in data-offset order (the answer's order).
      std::vector<const StoredTensor*> order;
      for (const StoredTensor& t : c.tensors()) {
        if (t.file == fi.path) order.push_back(&t);
      }
      std::sort(order.begin(), order.end(), [](const StoredTensor* a, const StoredTensor* b) {
        return std::tie(a->offset, a->name) < std::tie(b->offset, b->name);
      });
      bool done = false;  // kLieInOneTensor: one tensor lied about
      for (size_t k = 0; k < order.size(); ++k) {
        const uint64_t begin = order[k]->offset - fi.segment_offset, len = order[k]->length;
        const bool touched = std::any_of(sampled.begin() + begin, sampled.begin() + begin + len,
                                         [](char x) { return x != 0; });
        for (uint64_t i = begin; i < begin + len; ++i) {
          const bool lie = p.fault == Peer::kLieOutsideSamples ? !sampled[i]
                                                                : !touched && !done && len > 0;
          if (lie) {
            bytes[i] ^= 0x5a;
            ++lied;
          }
        }
        done = done || (p.fault == Peer::kLieInOneTensor && !touched && len > 0);
        h.tensor_digests[f][k] = DigestBytes(bytes.data() + begin, len);
      }
      files.push_back(std::move(bytes));
    }
    absl::MutexLock lock(&mu_);
    lies_[p.address] = std::move(files);
    lied_[p.address] = lied;
  }

  std::vector<Peer> peers_;
  absl::Mutex mu_;
  std::map<std::string, int> reads_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<std::string>> lies_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> lied_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> asked_shape_ ABSL_GUARDED_BY(mu_);
};

class PeerLoadTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    path_ = WriteFile("m.safetensors", Tensors());
    auto held = LoadCheckpoint(path_, Options());
    ASSERT_TRUE(held.ok()) << held.status();
    held_ = *held;
  }
  // 60 tensors of 40..236 bytes, an empty one and a large one: with ranges
  // of 64 bytes, some 80 groups, so that every holder gets some.
  static std::vector<std::pair<std::string, int>> Tensors() {
    std::vector<std::pair<std::string, int>> out;
    for (int i = 0; i < 60; ++i) out.push_back({"t" + std::to_string(i), 10 + (i * 7) % 50});
    out.push_back({"empty", 0});
    out.push_back({"large", 300});
    return out;
  }
  CheckpointLoadOptions PeerOptions(LoadSource source) {
    CheckpointLoadOptions o = Options();
    o.read_chunk_bytes = 64;
    o.peers = &peers_;
    o.source = source;
    o.report = &report_;
    o.peer_samples_per_file = 2;
    o.peer_sample_bytes = 16;
    return o;
  }
  // The load's tensors are the holder's, byte for byte and digest for digest.
  void ExpectSameAsHeld(const Checkpoint& got) {
    ASSERT_EQ(got.tensors().size(), held_->tensors().size());
    for (const StoredTensor& t : held_->tensors()) {
      const StoredTensor* g = got.Find(t.name);
      ASSERT_NE(g, nullptr) << t.name;
      EXPECT_EQ(g->digest, t.digest) << t.name;
      EXPECT_EQ(g->digest, DigestBytes(g->host_data(), g->length)) << t.name;
      EXPECT_EQ(std::memcmp(g->host_data(), t.host_data(), t.length), 0) << t.name;
    }
    EXPECT_EQ(got.content_key(), held_->content_key());
  }
  std::string path_;
  std::shared_ptr<const Checkpoint> held_;
  MemoryPeers peers_;
  LoadSourceReport report_;
};

TEST_F(PeerLoadTest, TakesTheBytesFromAHolderAndSamplesStorage) {
  peers_.Add({"p1", held_});
  std::vector<LoadProgressInfo> progress;
  auto o = PeerOptions(LoadSource::kAuto);
  o.progress = [&](const LoadProgressInfo& p) { progress.push_back(p); };
  auto got = LoadCheckpoint(path_, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameAsHeld(**got);
  EXPECT_EQ(report_.peer_bytes, held_->total_bytes());
  EXPECT_EQ(report_.by_peer["p1"], held_->total_bytes());
  EXPECT_EQ(report_.peer_bytes_discarded, 0u);
  // The question's samples, and as many places of what p1 sent compared
  // with storage's bytes.
  EXPECT_EQ(report_.storage_bytes, 2u * 16 + 2u * 16);
  // The peers were told the shape of a true answer: the file's tensors.
  EXPECT_EQ(peers_.asked_shape(), std::vector<uint64_t>{held_->tensors().size()});
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().bytes_from_peers, held_->total_bytes());
  EXPECT_EQ(progress.back().bytes_from_storage, 0u);
  EXPECT_EQ(progress.back().peers, std::vector<std::string>{"p1"});
}

TEST_F(PeerLoadTest, SpreadsRangesOverHoldersAndDropsOnesThatFailOrLie) {
  peers_.Add({"good", held_});
  peers_.Add({"flips", held_, MemoryPeers::Peer::kFlip});
  peers_.Add({"fails", held_, MemoryPeers::Peer::kFail});
  auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameAsHeld(**got);
  // Every holder was asked for some of the ranges (rendezvous over their
  // groups), the bad ones until dropped (flips: every range of a group in
  // flight).
  EXPECT_GT(peers_.reads("good"), 0);
  EXPECT_GE(peers_.reads("flips"), 1);
  EXPECT_GE(peers_.reads("fails"), 1);
  EXPECT_EQ(report_.peer_failures["flips"], 1u);
  EXPECT_EQ(report_.peer_failures["fails"], 1u);
  EXPECT_EQ(report_.peer_failures.count("good"), 0u);
  // Nothing but samples and checks from storage.
  EXPECT_LT(report_.storage_bytes, held_->total_bytes() / 2);
  // Only what the load kept counts as the peers' bytes: what "flips" sent
  // was thrown away.
  EXPECT_EQ(report_.peer_bytes, held_->total_bytes());
  EXPECT_EQ(report_.by_peer.count("flips"), 0u);
  EXPECT_GT(report_.peer_bytes_discarded, 0u);
}

TEST_F(PeerLoadTest, APeerLyingWhereTheQuestionsSamplesAreNotIsCaughtByStorage) {
  // It answers the samples it was shown truthfully and reports the digests
  // of the other bytes it sends: only storage's bytes at places it was not
  // told can tell. By default (8 pieces per file, here 2 of 16 bytes, over
  // bytes it lies about nearly everywhere) they do.
  peers_.Add({"liar", held_, MemoryPeers::Peer::kLieOutsideSamples});
  auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kAuto));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_GT(peers_.lied_bytes("liar"), held_->total_bytes() / 2);
  ExpectSameAsHeld(**got);
  EXPECT_EQ(report_.peer_failures["liar"], 1u);
  // Everything it sent was thrown away, and counted so.
  EXPECT_EQ(report_.peer_bytes, 0u);
  EXPECT_GE(report_.peer_bytes_discarded, peers_.lied_bytes("liar"));
  // --source peers: no honest holder, so the load fails and keeps nothing.
  got = absl::CancelledError("the first load's checkpoint freed");
  const uint64_t before = memory_->stats().used_bytes;
  got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(memory_->stats().used_bytes, before);
}

TEST_F(PeerLoadTest, PeerVerifyAllCatchesALieInOneTensorNoSampleTouches) {
  peers_.Add({"liar", held_, MemoryPeers::Peer::kLieInOneTensor});
  auto o = PeerOptions(LoadSource::kAuto);
  o.peer_verify = PeerVerify{1};
  auto got = LoadCheckpoint(path_, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_GT(peers_.lied_bytes("liar"), 0u);
  ExpectSameAsHeld(**got);
  EXPECT_EQ(report_.peer_failures["liar"], 1u);
  // Every byte it sent was compared with storage's.
  EXPECT_GE(report_.storage_bytes, held_->total_bytes());
  EXPECT_EQ(report_.peer_bytes, 0u);
  // With an honest holder beside it, the load's bytes are storage's too,
  // and none of the liar's count as kept.
  report_ = {};
  peers_.Add({"honest", held_});
  got = LoadCheckpoint(path_, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameAsHeld(**got);
  EXPECT_EQ(report_.by_peer.count("liar"), 0u);
}

TEST(PeerVerifyTest, ParsesSamplesAllAndPercentages) {
  EXPECT_EQ(ParsePeerVerify("samples")->fraction, 0);
  EXPECT_EQ(ParsePeerVerify("all")->fraction, 1);
  EXPECT_DOUBLE_EQ(ParsePeerVerify("12.5%")->fraction, 0.125);
  EXPECT_EQ(ParsePeerVerify("all")->ToString(), "all");
  EXPECT_EQ(ParsePeerVerify("10%")->ToString(), "10%");
  for (const char* bad : {"some", "0%", "101%", "-5%", "10"}) {
    EXPECT_EQ(ParsePeerVerify(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(PeerLoadTest, WhatNoHolderSuppliesComesFromStorageUnlessPeersOnly) {
  peers_.Add({"flips", held_, MemoryPeers::Peer::kFlip});
  {
    auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kAuto));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameAsHeld(**got);
    EXPECT_EQ(report_.peer_failures["flips"], 1u);
    EXPECT_GE(report_.storage_bytes, held_->total_bytes());
  }
  // Peers only: the load fails and leaves nothing allocated.
  const uint64_t before = memory_->stats().used_bytes;
  auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_EQ(memory_->stats().used_bytes, before);
}

TEST_F(PeerLoadTest, OtherBytesUnderTheSameHeaderAreNotUsed) {
  fs::create_directory(dir_ + "/other");
  const std::string other = WriteFile("other/m.safetensors", Tensors(), 0.5f);
  auto theirs = LoadCheckpoint(other, Options());
  ASSERT_TRUE(theirs.ok());
  ASSERT_EQ((*theirs)->content_key(), held_->content_key());  // names, sizes, headers
  peers_.Add({"other", *theirs});
  auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kAuto));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameAsHeld(**got);
  EXPECT_EQ(peers_.reads("other"), 0);
  EXPECT_EQ(report_.peer_bytes, 0u);
  got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
}

TEST_F(PeerLoadTest, StorageDisagreeingWithTheHoldersDigestsWins) {
  // The holder's bytes are right but it reports another digest for the
  // first tensor: its range is fetched again from storage, which disagrees
  // with that digest too, so everything is read from storage.
  peers_.Add({"liar", held_, MemoryPeers::Peer::kWrongDigest});
  auto got = LoadCheckpoint(path_, PeerOptions(LoadSource::kAuto));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameAsHeld(**got);
  EXPECT_GE(report_.storage_bytes, held_->total_bytes());
  got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(got.status().code() == absl::StatusCode::kUnavailable ||
              got.status().code() == absl::StatusCode::kDataLoss)
      << got.status();
}

TEST_F(PeerLoadTest, PeersOnlyNeedsPeersAndAHolder) {
  auto o = PeerOptions(LoadSource::kPeers);
  o.peers = nullptr;
  auto got = LoadCheckpoint(path_, o);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  got = LoadCheckpoint(path_, PeerOptions(LoadSource::kPeers));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_NE(got.status().message().find("no peer holds the files"), std::string::npos);
  // Storage: the peers are not asked.
  peers_.Add({"p1", held_});
  report_ = {};
  got = LoadCheckpoint(path_, PeerOptions(LoadSource::kStorage));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(peers_.reads("p1"), 0);
  EXPECT_EQ(report_.storage_bytes, held_->total_bytes());
}

TEST_F(PeerLoadTest, HoldersRefuseRangesOutsideTheirFiles) {
  const uint64_t len = held_->file_info()[0].data_length;
  EXPECT_TRUE(FindHeldBytes(*held_, {0, 0, len}, kMaxPeerRangeBytes).ok());
  for (CheckpointRange r : {CheckpointRange{1, 0, 1}, CheckpointRange{0, len, 1},
                            CheckpointRange{0, 1, ~uint64_t{0}}, CheckpointRange{0, ~uint64_t{0}, 2}}) {
    EXPECT_EQ(FindHeldBytes(*held_, r, kMaxPeerRangeBytes).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(DescribeHolding(*held_, {{0, 0, (1 << 20) + 1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightd
