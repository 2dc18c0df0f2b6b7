// CheckpointLoader through the file seam: faults injected by a
// FileOpenerWrapper that overrides the one call it breaks (a short or torn
// read, a file that changes while it is read, a slow read, an I/O error),
// each failing the load with its precise code and a message that names
// the phase and the file, and leaving nothing allocated or charged.
#include "server/store/checkpoint_loader.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/digest.h"
#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"

namespace weightd {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunk = 64;  // read_chunk_bytes: many chunks per small file

// Forwards everything; data reads (at or past the file's data section)
// first pass through OnDataRead, which may fail them or act on the file.
class DataReadHook : public FileOpenerWrapper {
 public:
  explicit DataReadHook(uint64_t data_offset)
      : FileOpenerWrapper(&files_), data_offset_(data_offset) {}

  absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                      void* dest) const override {
    if (offset >= data_offset_ && !absl::EndsWith(file.path, ".json")) {
      const int n = data_reads_.fetch_add(1);
      if (absl::Status s = OnDataRead(file, offset, length, dest, n); !s.ok()) return s;
    }
    return FileOpenerWrapper::ReadAt(file, offset, length, dest);
  }
  int data_reads() const { return data_reads_.load(); }

 protected:
  // `n`: how many data reads came before this one.
  virtual absl::Status OnDataRead(const OpenedFile& file, uint64_t offset, uint64_t length,
                                  void* dest, int n) const = 0;
  const uint64_t data_offset_;

 private:
  const UnconfinedFileOpener files_;
  mutable std::atomic<int> data_reads_{0};
};

class CheckpointLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightd-loader-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    memory_ = std::make_unique<HostMemoryManager>(HostMemoryManager::Options{});
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file of F32 tensors [n] filled with i + name length * 1000.
  std::string WriteFile(const std::string& name,
                        const std::vector<std::pair<std::string, int>>& tensors) {
    const std::string path = dir_ + "/" + name;
    EXPECT_TRUE(WriteSafetensorsFile(path, RampTensors(tensors)).ok());
    return path;
  }
  // Five tensors, 2,600 bytes of data: some 40 chunks.
  std::string WriteModel() {
    return WriteFile("m.safetensors", {{"a", 100}, {"bb", 200}, {"ccc", 50}, {"d", 0}, {"e", 300}});
  }
  static uint64_t DataOffset(const std::string& path) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    uint64_t n = 0;
    EXPECT_TRUE(PreadFull(fd.get(), &n, 8, 0).ok());
    return 8 + n;
  }
  CheckpointLoadOptions Options(const FileOpener* files) {
    CheckpointLoadOptions o;
    o.memory = memory_.get();
    o.read_chunk_bytes = kChunk;
    o.read_threads = 2;
    o.files = files;
    return o;
  }
  uint64_t used() const { return memory_->stats().used_bytes; }
  // Every tensor holds the file's bytes and their digest.
  static void ExpectFileBytes(const Checkpoint& c, const std::string& path) {
    std::string file;
    {
      UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      auto read = ReadFdToString(fd.get(), path, 1 << 20);
      ASSERT_TRUE(read.ok()) << read.status();
      file = std::move(*read);
    }
    const uint64_t data = DataOffset(path);
    for (const StoredTensor& t : c.tensors()) {
      const uint64_t at = t.offset - c.file_info()[0].segment_offset;
      EXPECT_EQ(std::memcmp(t.host_data(), file.data() + data + at, t.length), 0) << t.name;
      EXPECT_EQ(t.digest, DigestBytes(t.host_data(), t.length)) << t.name;
    }
  }

  std::string dir_;
  std::unique_ptr<HostMemoryManager> memory_;
};

