#include "server/transport/connection.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/unix_socket.h"
#include "server/transport/data_server_testing.h"

namespace weightd {
namespace {

using testing::Bytes;
using testing::Header;
using testing::ReadReply;
using testing::Reply;

// A connection over one end of a socket pair; the test is the client at
// the other end.
struct Pair {
  Pair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    timeval tv{10, 0};
    ::setsockopt(fds[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    server = std::make_unique<Connection>(UniqueFd(fds[0]), 7, PeerIdentity{.uid = 1000},
                                          /*counted=*/true, absl::OkStatus());
    client = UniqueFd(fds[1]);
  }
  std::unique_ptr<Connection> server;
  UniqueFd client;
};

UniqueFd Memfd() { return UniqueFd(::memfd_create("fd", MFD_CLOEXEC)); }

TEST(ConnectionTest, AHeaderTrickledByteByByteArrivesWholeWithOnlyTheFirstBytesFds) {
  Pair p;
  const std::string header = Header(kPushMagic, 42, LeaseToken{1, 2, 3}, 0);
  UniqueFd first = Memfd(), later = Memfd();
  int first_fd = first.get(), later_fd = later.get();
  ASSERT_TRUE(SendWithFds(p.client.get(), header.substr(0, 1), {&first_fd, 1}).ok());
  EXPECT_EQ(p.server->Receive(), Connection::Part::kNothing);
  for (size_t i = 1; i + 1 < header.size(); ++i) {
    // Fds riding on later bytes are dropped by the kernel.
    ASSERT_TRUE(SendWithFds(p.client.get(), header.substr(i, 1), {&later_fd, 1}).ok());
    EXPECT_EQ(p.server->Receive(), Connection::Part::kNothing) << i;
  }
  EXPECT_EQ(p.server->Receive(), Connection::Part::kNothing);  // nothing more there
  ASSERT_TRUE(SendAll(p.client.get(), header.data() + header.size() - 1, 1).ok());
  ASSERT_EQ(p.server->Receive(), Connection::Part::kHeader);
  EXPECT_EQ(std::memcmp(p.server->request().magic, kPushMagic, 4), 0);
  EXPECT_EQ(p.server->request().lease_id, 42u);
  // The kernel dropped the later bytes' fds, and says so.
  bool truncated = false;
  std::vector<UniqueFd> fds = p.server->TakeFds(&truncated);
  EXPECT_TRUE(truncated);
  ASSERT_EQ(fds.size(), 1u);
  // The same file as the client's first fd.
  struct stat a {}, b {};
  ASSERT_EQ(::fstat(fds[0].get(), &a), 0);
  ASSERT_EQ(::fstat(first_fd, &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino);
  EXPECT_TRUE(p.server->TakeFds(&truncated).empty());
  EXPECT_FALSE(truncated);
}

TEST(ConnectionTest, TooManyFdsOnOneRequestAreTruncated) {
  Pair p;
  std::vector<UniqueFd> mine;
  std::vector<int> raw;
  for (size_t i = 0; i < kMaxFdsPerRequest + 3; ++i) {
    mine.push_back(Memfd());
    raw.push_back(mine.back().get());
  }
  ASSERT_TRUE(SendWithFds(p.client.get(), Header(kPushMagic, 1, {}), raw).ok());
  ASSERT_EQ(p.server->Receive(), Connection::Part::kHeader);
  bool truncated = false;
  EXPECT_LE(p.server->TakeFds(&truncated).size(), kMaxFdsPerRequest);
  EXPECT_TRUE(truncated);
}

TEST(ConnectionTest, APushIsReadAsHeaderTargetAndOffsetsThenTakenWhole) {
  Pair p;
  CudaPushTarget target{};
  std::memset(target.gpu_uuid, 0x42, sizeof(target.gpu_uuid));
  target.size = 1 << 20;
  target.handle_kind = kCudaVmmPosixFd;
  const uint64_t offsets[2] = {256, 0};
  UniqueFd vmm = Memfd();
  int vmm_fd = vmm.get();
  const std::string bytes = Header(kCudaPushMagic, 9, {}, 2) + Bytes(&target, sizeof(target)) +
                            Bytes(offsets, sizeof(offsets));
  ASSERT_TRUE(SendWithFds(p.client.get(), bytes, {&vmm_fd, 1}).ok());
  ASSERT_EQ(p.server->Receive(), Connection::Part::kHeader);
  p.server->ExpectCudaTarget();
  ASSERT_EQ(p.server->Receive(), Connection::Part::kCudaTarget);
  p.server->HoldPushLease(std::make_shared<LeaseContents>(LeaseContents{.model = "m"}));
  p.server->ExpectOffsets(2);
  ASSERT_EQ(p.server->Receive(), Connection::Part::kOffsets);
  PendingPush push = p.server->TakePush();
  ASSERT_NE(push.lease, nullptr);
  EXPECT_EQ(push.lease->model, "m");
  EXPECT_EQ(push.offsets, (std::vector<uint64_t>{256, 0}));
  ASSERT_TRUE(push.cuda.has_value());
  EXPECT_EQ(push.cuda->size, uint64_t{1} << 20);
  EXPECT_EQ(push.fds.size(), 1u);
  EXPECT_FALSE(push.fds_truncated);
  // The next push, a host one, carries none of it.
  ASSERT_TRUE(SendAll(p.client.get(), Header(kPushMagic, 10, {}).data(), 32).ok());
  ASSERT_EQ(p.server->Receive(), Connection::Part::kHeader);
  PendingPush next = p.server->TakePush();
  EXPECT_EQ(next.lease, nullptr);
  EXPECT_TRUE(next.offsets.empty());
  EXPECT_FALSE(next.cuda.has_value());
  EXPECT_TRUE(next.fds.empty());
}

TEST(ConnectionTest, AClosedPeerIsSeen) {
  Pair p;
  p.client.Reset();
  EXPECT_EQ(p.server->Receive(), Connection::Part::kClosed);
}

TEST(ConnectionTest, AReplyCarriesItsFdsInBatchesAndItsMessage) {
  Pair p;
  // More fds than one message carries: two batches after the header's.
  const size_t n = 2 * kMaxFdsPerMessage + 7;
  UniqueFd file = Memfd();
  std::vector<int> fds(n, file.get());
  p.server->QueueReply(absl::OkStatus(), fds, "info");
  EXPECT_TRUE(p.server->replying());
  ASSERT_TRUE(p.server->Flush().ok());
  EXPECT_FALSE(p.server->replying());
  Reply r = ReadReply(p.client.get());
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.fds.size(), n);
  EXPECT_EQ(r.payload, "info");
  // An error's message is its status's, cut at kMaxReplyMessage.
  p.server->QueueReply(absl::NotFoundError(std::string(kMaxReplyMessage + 10, 'x')));
  ASSERT_TRUE(p.server->Flush().ok());
  r = ReadReply(p.client.get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status.message().size(), kMaxReplyMessage);
}

TEST(ConnectionTest, AFullSocketKeepsTheRestOfTheReplyForLater) {
  Pair p;
  int size = 4096;
  ASSERT_EQ(::setsockopt(p.server->fd(), SOL_SOCKET, SO_SNDBUF, &size, sizeof(size)), 0);
  // Replies until the socket is full; none is lost.
  int queued = 0;
  while (true) {
    p.server->QueueReply(absl::NotFoundError(std::string(2000, 'y')));
    ++queued;
    ASSERT_TRUE(p.server->Flush().ok());
    if (p.server->replying()) break;
    ASSERT_LT(queued, 100000);
  }
  int read = 0;
  while (p.server->replying()) {
    EXPECT_EQ(ReadReply(p.client.get()).status.code(), absl::StatusCode::kNotFound);
    ++read;
    ASSERT_TRUE(p.server->Flush().ok());
  }
  while (read < queued) {
    EXPECT_EQ(ReadReply(p.client.get()).status.code(), absl::StatusCode::kNotFound);
    ++read;
  }
}

TEST(ConnectionTest, CloseAfterReplyFinishesOnceTheReplyIsOut) {
  Pair p;
  p.server->QueueReply(absl::InvalidArgumentError("bad"));
  p.server->CloseAfterReply();
  EXPECT_FALSE(p.server->finished());
  ASSERT_TRUE(p.server->Flush().ok());
  EXPECT_TRUE(p.server->finished());
}

TEST(ConnectionLimitsTest, CapsConnectionsInAllAndPerUid) {
  ConnectionLimits limits({.max_connections = 3, .max_connections_per_uid = 2});
  EXPECT_TRUE(limits.Admit(1, 0).ok());
  EXPECT_TRUE(limits.Admit(1, 1).ok());
  absl::Status mine = limits.Admit(1, 2);
  EXPECT_EQ(mine.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(mine.message().find("uid 1 has 2 data connections open"), std::string::npos) << mine;
  EXPECT_NE(mine.message().find("--max-data-connections-per-uid"), std::string::npos);
  EXPECT_TRUE(limits.Admit(2, 2).ok());
  absl::Status all = limits.Admit(3, 3);
  EXPECT_EQ(all.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(all.message().find("has 3 connections open, its limit (--max-data-connections)"),
            std::string::npos)
      << all;
  limits.Leave(1);
  EXPECT_TRUE(limits.Admit(1, 2).ok());
}

TEST(ConnectionLimitsTest, CapsPushesPerUidUnlessZero) {
  ConnectionLimits limits({.max_connections = 1, .max_connections_per_uid = 1,
                           .max_pushes_per_uid = 1});
  EXPECT_TRUE(limits.StartPush(5).ok());
  absl::Status second = limits.StartPush(5);
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.message().find("uid 5 has 1 pushes queued or running"), std::string::npos);
  EXPECT_TRUE(limits.StartPush(6).ok());
  limits.EndPush(5);
  EXPECT_TRUE(limits.StartPush(5).ok());
  ConnectionLimits none({.max_connections = 1, .max_connections_per_uid = 1});
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(none.StartPush(5).ok());
}

}  // namespace
}  // namespace weightd
