#include "server/state/state_dir.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "server/state/state_journal.h"

namespace weightd {
namespace {

namespace fs = std::filesystem;

std::string Read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

bool Contains(const absl::Status& s, const std::string& what) {
  return std::string(s.message()).find(what) != std::string::npos;
}

class StateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightd-statedir-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    top_ = tmpl;
    // A file that is not the daemon's to write: links aim at it.
    victim_ = top_ + "/victim";
    Write(victim_, "precious");
  }
  void TearDown() override { fs::remove_all(top_); }

  std::string top_, victim_;
};

TEST_F(StateDirTest, CreatesAMissingDirectoryPrivate) {
  const std::string path = top_ + "/state";
  ::umask(0);  // mkdir's mode alone keeps it private
  auto dir = StateDir::Open(path + "/", ::geteuid());
  ::umask(022);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ((*dir)->path(), path);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

TEST_F(StateDirTest, RefusesALinkAnotherOwnerAndADirectoryOthersMayWrite) {
  const std::string real = top_ + "/real", link = top_ + "/link";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  for (const std::string& given : {link, link + "/"}) {
    auto linked = StateDir::Open(given, ::geteuid());
    EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition) << given;
    EXPECT_TRUE(Contains(linked.status(), "symbolic link")) << linked.status();
  }
  // Owned by another uid (as if chowned to it): named with owner and mode.
  const uid_t other = ::geteuid() + 4242;
  auto foreign = StateDir::Open(real, other);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(foreign.status(), real + " is owned by uid " + std::to_string(::geteuid())))
      << foreign.status();
  EXPECT_TRUE(Contains(foreign.status(), "mode 0700")) << foreign.status();
  EXPECT_TRUE(Contains(foreign.status(), "chown " + std::to_string(other))) << foreign.status();
  for (mode_t mode : {0770, 0707, 01777}) {
    ASSERT_EQ(::chmod(real.c_str(), mode), 0);
    auto open = StateDir::Open(real, ::geteuid());
    EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition) << mode;
    EXPECT_TRUE(Contains(open.status(), "is writable by")) << open.status();
    EXPECT_TRUE(Contains(open.status(), "chmod 0700 " + real)) << open.status();
  }
  ASSERT_EQ(::chmod(real.c_str(), 0755), 0);  // readable by others is fine
  EXPECT_TRUE(StateDir::Open(real, ::geteuid()).ok());
  // A file where the directory should be.
  auto file = StateDir::Open(victim_, ::geteuid());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Read(victim_), "precious");
}

TEST_F(StateDirTest, PlantedEntriesAreRefusedNeverFollowed) {
  auto opened = StateDir::Open(top_ + "/state", ::geteuid());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const StateDir& dir = **opened;
  const std::string victim_dir = top_ + "/victim-dir";
  ASSERT_EQ(::mkdir(victim_dir.c_str(), 0700), 0);
  Write(victim_dir + "/keep", "kept");
  ASSERT_EQ(::symlink(victim_.c_str(), dir.PathOf("log").c_str()), 0);
  ASSERT_EQ(::symlink(victim_dir.c_str(), dir.PathOf("sub").c_str()), 0);
  ASSERT_EQ(::link(victim_.c_str(), dir.PathOf("hard").c_str()), 0);
  ASSERT_EQ(::mkfifo(dir.PathOf("fifo").c_str(), 0600), 0);
  for (const char* name : {"log", "hard", "fifo"}) {
    auto append = dir.OpenToAppend(name, /*truncate=*/true);
    EXPECT_EQ(append.status().code(), absl::StatusCode::kFailedPrecondition) << name;
    EXPECT_TRUE(Contains(append.status(), dir.PathOf(name))) << append.status();
    EXPECT_EQ(dir.OpenToRead(name).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(dir.CreateFile(name).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(Contains(dir.Check("log", StateDir::Kind::kFile).status(),
                       "symbolic link (to " + victim_ + ")"));
  EXPECT_TRUE(Contains(dir.Check("hard", StateDir::Kind::kFile).status(), "2 hard links"));
  auto sub = dir.Subdir("sub", /*create=*/true);
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kFailedPrecondition) << sub.status();
  EXPECT_EQ(dir.ConnectUnix("log").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dir.ListenUnix("log", 0600).status().code(), absl::StatusCode::kFailedPrecondition);
  // Removing a link removes the link.
  ASSERT_TRUE(dir.Remove("log").ok());
  ASSERT_TRUE(dir.Remove("sub").ok());
  EXPECT_EQ(Read(victim_), "precious");
  EXPECT_EQ(Read(victim_dir + "/keep"), "kept");
  // A subdirectory others may write is refused like the top.
  ASSERT_EQ(::mkdir(dir.PathOf("open").c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir.PathOf("open").c_str(), 0777), 0);
  auto open = dir.Subdir("open", /*create=*/false);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(open.status(), "mode 0777")) << open.status();
  EXPECT_EQ(dir.Subdir("../x", true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StateDirTest, FilesAreWrittenRenamedListedAndRemovedInside) {
  auto opened = StateDir::Open(top_ + "/state", ::geteuid());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const StateDir& dir = **opened;
  EXPECT_EQ(dir.OpenToRead("a").status().code(), absl::StatusCode::kNotFound);
  {
    auto fd = dir.OpenToAppend("a", /*truncate=*/false);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_TRUE(WriteFull(fd->get(), "one", 3).ok());
  }
  {
    auto fd = dir.OpenToAppend("a", /*truncate=*/false);
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteFull(fd->get(), "two", 3).ok());
  }
  EXPECT_EQ(Read(dir.PathOf("a")), "onetwo");
  {
    auto fd = dir.OpenToAppend("a", /*truncate=*/true);
    ASSERT_TRUE(fd.ok());
  }
  EXPECT_EQ(Read(dir.PathOf("a")), "");
  {
    auto fd = dir.CreateFile("b");
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_TRUE(WriteFull(fd->get(), "bee", 3).ok());
  }
  ASSERT_TRUE(dir.Rename("b", "a").ok());
  ASSERT_TRUE(dir.Sync().ok());
  EXPECT_EQ(Read(dir.PathOf("a")), "bee");
  auto names = dir.List();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"a"});
  ASSERT_TRUE(dir.Remove("a").ok());
  ASSERT_TRUE(dir.Remove("a").ok());  // missing: fine
  EXPECT_TRUE(dir.List()->empty());
  // The directory keeps its identity: renamed away, it is still the one used.
  ASSERT_EQ(::rename(dir.path().c_str(), (top_ + "/moved").c_str()), 0);
  ASSERT_EQ(::symlink(top_.c_str(), dir.path().c_str()), 0);
  ASSERT_TRUE(dir.CreateFile("c").ok());
  EXPECT_TRUE(fs::exists(top_ + "/moved/c"));
  EXPECT_FALSE(fs::exists(top_ + "/c"));
}