// Counts what goes through the seam.
class CountingFiles final : public FileOpenerWrapper {
 public:
  CountingFiles() : FileOpenerWrapper(&files_) {}
  absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                      void* dest) const override {
    absl::MutexLock lock(&mu_);
    read_bytes_ += length;
    return FileOpenerWrapper::ReadAt(file, offset, length, dest);
  }
  absl::StatusOr<struct stat> Stat(const OpenedFile& file) const override {
    absl::MutexLock lock(&mu_);
    ++stats_;
    return FileOpenerWrapper::Stat(file);
  }
  uint64_t read_bytes() const {
    absl::MutexLock lock(&mu_);
    return read_bytes_;
  }
  int stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  const UnconfinedFileOpener files_;
  mutable absl::Mutex mu_;
  mutable uint64_t read_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int stats_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_F(CheckpointLoaderTest, EveryReadAndTheRecheckGoThroughTheSeam) {
  const std::string path = WriteModel();
  CountingFiles files;
  auto loaded = LoadCheckpoint(path, Options(&files));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectFileBytes(**loaded, path);
  // The header (prefix and JSON) and every data byte, read once each.
  EXPECT_EQ(files.read_bytes(), fs::file_size(path));
  EXPECT_EQ(files.stats(), 1) << "the recheck of the one file";
}

TEST_F(CheckpointLoaderTest, ShortReadIsDataLossNamingPhaseAndFile) {
  const std::string path = WriteModel();
  // The third chunk comes back half full, as pread() gives it when the
  // file ends early.
  class ShortRead final : public DataReadHook {
   public:
    using DataReadHook::DataReadHook;
    absl::Status OnDataRead(const OpenedFile& file, uint64_t offset, uint64_t length,
                            void* dest, int) const override {
      if (offset != data_offset_ + 2 * kChunk) return absl::OkStatus();
      absl::Status half = target()->ReadAt(file, offset, length / 2, dest);
      if (!half.ok()) return half;
      return absl::DataLossError(absl::StrCat("file shrank: expected ", length,
                                              " bytes at offset ", offset, ", got ", length / 2));
    }
  } files(DataOffset(path));
  auto loaded = LoadCheckpoint(path, Options(&files));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("read from storage: reading ", path, ": file shrank: expected 64 bytes "
                         "at offset ", DataOffset(path) + 128, ", got 32"));
  EXPECT_EQ(used(), 0u) << "a failed load frees its segments and its metadata charge";
}

TEST_F(CheckpointLoaderTest, FileTruncatedWhileReadIsDataLossAndFreesAll) {
  const std::string path = WriteModel();
  // A torn file: cut in half under the load as it starts reading data.
  class Truncate final : public DataReadHook {
   public:
    using DataReadHook::DataReadHook;
    absl::Status OnDataRead(const OpenedFile& file, uint64_t, uint64_t, void*,
                            int n) const override {
      if (n == 0 && ::truncate(file.path.c_str(), file.st.st_size / 2) != 0) {
        return ErrnoStatus(errno, "truncate");
      }
      return absl::OkStatus();
    }
  } files(DataOffset(path));
  auto loaded = LoadCheckpoint(path, Options(&files));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_TRUE(absl::StartsWith(loaded.status().message(),
                               absl::StrCat("read from storage: reading ", path,
                                            ": file shrank: expected ")))
      << loaded.status();
  EXPECT_EQ(used(), 0u);
}

TEST_F(CheckpointLoaderTest, EachTensorIsDigestedWhenItsLastChunkLands) {
  const std::string path = WriteModel();
  const UnconfinedFileOpener opener;
  auto files = OpenCheckpointFiles(opener, path, nullptr);
  ASSERT_TRUE(files.ok()) << files.status();
  LoadLayout layout = LayOut(*files, 1 << 20);
  const CheckpointFile& f = files->files[0];
  std::string data(f.data_length(), '\0');
  ASSERT_TRUE(opener.ReadAt(f.opened, f.header.data_offset, data.size(), data.data()).ok());
  std::vector<uint8_t*> file_data = {reinterpret_cast<uint8_t*>(data.data())};
  const ChunkPlan plan = PlanChunks(files->files, layout, file_data, kChunk);
  ASSERT_GT(plan.chunks.size(), 30u);
  DigestAsRead digest(layout, plan);
  // "d" has no bytes: digested before any chunk lands.
  EXPECT_EQ(digest.digested(), 1u);
  // The chunks land last to first: a tensor is digested exactly when the
  // first of its chunks (the last to land) does, with its bytes' digest.
  for (size_t c = plan.chunks.size(); c-- > 0;) {
    digest.ChunkDone(c);
    size_t complete = 0;
    for (size_t i = 0; i < layout.tensors.size(); ++i) {
      const std::vector<size_t> under =
          plan.Under(0, layout.tensor_begin[i], layout.tensors[i].length);
      if (under.empty() || under.front() >= c) {
        ++complete;
        EXPECT_EQ(layout.tensors[i].digest,
                  DigestBytes(file_data[0] + layout.tensor_begin[i], layout.tensors[i].length))
            << layout.tensors[i].name;
      }
    }
    EXPECT_EQ(digest.digested(), complete) << "after chunk " << c;
  }
  EXPECT_EQ(digest.digested(), layout.tensors.size());
}

