// WDS1 through a real DataServer (stage_request.cc): a publish session's
// staging memfd handed to the publisher, as Options::stage decides.
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/transport/data_server_testing.h"

namespace weightd::testing {
namespace {

TEST_F(DataServerTest, WithoutAStagingCallbackStagingIsUnimplemented) {
  Start();
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kStageMagic, 3, {}));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(r.status.message(), "this daemon hands out no publish staging memory");
  EXPECT_TRUE(r.fds.empty());
}

TEST_F(DataServerTest, TheSessionsMemfdIsHandedOverWritable) {
  UniqueFd staging(::memfd_create("staging", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(staging.get(), 4096), 0);
  DataServer::Options options;
  struct Asked {
    uid_t uid = 0;
    uint64_t session = 0;
    std::string token;
  };
  std::vector<Asked> asked;
  options.stage = [&](const PeerIdentity& peer, uint64_t session,
                      absl::string_view token) -> absl::StatusOr<UniqueFd> {
    asked.push_back({peer.uid, session, std::string(token)});
    if (session != 7) return absl::NotFoundError("no publish session 7");
    return UniqueFd(::dup(staging.get()));
  };
  Start(std::move(options));
  UniqueFd c = Connect();
  LeaseToken token{};
  for (size_t i = 0; i < token.size(); ++i) token[i] = static_cast<uint8_t>(0xa0 + i);
  Reply r = Exchange(c.get(), Header(kStageMagic, 7, token));
  ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_EQ(r.fds.size(), 1u);
  // Writable, and the session's file: what the publisher writes, the
  // daemon's fd reads.
  ASSERT_EQ(::pwrite(r.fds[0].get(), "weights", 7, 100), 7);
  char back[7];
  ASSERT_EQ(::pread(staging.get(), back, 7, 100), 7);
  EXPECT_EQ(std::string(back, 7), "weights");
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].uid, ::geteuid());
  EXPECT_EQ(asked[0].session, 7u);
  EXPECT_EQ(asked[0].token, std::string(reinterpret_cast<const char*>(token.data()), 16));
  // A refusal is answered with its status; the connection serves on.
  Reply refused = Exchange(c.get(), Header(kStageMagic, 8, token));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(refused.status.message(), "no publish session 7");
  EXPECT_TRUE(refused.fds.empty());
  EXPECT_EQ(Exchange(c.get(), Header(kAttachMagic, 0xdead, {})).status.code(),
            absl::StatusCode::kNotFound);
}

TEST_F(DataServerTest, FdsSentWithAStagingRequestAreNotKept) {
  DataServer::Options options;
  options.stage = [](const PeerIdentity&, uint64_t, absl::string_view) -> absl::StatusOr<UniqueFd> {
    return absl::FailedPreconditionError("sealed");
  };
  Start(std::move(options));
  UniqueFd c = Connect();
  UniqueFd stray(::memfd_create("stray", MFD_CLOEXEC));
  Reply r = Exchange(c.get(), Header(kStageMagic, 1, {}), {stray.get()});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  // The daemon let go of its copy: ours is the only fd of the file left
  // (the closer thread closes it; /proc counts what is open).
  struct stat st {};
  ASSERT_EQ(::fstat(stray.get(), &st), 0);
  // Through /proc/self/fd by name (stat, not fstat): the fds themselves are
  // not touched while the server thread may be closing them.
  auto open_copies = [&] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) {
      struct stat other {};
      const std::string link = "/proc/self/fd/" + std::to_string(fd);
      if (::stat(link.c_str(), &other) == 0 && other.st_ino == st.st_ino &&
          other.st_dev == st.st_dev) {
        ++n;
      }
    }
    return n;
  };
  EXPECT_TRUE(Eventually([&] { return open_copies() == 1; }));
}

}  // namespace
}  // namespace weightd::testing
