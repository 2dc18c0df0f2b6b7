#include "server/store/model_roots.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"
#include "server/adapter/adapter.h"
#include "server/store/checkpoint_loader.h"

namespace weightd {
namespace {

namespace fs = std::filesystem;

// Every test runs twice: openat2 where the kernel has it, and the
// component walk (what kernels before 5.6 get).
class ModelRootsTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightd-roots-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    root_ = dir_ + "/root";
    outside_ = dir_ + "/outside";
    fs::create_directory(root_);
    fs::create_directory(outside_);
    memory_ = std::make_unique<HostMemoryManager>(HostMemoryManager::Options{});
    account_ = memory_->account();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a safetensors file holding one F32 tensor [4] named `tensor`.
  static void WriteFile(const std::string& path, const std::string& tensor) {
    ASSERT_TRUE(
        WriteSafetensorsFile(path, {{tensor, DType::kF32, {4}, std::string(16, '\0')}}).ok());
  }

  absl::StatusOr<ModelRoots> Roots(std::vector<std::string> roots = {}) {
    if (roots.empty()) roots = {root_};
    return ModelRoots::Create(roots, ModelRoots::Options{.use_openat2 = GetParam()});
  }

  // Loads `path` as the daemon does: every file opened inside the roots.
  absl::StatusOr<std::shared_ptr<const Checkpoint>> Load(const ModelRoots& roots,
                                                         const std::string& path) {
    CheckpointLoadOptions o;
    o.memory = memory_.get();
    o.files = &roots;
    return LoadCheckpoint(path, o);
  }

  static absl::StatusCode Code(const absl::StatusOr<OpenedFile>& f) { return f.status().code(); }

  std::string dir_, root_, outside_;
  std::unique_ptr<HostMemoryManager> memory_;
  std::shared_ptr<MemoryAccount> account_;
};

// After a swap race: puts the real file or directory back at `path` (the
// swapper may have stopped with the symlink there), so that a last load
// shows the opener still serves what is inside. Loads during the race may
// all be refused on a loaded machine (the walk gives up after a few swaps
// under it), so "some load succeeded" is shown by this one, not by them.
void Unswap(const std::string& path, const std::string& other) {
  if (fs::is_symlink(path)) {
    ASSERT_EQ(::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, other.c_str(), RENAME_EXCHANGE), 0);
  }
}

// A tenant who can write inside a root swaps a directory for a symlink out
// of it while loads run: no load may ever read the file outside.
TEST_P(ModelRootsTest, DirectorySymlinkSwapNeverReadsOutsideTheRoot) {
  fs::create_directory(root_ + "/slot");
  WriteFile(root_ + "/slot/m.safetensors", "inside");
  WriteFile(outside_ + "/m.safetensors", "secret");
  fs::create_directory_symlink(outside_, root_ + "/other");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();

  std::atomic<bool> stop{false};
  std::atomic<int> swaps{0};
  std::thread swapper([&] {
    const std::string slot = root_ + "/slot", other = root_ + "/other";
    while (!stop.load()) {
      // slot <-> other atomically: a directory one moment, a symlink out of
      // the root the next.
      ASSERT_EQ(::renameat2(AT_FDCWD, slot.c_str(), AT_FDCWD, other.c_str(), RENAME_EXCHANGE), 0);
      swaps.fetch_add(1);
    }
  });
  int loaded = 0, refused = 0, leaked = 0;
  for (int i = 0; i < 3000 && leaked == 0; ++i) {
    auto ckpt = Load(*roots, root_ + "/slot/m.safetensors");
    if (!ckpt.ok()) {
      ++refused;
      continue;
    }
    ++loaded;
    if ((*ckpt)->Find("secret") != nullptr) ++leaked;
  }
  stop = true;
  swapper.join();
  EXPECT_EQ(leaked, 0) << "a load read the file outside the root (" << loaded << " loaded, "
                       << refused << " refused, " << swaps.load() << " swaps)";
  EXPECT_GT(swaps.load(), 0);
  Unswap(root_ + "/slot", root_ + "/other");
  auto after = Load(*roots, root_ + "/slot/m.safetensors");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE((*after)->Find("inside"), nullptr);
}