TEST_F(CheckpointLoaderTest, ACancelledLoadStopsBetweenReadsAndFreesAll) {
  const std::string path = WriteModel();
  // Cancelled (an unload, the client gone) as its first data read lands:
  // every file it reads carries the cancellation, no further chunk is read.
  Cancellation cancel;
  class CancelOnFirstRead final : public DataReadHook {
   public:
    CancelOnFirstRead(uint64_t data_offset, Cancellation* cancel)
        : DataReadHook(data_offset), cancel_(cancel) {}
    absl::Status OnDataRead(const OpenedFile& file, uint64_t, uint64_t, void*,
                            int n) const override {
      EXPECT_EQ(file.cancel, cancel_);
      if (n == 0) cancel_->Cancel("the model was unloaded while loading");
      return absl::OkStatus();
    }
    Cancellation* const cancel_;
  } files(DataOffset(path), &cancel);
  CheckpointLoadOptions options = Options(&files);
  options.read_threads = 1;
  options.cancel = &cancel;
  auto loaded = LoadCheckpoint(path, options);
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kCancelled) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            "read from storage: cancelled: the model was unloaded while loading");
  EXPECT_EQ(files.data_reads(), 1);
  EXPECT_EQ(used(), 0u);
}

TEST_F(CheckpointLoaderTest, FileGrownWhileReadIsDataLossAtTheRecheck) {
  const std::string path = WriteModel();
  // Bytes appended while the load reads: every read succeeds; the recheck
  // (the file's size and mtime now) fails it.
  class Append final : public DataReadHook {
   public:
    using DataReadHook::DataReadHook;
    absl::Status OnDataRead(const OpenedFile& file, uint64_t, uint64_t, void*,
                            int n) const override {
      if (n != 0) return absl::OkStatus();
      UniqueFd w(::open(file.path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
      const std::string more(4096, 'x');
      return WriteFull(w.get(), more.data(), more.size());
    }
  } files(DataOffset(path));
  auto loaded = LoadCheckpoint(path, Options(&files));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("recheck: ", path, " changed while it was being loaded"));
  EXPECT_EQ(used(), 0u);
}

// What Stat reports afterwards, changed by `change`.
class ChangedStat final : public FileOpenerWrapper {
 public:
  explicit ChangedStat(void (*change)(struct stat*)) : FileOpenerWrapper(&files_), change_(change) {}
  absl::StatusOr<struct stat> Stat(const OpenedFile& file) const override {
    absl::StatusOr<struct stat> st = FileOpenerWrapper::Stat(file);
    if (st.ok()) change_(&*st);
    return st;
  }

 private:
  const UnconfinedFileOpener files_;
  void (*const change_)(struct stat*);
};

TEST_F(CheckpointLoaderTest, SizeOrMtimeChangedMidLoadIsDataLoss) {
  const std::string path = WriteModel();
  for (auto change : {+[](struct stat* st) { st->st_size -= 1; },
                      +[](struct stat* st) { st->st_mtim.tv_nsec ^= 1; },
                      +[](struct stat* st) { st->st_mtim.tv_sec += 1; }}) {
    ChangedStat files(change);
    ResidentCheckpoints resident;
    std::unique_ptr<MemoryCharge> charge;
    CheckpointLoadOptions o = Options(&files);
    o.resident = &resident;
    o.shared_charge = &charge;
    auto loaded = LoadCheckpoint(path, o);
    ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
    EXPECT_EQ(loaded.status().message(),
              absl::StrCat("recheck: ", path, " changed while it was being loaded"));
    EXPECT_EQ(used(), 0u);
    EXPECT_TRUE(resident.Snapshot().empty());
    EXPECT_EQ(charge, nullptr);
  }
}

TEST_F(CheckpointLoaderTest, CtimeChangedMidLoadServesTheBytesButNeverShares) {
  // Only the ctime moved (a chmod, or a write that put the mtime back): the
  // load keeps what it read, but later loads of the files read them again.
  const std::string path = WriteModel();
  ResidentCheckpoints resident;
  std::unique_ptr<MemoryCharge> charge;
  ChangedStat files(+[](struct stat* st) { st->st_ctim.tv_nsec ^= 1; });
  CheckpointLoadOptions o = Options(&files);
  o.resident = &resident;
  o.shared_charge = &charge;
  auto first = LoadCheckpoint(path, o);
  ASSERT_TRUE(first.ok()) << first.status();
  ExpectFileBytes(**first, path);
  EXPECT_TRUE(resident.Snapshot().empty()) << "not offered for sharing";
  o.files = nullptr;  // unchanged now
  auto second = LoadCheckpoint(path, o);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->get(), first->get()) << "read again";
  EXPECT_EQ(charge, nullptr);
  auto third = LoadCheckpoint(path, o);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->get(), second->get()) << "shared once a load saw the files unchanged";
  EXPECT_NE(charge, nullptr);
}

