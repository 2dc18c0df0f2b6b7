// WDA1 through a real DataServer (attach_request.cc), and what every
// request meets first: admission and the magic (data_server.cc Dispatch).
#include <sys/stat.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/transport/data_server_testing.h"

namespace weightd::testing {
namespace {

absl::string_view TokenOf(const LeaseGrant& g) {
  return absl::string_view(reinterpret_cast<const char*>(g.token.data()), g.token.size());
}

TEST_F(DataServerTest, AttachHandsOutEverySegmentInOrderAcrossFdBatches) {
  Start();
  // More segments than one message carries fds.
  std::vector<BufferPtr> buffers;
  for (size_t i = 0; i < kMaxFdsPerMessage + 20; ++i) buffers.push_back(HostBuffer(4096));
  LeaseGrant grant = leases_.Grant(LeaseContents{.buffers = buffers});
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kAttachMagic, grant.id, grant.token));
  ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_EQ(r.fds.size(), buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    struct stat got {}, want {};
    ASSERT_EQ(::fstat(r.fds[i].get(), &got), 0);
    ASSERT_EQ(::fstat(*buffers[i]->ShareableFd(), &want), 0);
    EXPECT_EQ(got.st_ino, want.st_ino) << i;
  }
  // The lease lives as long as the connection.
  EXPECT_TRUE(leases_.Use(grant.id, TokenOf(grant)).ok());
  c.Reset();
  EXPECT_TRUE(Eventually([&] { return !leases_.Use(grant.id, TokenOf(grant)).ok(); }));
  EXPECT_EQ(leases_.Use(grant.id, TokenOf(grant)).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DataServerTest, APushOnlyLeaseIsNotAttached) {
  Start();
  LeaseGrant grant = leases_.Grant(LeaseContents{.buffers = {HostBuffer(4096)},
                                                 .push_only = true});
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kAttachMagic, grant.id, grant.token));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_TRUE(r.fds.empty());
  // The connection serves on.
  EXPECT_EQ(Exchange(c.get(), Header(kAttachMagic, 0xdead, {})).status.code(),
            absl::StatusCode::kNotFound);
}

TEST_F(DataServerTest, AnAttachTheCallbackRefusesNeverTiesTheLease) {
  DataServer::Options options;
  std::vector<uint64_t> asked;
  options.authorize_attach = [&asked](const PeerIdentity& peer, uint64_t lease) {
    asked.push_back(lease);
    EXPECT_EQ(peer.uid, ::geteuid());
    return absl::PermissionDeniedError("not yours");
  };
  Start(std::move(options));
  LeaseGrant grant = leases_.Grant(LeaseContents{.buffers = {HostBuffer(4096)}});
  UniqueFd c = Connect();
  Reply r = Exchange(c.get(), Header(kAttachMagic, grant.id, grant.token));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(r.status.message(), "not yours");
  EXPECT_EQ(asked, std::vector<uint64_t>{grant.id});
  // Not tied to the connection: it outlives it.
  c.Reset();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(leases_.Use(grant.id, TokenOf(grant)).ok());
}

TEST_F(DataServerTest, ARefusedPeerGetsItsRefusalForEveryRequestThenTheConnectionCloses) {
  DataServer::Options options;
  options.authorize = [](const PeerIdentity&) {
    return absl::PermissionDeniedError("not on this socket");
  };
  Start(std::move(options));
  for (const char* magic : {kAttachMagic, kStageMagic, kPushMagic}) {
    UniqueFd c = Connect();
    Reply r = Exchange(c.get(), Header(magic, 1, {}));
    const std::string name(magic, 4);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kPermissionDenied) << name;
    EXPECT_EQ(r.status.message(), "not on this socket");
    EXPECT_TRUE(ClosedByPeer(c.get())) << name;
  }
}

TEST_F(DataServerTest, ABadMagicIsRefusedAndTheConnectionClosed) {
  Start();
  UniqueFd c = Connect();
  const char bad[4] = {'W', 'D', 'X', '9'};
  Reply r = Exchange(c.get(), Header(bad, 1, {}));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status.message(), "bad attach request magic");
  EXPECT_TRUE(ClosedByPeer(c.get()));
  EXPECT_TRUE(Eventually([&] { return server_->connections_open() == 0; }));
}

}  // namespace
}  // namespace weightd::testing
