#include "server/auth/peer_identity.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "common/unix_socket.h"

namespace weightd {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/peer-identity-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { (void)!std::system(("rm -rf " + path_).c_str()); }
  std::string Path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

TEST(PeerIdentityTest, ReadsTheCredentialsOfTheConnectingProcess) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  auto id = ReadPeerIdentity(a.get());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->uid, ::geteuid());
  EXPECT_EQ(id->gid, ::getegid());
  EXPECT_EQ(id->pid, ::getpid());
  EXPECT_TRUE(id->InGroup(::getegid()));
  gid_t groups[256];
  int n = ::getgroups(256, groups);
  for (int i = 0; i < n; ++i) EXPECT_TRUE(id->InGroup(groups[i])) << groups[i];
  EXPECT_NE(id->Describe().find("uid "), std::string::npos);
}

TEST(PeerIdentityTest, NotASocketIsAnError) {
  UniqueFd f(::open("/dev/null", O_RDONLY));
  EXPECT_FALSE(ReadPeerIdentity(f.get()).ok());
}

TEST(ListenUnixWithModeTest, ExactModeWhateverTheUmask) {
  TempDir dir;
  for (mode_t mode : {0600, 0660, 0666}) {
    for (mode_t mask : {0000, 0077}) {
      mode_t old = ::umask(mask);
      auto fd = ListenUnixWithMode(dir.Path("s"), mode);
      ::umask(old);
      ASSERT_TRUE(fd.ok()) << fd.status();
      struct stat st;
      ASSERT_EQ(::stat(dir.Path("s").c_str(), &st), 0);
      EXPECT_TRUE(S_ISSOCK(st.st_mode));
      EXPECT_EQ(st.st_mode & 07777, mode) << std::oct << mode << " umask " << mask;
      // It accepts connections, and the peer it sees is us.
      auto client = ConnectUnix(dir.Path("s"));
      ASSERT_TRUE(client.ok()) << client.status();
    }
  }
}

TEST(ListenUnixWithModeTest, ReplacesAStaleSocketButNotAFile) {
  TempDir dir;
  { ASSERT_TRUE(ListenUnixWithMode(dir.Path("s"), 0660).ok()); }  // closed: stale file left
  EXPECT_TRUE(ListenUnixWithMode(dir.Path("s"), 0660).ok());
  UniqueFd f(::open(dir.Path("plain").c_str(), O_CREAT | O_WRONLY, 0644));
  EXPECT_EQ(ListenUnixWithMode(dir.Path("plain"), 0660).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ListenUnixWithMode(std::string(200, 'x'), 0660).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Two daemons on one path: the second must not unlink the live one's socket.
TEST(ListenUnixWithModeTest, RefusesASocketALiveProcessListensOn) {
  TempDir dir;
  auto live = ListenUnixWithMode(dir.Path("s"), 0660);
  ASSERT_TRUE(live.ok()) << live.status();
  auto second = ListenUnixWithMode(dir.Path("s"), 0660);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_NE(second.status().message().find("already in use"), std::string::npos);
  // The live listener still owns the path: a client reaches it.
  auto client = ConnectUnix(dir.Path("s"));
  EXPECT_TRUE(client.ok()) << client.status();
  live->Reset();  // now it is stale
  EXPECT_TRUE(ListenUnixWithMode(dir.Path("s"), 0660).ok());
}

}  // namespace
}  // namespace weightd