TEST_F(CheckpointLoaderTest, SlowReadDoesNotHoldUpTheOtherReader) {
  const std::string path = WriteModel();
  // The first data read stalls until another read runs beside it: a load
  // whose reads were serialized would never get past it.
  class Slow final : public DataReadHook {
   public:
    using DataReadHook::DataReadHook;
    absl::Status OnDataRead(const OpenedFile&, uint64_t, uint64_t, void*,
                            int n) const override {
      if (n == 0) {
        overtaken_ = other_started_.WaitForNotificationWithTimeout(absl::Seconds(60));
      } else if (!notified_.exchange(true)) {
        other_started_.Notify();
      }
      return absl::OkStatus();
    }
    mutable std::atomic<bool> notified_{false};
    mutable absl::Notification other_started_;
    mutable std::atomic<bool> overtaken_{false};
  } files(DataOffset(path));
  std::vector<LoadProgressInfo> progress;
  absl::Mutex progress_mu;
  CheckpointLoadOptions o = Options(&files);
  o.progress = [&](const LoadProgressInfo& p) {
    absl::MutexLock lock(&progress_mu);
    progress.push_back(p);
  };
  auto loaded = LoadCheckpoint(path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(files.overtaken_.load()) << "the other reader went on while one read stalled";
  ExpectFileBytes(**loaded, path);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().bytes_done, (*loaded)->total_bytes());
  EXPECT_EQ(progress.back().bytes_from_storage, (*loaded)->total_bytes());
}

// EIO on data reads that `fail` picks (by how many came before).
class IoError final : public DataReadHook {
 public:
  IoError(uint64_t data_offset,
          std::function<bool(uint64_t offset, uint64_t length, int n)> fail)
      : DataReadHook(data_offset), fail_(std::move(fail)) {}
  absl::Status OnDataRead(const OpenedFile&, uint64_t offset, uint64_t length, void*,
                          int n) const override {
    return fail_(offset, length, n) ? ErrnoStatus(EIO, "pread") : absl::OkStatus();
  }

 private:
  const std::function<bool(uint64_t, uint64_t, int)> fail_;
};

TEST_F(CheckpointLoaderTest, IoErrorMidFileNamesPhaseAndFile) {
  const std::string path = WriteModel();
  const uint64_t data = DataOffset(path);
  // The read of the chunk holding byte 1,300 of the data (inside "e").
  IoError files(data, [&](uint64_t offset, uint64_t length, int) {
    return offset <= data + 1300 && data + 1300 < offset + length;
  });
  auto loaded = LoadCheckpoint(path, Options(&files));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kInternal) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("read from storage: reading ", path, ": pread: ", std::strerror(EIO)));
  EXPECT_EQ(used(), 0u);
}