// The same race on the file itself: a file one moment, a symlink out of the
// root the next.
TEST_P(ModelRootsTest, FileSymlinkSwapNeverReadsOutsideTheRoot) {
  WriteFile(root_ + "/m.safetensors", "inside");
  WriteFile(outside_ + "/m.safetensors", "secret");
  fs::create_symlink(outside_ + "/m.safetensors", root_ + "/other");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    const std::string file = root_ + "/m.safetensors", other = root_ + "/other";
    while (!stop.load()) {
      ASSERT_EQ(::renameat2(AT_FDCWD, file.c_str(), AT_FDCWD, other.c_str(), RENAME_EXCHANGE), 0);
    }
  });
  int loaded = 0, leaked = 0;
  for (int i = 0; i < 3000 && leaked == 0; ++i) {
    auto ckpt = Load(*roots, root_ + "/m.safetensors");
    if (!ckpt.ok()) {
      // Out of the root, or changing under the open too often: never more.
      EXPECT_TRUE(absl::IsPermissionDenied(ckpt.status()) || absl::IsUnavailable(ckpt.status()))
          << ckpt.status();
      continue;
    }
    ++loaded;
    if ((*ckpt)->Find("secret") != nullptr) ++leaked;
  }
  stop = true;
  swapper.join();
  EXPECT_EQ(leaked, 0) << "a load read the file outside the root (" << loaded << " loaded)";
  Unswap(root_ + "/m.safetensors", root_ + "/other");
  auto after = Load(*roots, root_ + "/m.safetensors");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE((*after)->Find("inside"), nullptr);
}

// The same race on an adapter directory (weights and config read through
// the opener): no load ever holds the adapter outside.
TEST_P(ModelRootsTest, AdapterDirectorySymlinkSwapNeverReadsOutsideTheRoot) {
  auto peft = [](const std::string& dir, const std::string& module) {
    fs::create_directories(dir);
    const std::string a = "base_model.model." + module + ".lora_A.weight";
    const std::string b = "base_model.model." + module + ".lora_B.weight";
    ASSERT_TRUE(WriteSafetensorsFile(dir + "/adapter_model.safetensors",
                                     {{a, DType::kF32, {1, 2}, std::string(8, '\0')},
                                      {b, DType::kF32, {2, 1}, std::string(8, '\0')}})
                    .ok());
    std::ofstream(dir + "/adapter_config.json") << R"({"r": 1, "lora_alpha": 1})";
  };
  peft(root_ + "/slot", "inside");
  peft(outside_ + "/adapter", "secret");
  fs::create_directory_symlink(outside_ + "/adapter", root_ + "/other");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    const std::string slot = root_ + "/slot", other = root_ + "/other";
    while (!stop.load()) {
      ASSERT_EQ(::renameat2(AT_FDCWD, slot.c_str(), AT_FDCWD, other.c_str(), RENAME_EXCHANGE), 0);
    }
  });
  int loaded = 0, leaked = 0;
  for (int i = 0; i < 2000 && leaked == 0; ++i) {
    auto a = LoadAdapter(root_ + "/slot", AdapterFormat::kAuto, {.files = &*roots});
    if (!a.ok()) continue;
    ++loaded;
    for (const AdapterEntry& e : (*a)->entries) leaked += e.target.find("secret") != std::string::npos;
  }
  stop = true;
  swapper.join();
  EXPECT_EQ(leaked, 0) << "an adapter load read files outside the root (" << loaded
                       << " loaded)";
  Unswap(root_ + "/slot", root_ + "/other");
  auto after = LoadAdapter(root_ + "/slot", AdapterFormat::kAuto, {.files = &*roots});
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_FALSE((*after)->entries.empty());
  for (const AdapterEntry& e : (*after)->entries) {
    EXPECT_NE(e.target.find("inside"), std::string::npos) << e.target;
  }
}

