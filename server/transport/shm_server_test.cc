#include "server/transport/shm_server.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/memory/segment.h"

#include "absl/time/clock.h"
#include "common/data_protocol.h"
#include "common/unix_socket.h"

namespace weightd {
namespace {

// A lease id no table has: its answer is NOT_FOUND, with no fds.
constexpr uint64_t kUnknownLease = 0xdead;

AttachRequest RequestFor(uint64_t lease_id) {
  AttachRequest req{};
  std::memcpy(req.magic, kAttachMagic, 4);
  req.lease_id = lease_id;
  return req;
}

// Connects with a receive timeout, so that a daemon that never answers
// fails the test instead of hanging it.
UniqueFd Connect(const std::string& path) {
  auto fd = ConnectUnix(path);
  EXPECT_TRUE(fd.ok()) << fd.status();
  if (!fd.ok()) return UniqueFd();
  timeval tv{10, 0};
  ::setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return std::move(*fd);
}

// Sends one attach request and returns the daemon's answer.
absl::Status Attach(int sock, uint64_t lease_id, const LeaseToken& token = {}) {
  AttachRequest req = RequestFor(lease_id);
  std::memcpy(req.token, token.data(), sizeof(req.token));
  absl::Status sent = SendAll(sock, &req, sizeof(req));
  AttachReply reply{};
  absl::Status got = RecvAll(sock, &reply, sizeof(reply));
  if (!got.ok()) return sent.ok() ? got : sent;
  std::string msg(reply.message_len, '\0');
  if (!msg.empty()) {
    absl::Status s = RecvAll(sock, msg.data(), msg.size());
    if (!s.ok()) return s;
  }
  return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
}

class ShmDataServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shm_server_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    server_.reset();
    ::rmdir(dir_.c_str());
  }

  void Start(ShmDataServer::Options options) {
    options.path = dir_ + "/data.sock";
    auto server = ShmDataServer::Start(std::move(options), &leases_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::string dir_;
  LeaseTable leases_{absl::Seconds(60)};
  std::unique_ptr<ShmDataServer> server_;
};

// Device memory as the data socket sees it: a buffer of another kind
// (the CUDA memory manager is issue [gpu]; this one has no bytes at all).
class DeviceBuffer final : public Buffer {
 public:
  uint64_t id() const override { return 1u << 30; }
  uint64_t size() const override { return 4096; }
  MemoryLocation location() const override { return {MemoryKind::kCudaDevice, 0}; }
  const uint8_t* host_data() const override { return nullptr; }
  absl::StatusOr<int> ShareableFd() const override {
    ADD_FAILURE() << "the data socket asked a device buffer for its fd";
    return absl::UnimplementedError("no device here");
  }
};

TEST_F(ShmDataServerTest, AttachHandsOutHostBuffersAndRefusesOtherKinds) {
  Start({});
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "test", 4096, false);
  ASSERT_TRUE(seg.ok());
  ASSERT_TRUE((*seg)->Seal().ok());
  BufferPtr host = SegmentPtr(std::move(*seg));
  LeaseGrant ok = leases_.Grant(LeaseContents{.buffers = {host}});
  LeaseGrant mixed =
      leases_.Grant(LeaseContents{.buffers = {host, std::make_shared<DeviceBuffer>()}});
  UniqueFd c = Connect(dir_ + "/data.sock");
  EXPECT_TRUE(Attach(c.get(), ok.id, ok.token).ok());
  UniqueFd d = Connect(dir_ + "/data.sock");
  absl::Status refused = Attach(d.get(), mixed.id, mixed.token);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnimplemented) << refused;
  EXPECT_NE(refused.message().find("segment 1 is in cuda_device memory"), std::string::npos)
      << refused;
}

TEST_F(ShmDataServerTest, AClientThatDoesNotReadStallsOnlyItself) {
  Start({});
  // Requests until the daemon stops taking them, no reply read.
  UniqueFd hostile = Connect(server_->path());
  ASSERT_EQ(::fcntl(hostile.get(), F_SETFL, O_NONBLOCK), 0);
  std::vector<AttachRequest> batch(64, RequestFor(kUnknownLease));
  size_t sent = 0;
  for (int i = 0; i < 100000; ++i) {
    ssize_t n = ::send(hostile.get(), batch.data(), batch.size() * sizeof(AttachRequest),
                       MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ASSERT_GT(sent / sizeof(AttachRequest), 500u);
  // Another client is answered at once.
  UniqueFd other = Connect(server_->path());
  ASSERT_EQ(Attach(other.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
  // And Stop does not wait for the client that does not read.
  absl::Time start = absl::Now();
  server_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(ShmDataServerTest, ConnectionsPastThePerUidCapAreRefused) {
  ShmDataServer::Options options;
  options.max_connections = 10;
  options.max_connections_per_uid = 2;
  Start(std::move(options));
  UniqueFd a = Connect(server_->path());
  UniqueFd b = Connect(server_->path());
  UniqueFd c = Connect(server_->path());
  absl::Status refused = Attach(c.get(), kUnknownLease);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max-data-connections-per-uid"), std::string::npos)
      << refused;
  // The ones it holds are served.
  EXPECT_EQ(Attach(a.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Attach(b.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
  // Once one closes, a new one gets in (the daemon sees the close in its
  // own time).
  a.Reset();
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::Status again;
  do {
    UniqueFd d = Connect(server_->path());
    again = Attach(d.get(), kUnknownLease);
  } while (again.code() == absl::StatusCode::kResourceExhausted && absl::Now() < deadline);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
}

TEST_F(ShmDataServerTest, ConnectionsPastTheTotalCapAreRefused) {
  ShmDataServer::Options options;
  options.max_connections = 2;
  options.max_connections_per_uid = 10;
  Start(std::move(options));
  UniqueFd a = Connect(server_->path());
  UniqueFd b = Connect(server_->path());
  UniqueFd c = Connect(server_->path());
  absl::Status refused = Attach(c.get(), kUnknownLease);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("(--max-data-connections)"), std::string::npos) << refused;
  EXPECT_EQ(Attach(a.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
}

TEST_F(ShmDataServerTest, DefaultCapsFollowTheFdLimit) {
  Start({});
  EXPECT_GT(server_->max_connections(), 0u);
  EXPECT_EQ(server_->max_connections_per_uid(), server_->max_connections() / 2);
}

}  // namespace
}  // namespace weightd