TEST_F(CheckpointLoaderTest, IoErrorReadingHeaderOrIndexIsInTheOpenPhase) {
  const std::string path = WriteModel();
  IoError header(0, [](uint64_t offset, uint64_t, int) { return offset == 8; });  // the JSON
  auto loaded = LoadCheckpoint(path, Options(&header));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kInternal) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("open: ", path, ": pread: ", std::strerror(EIO)));

  // The index goes through the seam too (DataReadHook leaves .json alone:
  // this one fails only it).
  const std::string index = dir_ + "/" + kSafetensorsIndexName;
  {
    const std::string json = R"({"weight_map": {"a": "m.safetensors", "bb": "m.safetensors",
        "ccc": "m.safetensors", "d": "m.safetensors", "e": "m.safetensors"}})";
    UniqueFd fd(::open(index.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    ASSERT_TRUE(WriteFull(fd.get(), json.data(), json.size()).ok());
  }
  ASSERT_TRUE(LoadCheckpoint(dir_, Options(nullptr)).ok());
  class IndexError final : public FileOpenerWrapper {
   public:
    IndexError() : FileOpenerWrapper(&files_) {}
    absl::Status ReadAt(const OpenedFile& file, uint64_t offset, uint64_t length,
                        void* dest) const override {
      if (absl::EndsWith(file.path, ".json")) return ErrnoStatus(EIO, "pread");
      return FileOpenerWrapper::ReadAt(file, offset, length, dest);
    }

   private:
    const UnconfinedFileOpener files_;
  } index_error;
  loaded = LoadCheckpoint(dir_, Options(&index_error));
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kInternal) << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("open: reading ", index, ": pread: ", std::strerror(EIO)));
  EXPECT_EQ(used(), 0u);
}

// One honest holder of `held`, as a daemon's FindCheckpoint and
// ReadCheckpoint answer.
class OneHolder final : public CheckpointPeers {
 public:
  explicit OneHolder(std::shared_ptr<const Checkpoint> held) : held_(std::move(held)) {}
  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override {
    if (held_->content_key() != query.key) return {};
    auto h = DescribeHolding(*held_, query.samples);
    if (!h.ok()) return {};
    h->peer = "p1";
    return {std::move(*h)};
  }
  absl::Status ReadRange(const std::string&, const Digest&, const Digest&,
                         const CheckpointRange& range, uint8_t* dest, const char**) override {
    auto held = FindHeldBytes(*held_, range, kMaxPeerRangeBytes);
    if (!held.ok()) return held.status();
    std::memcpy(dest, held->buffer->host_data() + held->offset, range.length);
    ranges_.fetch_add(1);
    return absl::OkStatus();
  }
  int ranges() const { return ranges_.load(); }

 private:
  const std::shared_ptr<const Checkpoint> held_;
  std::atomic<int> ranges_{0};
};

TEST_F(CheckpointLoaderTest, IoErrorInThePeerPhasesNamesThem) {
  const std::string path = WriteModel();
  auto held = LoadCheckpoint(path, Options(nullptr));
  ASSERT_TRUE(held.ok()) << held.status();
  const uint64_t before = used();
  OneHolder peers(*held);
  auto peer_options = [&](const FileOpener* files) {
    CheckpointLoadOptions o = Options(files);
    o.peers = &peers;
    o.source = LoadSource::kAuto;
    o.peer_samples_per_file = 2;
    o.peer_sample_bytes = 16;
    return o;
  };
  const uint64_t data = DataOffset(path);
  {
    // Healthy: the bytes come from the peer, two samples and two secret
    // pieces from storage.
    CountingFiles files;
    auto got = LoadCheckpoint(path, peer_options(&files));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectFileBytes(**got, path);
    EXPECT_GT(peers.ranges(), 0);
    EXPECT_EQ(files.read_bytes(), data + 4 * 16);
  }
  const std::string eio = absl::StrCat("reading ", path, ": pread: ", std::strerror(EIO));
  // The first data read is a sample of storage, before the peers are asked.
  IoError sample(data, [](uint64_t, uint64_t, int n) { return n == 0; });
  auto got = LoadCheckpoint(path, peer_options(&sample));
  ASSERT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
  EXPECT_EQ(got.status().message(), absl::StrCat("plan sources: ", eio));
  EXPECT_EQ(used(), before);
  // The third is storage's bytes at a secret piece, compared with the
  // peer's once it sent them.
  IoError check(data, [](uint64_t, uint64_t, int n) { return n == 2; });
  got = LoadCheckpoint(path, peer_options(&check));
  ASSERT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
  EXPECT_EQ(got.status().message(), absl::StrCat("read from peers: ", eio));
  EXPECT_EQ(used(), before) << "what the peer sent is freed with the load";
}