TEST_P(ModelRootsTest, ConfinesPathsAndSymlinks) {
  WriteFile(outside_ + "/m.safetensors", "secret");
  WriteFile(root_ + "/base.safetensors", "inside");
  fs::create_directories(root_ + "/snap/rev");
  fs::create_directories(root_ + "/blobs");
  WriteFile(root_ + "/blobs/sha", "blob");
  fs::create_symlink("/etc/hostname", root_ + "/escape");
  fs::create_symlink(outside_ + "/m.safetensors", root_ + "/out.safetensors");
  fs::create_symlink("../" + fs::path(outside_).filename().string() + "/m.safetensors",
                     root_ + "/rel_out.safetensors");
  fs::create_directory_symlink(outside_, root_ + "/outdir");
  // Links that stay inside: relative (a Hugging Face cache) and absolute.
  fs::create_symlink("../../blobs/sha", root_ + "/snap/rev/model.safetensors");
  fs::create_symlink(root_ + "/base.safetensors", root_ + "/abs_in.safetensors");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();
  const absl::StatusCode denied = absl::StatusCode::kPermissionDenied;
  for (const std::string& p :
       {root_ + "/escape", root_ + "/out.safetensors", root_ + "/rel_out.safetensors",
        root_ + "/outdir/m.safetensors", root_ + "/outdir", outside_ + "/m.safetensors",
        std::string("/etc/passwd"), root_ + "/../outside/m.safetensors",
        std::string("../outside/m.safetensors"), root_ + "/snap/rev/../../../outside"}) {
    EXPECT_EQ(Code(roots->Open(p)), denied) << p;
  }
  EXPECT_EQ(Code(roots->Open(root_ + "/nope")), absl::StatusCode::kNotFound);
  EXPECT_EQ(Code(roots->Open("")), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Code(roots->Open(std::string("a\0b", 3))), absl::StatusCode::kInvalidArgument);
  for (const std::string& p : {root_ + "/base.safetensors", root_ + "/abs_in.safetensors",
                               root_ + "/snap/rev/model.safetensors", root_ + "/snap/rev",
                               std::string("base.safetensors"), root_, root_ + "/snap/./rev/"}) {
    auto f = roots->Open(p);
    EXPECT_TRUE(f.ok()) << p << ": " << f.status();
  }
  // OpenIn / OpenBeside stay confined to the root, not to the directory.
  auto rev = roots->Open(root_ + "/snap/rev");
  ASSERT_TRUE(rev.ok()) << rev.status();
  EXPECT_TRUE(roots->OpenIn(*rev, "model.safetensors").ok());
  EXPECT_TRUE(roots->OpenIn(*rev, "../../base.safetensors").ok());
  EXPECT_EQ(Code(roots->OpenIn(*rev, "../../../outside/m.safetensors")), denied);
  auto model = roots->OpenIn(*rev, "model.safetensors");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(Code(roots->OpenBeside(*model, "nope.json")), absl::StatusCode::kNotFound);
  EXPECT_TRUE(roots->OpenBeside(*model, "../../base.safetensors").ok());
  EXPECT_EQ(Code(roots->OpenBeside(*model, "../../escape")), denied);
  EXPECT_EQ(ModelRoots::Create({dir_ + "/missing"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// What lies outside the roots is never told: a path (or a link) to a file
// that exists there gets the very message one to a missing file gets.
TEST_P(ModelRootsTest, OutsideMessagesAreTheSameWhetherOrNotTheTargetExists) {
  WriteFile(outside_ + "/there", "secret");
  fs::create_symlink(outside_ + "/there", root_ + "/link");
  fs::create_symlink(outside_ + "/missing", root_ + "/dangling");
  fs::create_symlink("../outside/there", root_ + "/rel");
  fs::create_symlink("../outside/missing", root_ + "/rel_dangling");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();
  auto message = [&](const std::string& p) {
    absl::Status s = roots->Open(p).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << p << ": " << s;
    std::string m(s.message());
    size_t at = m.find(p);
    if (at != std::string::npos) m.replace(at, p.size(), "<P>");
    return m;
  };
  EXPECT_EQ(message("/etc/passwd"), message("/etc/no-such-file-weightd"));
  EXPECT_EQ(message(outside_ + "/there"), message(outside_ + "/missing"));
  EXPECT_EQ(message(root_ + "/link"), message(root_ + "/dangling"));
  EXPECT_EQ(message(root_ + "/rel"), message(root_ + "/rel_dangling"));
  EXPECT_EQ(message(root_ + "/link"), message("/etc/passwd"));
  EXPECT_EQ(message(root_ + "/link").find("/etc"), std::string::npos);
  EXPECT_EQ(message(root_ + "/link").find("there"), std::string::npos);
}

// A FIFO (or socket, or device) is refused at once, never opened for
// reading: a load naming one cannot hang.
TEST_P(ModelRootsTest, SpecialFilesAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo((root_ + "/fifo.safetensors").c_str(), 0644), 0);
  fs::create_directory(root_ + "/d");
  ASSERT_EQ(::mkfifo((root_ + "/d/model.safetensors").c_str(), 0644), 0);
  fs::create_symlink("/dev/zero", root_ + "/zero");  // outside anyway
  auto roots = Roots({root_, "/dev"});
  ASSERT_TRUE(roots.ok()) << roots.status();
  for (const std::string& p : {root_ + "/fifo.safetensors", std::string("/dev/zero")}) {
    auto f = roots->Open(p);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << p;
    EXPECT_NE(f.status().message().find(p), std::string::npos) << f.status();
  }
  auto ckpt = Load(*roots, root_ + "/d");
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument) << ckpt.status();
  EXPECT_NE(ckpt.status().message().find("FIFO"), std::string::npos) << ckpt.status();
  EXPECT_EQ(account_->used(), 0u);
}

// model.safetensors.index.json goes through the same confinement as every
// other file: a link out of the roots is refused before a byte is read, and
// nothing of it is quoted.
TEST_P(ModelRootsTest, IndexLinkedOutsideIsNotRead) {
  {
    std::ofstream out(outside_ + "/index.json");
    out << "TOP-SECRET-CONTENT {";
  }
  fs::create_directory(root_ + "/m");
  WriteFile(root_ + "/m/a.safetensors", "inside");
  fs::create_symlink(outside_ + "/index.json", root_ + "/m/model.safetensors.index.json");
  auto roots = Roots();
  ASSERT_TRUE(roots.ok()) << roots.status();
  for (const std::string& p : {root_ + "/m", root_ + "/m/model.safetensors.index.json"}) {
    auto ckpt = Load(*roots, p);
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kPermissionDenied) << ckpt.status();
    EXPECT_EQ(ckpt.status().message().find("SECRET"), std::string::npos) << ckpt.status();
  }
  // Each shard an index names is confined too.
  fs::remove(root_ + "/m/model.safetensors.index.json");
  {
    std::ofstream out(root_ + "/m/model.safetensors.index.json");
    out << R"({"weight_map": {"inside": "a.safetensors", "secret": "b.safetensors"}})";
  }
  WriteFile(outside_ + "/b.safetensors", "secret");
  fs::create_symlink(outside_ + "/b.safetensors", root_ + "/m/b.safetensors");
  auto ckpt = Load(*roots, root_ + "/m");
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kPermissionDenied) << ckpt.status();
  // Inside, an index (named directly or by its directory) loads.
  fs::remove(root_ + "/m/b.safetensors");
  WriteFile(root_ + "/m/b.safetensors", "secret");
  for (const std::string& p : {root_ + "/m", root_ + "/m/model.safetensors.index.json"}) {
    auto ok = Load(*roots, p);
    ASSERT_TRUE(ok.ok()) << p << ": " << ok.status();
    EXPECT_EQ((*ok)->tensors().size(), 2u);
  }
}

INSTANTIATE_TEST_SUITE_P(OpenModes, ModelRootsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Openat2" : "ComponentWalk";
                         });

}  // namespace
}  // namespace weightd