TEST_F(StateDirTest, UnixSocketsAreBoundAndReachedInside) {
  auto opened = StateDir::Open(top_ + "/state", ::geteuid());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const StateDir& dir = **opened;
  EXPECT_EQ(dir.ConnectUnix("s").status().code(), absl::StatusCode::kNotFound);
  {
    auto listening = dir.ListenUnix("s", 0600);
    ASSERT_TRUE(listening.ok()) << listening.status();
    struct stat st;
    ASSERT_EQ(::lstat(dir.PathOf("s").c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_TRUE(dir.ConnectUnix("s").ok());
    // In use: a second listener is refused.
    EXPECT_EQ(dir.ListenUnix("s", 0600).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  // Stale (nobody listens): NOT_FOUND to a client, replaced by a listener.
  EXPECT_EQ(dir.ConnectUnix("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(dir.ListenUnix("s", 0600).ok());
}

TEST_F(StateDirTest, TheFileOpenerReadsOnlyItsOwnFiles) {
  auto opened = StateDir::Open(top_ + "/state", ::geteuid());
  ASSERT_TRUE(opened.ok()) << opened.status();
  Write((*opened)->PathOf("f"), "x");
  ASSERT_EQ(::symlink(victim_.c_str(), (*opened)->PathOf("l").c_str()), 0);
  StateDirFileOpener files(*opened);
  auto f = files.Open((*opened)->PathOf("f"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->st.st_size, 1);
  EXPECT_EQ(files.Open((*opened)->PathOf("l")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(files.Open(victim_).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(files.Open((*opened)->PathOf("../victim")).status().code(),
            absl::StatusCode::kPermissionDenied);
}

// The journal's files: a link planted as journal.new or skipped.log (the
// state directory was open to another user once) refuses the start and
// writes nothing through it.
TEST_F(StateDirTest, AJournalDoesNotOpenOverPlantedLinks) {
  const std::string state = top_ + "/state";
  ASSERT_EQ(::mkdir(state.c_str(), 0700), 0);
  for (const char* name : {"journal.new", "skipped.log", "journal"}) {
    const std::string planted = state + "/" + name;
    ASSERT_EQ(::symlink(victim_.c_str(), planted.c_str()), 0);
    auto j = StateJournal::Open(state);
    EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition) << name;
    EXPECT_TRUE(Contains(j.status(), planted + " is a symbolic link")) << j.status();
    EXPECT_EQ(Read(victim_), "precious") << name;
    ASSERT_EQ(::unlink(planted.c_str()), 0);
  }
  ASSERT_EQ(::symlink(top_.c_str(), (state + "/published").c_str()), 0);
  EXPECT_EQ(StateJournal::Open(state).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(::unlink((state + "/published").c_str()), 0);
  EXPECT_TRUE(StateJournal::Open(state).ok());
}

}  // namespace
}  // namespace weightd