// A complete holder that flips every byte it sends, and a partial holder
// (another load of the same files) whose load ends while this one checks:
// it refuses the ranges this load fetches again (NOT_FOUND, as a load that
// ended answers for its partial copy). That is no fault of the partial
// holder's: only the liar is counted as failing; the bytes come right.
class LiarAndEndingLoad final : public CheckpointPeers {
 public:
  explicit LiarAndEndingLoad(std::shared_ptr<const Checkpoint> held) : held_(std::move(held)) {}
  std::vector<PeerHolding> FindHolders(const PeerQuery& query) override {
    if (held_->content_key() != query.key) return {};
    auto liar = DescribeHolding(*held_, query.samples);
    if (!liar.ok()) return {};
    liar->peer = "liar";
    PeerHolding loading;
    loading.peer = "loading";
    loading.copy.bytes.fill(7);
    loading.partial = true;
    for (size_t f = 0; f < held_->file_info().size(); ++f) {
      loading.available.push_back({static_cast<uint32_t>(f), 0, held_->file_info()[f].data_length});
    }
    loading.sample_digests = liar->sample_digests;
    loading.sample_known.assign(query.samples.size(), true);
    return {std::move(*liar), std::move(loading)};
  }
  absl::Status ReadRange(const std::string& peer, const Digest&, const Digest&,
                         const CheckpointRange& range, uint8_t* dest, const char**) override {
    {
      absl::MutexLock lock(&mu_);
      if (peer == "liar") {
        ++liar_reads_;
        sent_by_liar_.insert({range.file, range.offset});
      } else if (sent_by_liar_.count({range.file, range.offset})) {
        ++refused_;
        return absl::NotFoundError("no load of those files runs (any more)");
      }
    }
    auto held = FindHeldBytes(*held_, range, kMaxPeerRangeBytes);
    if (!held.ok()) return held.status();
    std::memcpy(dest, held->buffer->host_data() + held->offset, range.length);
    if (peer == "liar") {
      for (uint64_t i = 0; i < range.length; ++i) dest[i] ^= 0x5a;
    }
    return absl::OkStatus();
  }
  int liar_reads() const {
    absl::MutexLock lock(&mu_);
    return liar_reads_;
  }
  int refused() const {
    absl::MutexLock lock(&mu_);
    return refused_;
  }

 private:
  const std::shared_ptr<const Checkpoint> held_;
  mutable absl::Mutex mu_;
  std::set<std::pair<uint32_t, uint64_t>> sent_by_liar_ ABSL_GUARDED_BY(mu_);
  int liar_reads_ ABSL_GUARDED_BY(mu_) = 0;
  int refused_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_F(CheckpointLoaderTest, APartialHolderWhoseLoadEndedIsNoFailingPeer) {
  const std::string path = WriteModel();
  auto held = LoadCheckpoint(path, Options(nullptr));
  ASSERT_TRUE(held.ok()) << held.status();
  LiarAndEndingLoad peers(*held);
  LoadSourceReport report;
  CheckpointLoadOptions o = Options(nullptr);
  o.peers = &peers;
  o.source = LoadSource::kAuto;
  o.peer_samples_per_file = 2;
  o.peer_sample_bytes = 16;
  o.report = &report;
  auto got = LoadCheckpoint(path, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectFileBytes(**got, path);
  ASSERT_GT(peers.liar_reads(), 0);
  // What the liar sent was fetched again: from the partial holder first,
  // which refused (its load had ended), then from storage.
  EXPECT_GT(peers.refused(), 0);
  EXPECT_EQ(report.peer_failures.count("loading"), 0u);
  EXPECT_GE(report.peer_failures["liar"], 1u);
}

TEST_F(CheckpointLoaderTest, BudgetTooSmallForTheDataFailsInTheAllocatePhase) {
  const std::string path = WriteModel();
  // Room for the metadata (5 tensors), not for a page of data.
  HostMemoryManager small({.limit_bytes = 5 * kTensorMetadataBytes + 512});
  CheckpointLoadOptions o = Options(nullptr);
  o.memory = &small;
  auto loaded = LoadCheckpoint(path, o);
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kResourceExhausted) << loaded.status();
  EXPECT_TRUE(absl::StartsWith(loaded.status().message(), "allocate: ")) << loaded.status();
  EXPECT_EQ(small.stats().used_bytes, 0u) << "the metadata charge returned too";
}

}  // namespace
}  // namespace weightd
