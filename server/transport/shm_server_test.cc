#include "server/transport/data_server.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/gpu/cuda_push_writer.h"  // the CUDA push below: the daemon's wiring
#include "server/memory/segment.h"
#include "server/memory/test_buffers.h"

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

  void Start(DataServer::Options options) {
    options.path = dir_ + "/data.sock";
    options.on_push = [this](uint64_t bytes) {
      pushes_.fetch_add(1);
      push_bytes_.fetch_add(bytes);
    };
    auto server = DataServer::Start(std::move(options), &leases_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::string dir_;
  LeaseTable leases_{absl::Seconds(60)};
  // Pushes answered OK and their bytes, as the server reports them
  // (declared before the server, which must go first).
  std::atomic<uint64_t> pushes_{0};
  std::atomic<uint64_t> push_bytes_{0};
  std::unique_ptr<DataServer> server_;
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
      leases_.Grant(LeaseContents{.buffers = {host, std::make_shared<FakeDeviceBuffer>()}});
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
  DataServer::Options options;
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
  DataServer::Options options;
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

// Sends a push request (+ optional fds and offsets) and returns the answer.
absl::Status Push(int sock, uint64_t lease_id, const LeaseToken& token, std::vector<int> fds,
                  const std::vector<uint64_t>& offsets, uint32_t num_offsets) {
  std::string bytes(sizeof(PushRequest), '\0');
  PushRequest req{};
  std::memcpy(req.magic, kPushMagic, 4);
  req.num_offsets = num_offsets;
  req.lease_id = lease_id;
  std::memcpy(req.token, token.data(), sizeof(req.token));
  std::memcpy(bytes.data(), &req, sizeof(req));
  bytes.append(reinterpret_cast<const char*>(offsets.data()), offsets.size() * 8);
  absl::Status sent = SendWithFds(sock, bytes, fds);
  AttachReply reply{};
  absl::Status got = RecvAll(sock, &reply, sizeof(reply));
  if (!got.ok()) return sent.ok() ? got : sent;
  EXPECT_EQ(reply.num_fds, 0u);
  std::string msg(reply.message_len, '\0');
  if (!msg.empty()) {
    absl::Status s = RecvAll(sock, msg.data(), msg.size());
    if (!s.ok()) return s;
  }
  return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
}

TEST_F(ShmDataServerTest, PushWritesTheLeaseIntoTheClientsMemfd) {
  Start({});
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "test", 1000, false);
  ASSERT_TRUE(seg.ok());
  for (int k = 0; k < 1000; ++k) (*seg)->mutable_data()[k] = static_cast<uint8_t>(k);
  ASSERT_TRUE((*seg)->Seal().ok());
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{{0, 0, 600}, {0, 600, 400}});
  LeaseGrant grant = leases_.Grant(LeaseContents{.buffers = {SegmentPtr(std::move(*seg))},
                                                 .tensors = tensors});
  UniqueFd dest(::memfd_create("dest", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(dest.get(), 2048), 0);
  ASSERT_EQ(::posix_fallocate(dest.get(), 0, 2048), 0);
  ASSERT_EQ(::fcntl(dest.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  UniqueFd c = Connect(server_->path());
  // No fd: refused, and the connection reads the next request.
  absl::Status no_fd = Push(c.get(), grant.id, grant.token, {}, {}, 0);
  EXPECT_EQ(no_fd.code(), absl::StatusCode::kInvalidArgument) << no_fd;
  EXPECT_NE(no_fd.message().find("exactly one fd"), std::string::npos) << no_fd;
  // Two fds: the same.
  EXPECT_EQ(Push(c.get(), grant.id, grant.token, {dest.get(), dest.get()}, {}, 0).code(),
            absl::StatusCode::kInvalidArgument);
  // The client's offsets: the second tensor first.
  ASSERT_TRUE(Push(c.get(), grant.id, grant.token, {dest.get()}, {1024, 0}, 2).ok());
  std::string got(2048, '\0');
  ASSERT_EQ(::pread(dest.get(), got.data(), got.size(), 0), 2048);
  for (int k = 0; k < 600; ++k) ASSERT_EQ(static_cast<uint8_t>(got[1024 + k]), k % 256) << k;
  for (int k = 0; k < 400; ++k) ASSERT_EQ(static_cast<uint8_t>(got[k]), (600 + k) % 256) << k;
  EXPECT_EQ(pushes_.load(), 1u);
  EXPECT_EQ(push_bytes_.load(), 1000u);
  // Overlapping offsets: INVALID_ARGUMENT, the connection still served.
  absl::Status overlap = Push(c.get(), grant.id, grant.token, {dest.get()}, {0, 512}, 2);
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument) << overlap;
  EXPECT_TRUE(Push(c.get(), grant.id, grant.token, {dest.get()}, {}, 0).ok());
  // A wrong token: PERMISSION_DENIED, nothing written.
  LeaseToken wrong = grant.token;
  wrong[0] ^= 1;
  EXPECT_EQ(Push(c.get(), grant.id, wrong, {dest.get()}, {}, 0).code(),
            absl::StatusCode::kPermissionDenied);
  // An offsets count that is neither 0 nor the tensors': answered, then the
  // connection is closed (its stream cannot be trusted any more).
  // (A lease is attached to one connection: another one gets its own.)
  LeaseGrant other = leases_.Grant(LeaseContents{.buffers = {}, .tensors = tensors});
  UniqueFd d = Connect(server_->path());
  absl::Status count = Push(d.get(), other.id, other.token, {dest.get()}, {0, 1024, 2048}, 3);
  EXPECT_EQ(count.code(), absl::StatusCode::kInvalidArgument) << count;
  EXPECT_NE(count.message().find("3 offsets but lease"), std::string::npos) << count;
  char byte;
  EXPECT_LE(::recv(d.get(), &byte, 1, 0), 0);  // closed (reset: offsets left unread)
  // and the lease ended with it
  EXPECT_EQ(leases_.Use(other.id, absl::string_view(reinterpret_cast<const char*>(
                                                        other.token.data()), 16))
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  // The first connection is served on.
  EXPECT_EQ(Attach(c.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
}

TEST_F(ShmDataServerTest, PushesPastTheirUidsLimitAreRefusedTheRestServed) {
  DataServer::Options options;
  options.max_pushes_per_uid = 1;
  options.push_threads = 1;
  Start(std::move(options));
  // Large enough that the first push is still being written when the
  // second arrives (256 MiB: tens of milliseconds at the least).
  constexpr uint64_t kBytes = uint64_t{256} << 20;
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "big", kBytes, /*prefault=*/true);
  ASSERT_TRUE(seg.ok());
  ASSERT_TRUE((*seg)->Seal().ok());
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{{0, 0, kBytes}});
  BufferPtr buffer = SegmentPtr(std::move(*seg));
  LeaseGrant a = leases_.Grant(LeaseContents{.buffers = {buffer}, .tensors = tensors});
  LeaseGrant b = leases_.Grant(LeaseContents{.buffers = {buffer}, .tensors = tensors});
  auto destination = [&] {
    UniqueFd fd(::memfd_create("dest", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::fallocate(fd.get(), 0, 0, static_cast<off_t>(kBytes)), 0);
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    return fd;
  };
  UniqueFd da = destination(), db = destination();
  UniqueFd ca = Connect(server_->path());
  UniqueFd cb = Connect(server_->path());
  auto send = [](int sock, const LeaseGrant& g, int dest) {
    PushRequest req{};
    std::memcpy(req.magic, kPushMagic, 4);
    req.lease_id = g.id;
    std::memcpy(req.token, g.token.data(), sizeof(req.token));
    return SendWithFds(sock, absl::string_view(reinterpret_cast<const char*>(&req), sizeof(req)),
                       {&dest, 1});
  };
  auto answer = [](int sock) {
    AttachReply reply{};
    EXPECT_TRUE(RecvAll(sock, &reply, sizeof(reply)).ok());
    std::string msg(reply.message_len, '\0');
    if (!msg.empty()) {
      EXPECT_TRUE(RecvAll(sock, msg.data(), msg.size()).ok());
    }
    return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
  };
  ASSERT_TRUE(send(ca.get(), a, da.get()).ok());
  ASSERT_TRUE(send(cb.get(), b, db.get()).ok());
  absl::Status first = answer(ca.get()), second = answer(cb.get());
  // One of the two (whichever the daemon read second) is refused.
  const bool a_refused = first.code() == absl::StatusCode::kResourceExhausted;
  const absl::Status& refused = a_refused ? first : second;
  const absl::Status& served = a_refused ? second : first;
  EXPECT_TRUE(served.ok()) << served;
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max-pushes-per-uid"), std::string::npos) << refused;
  // Once the first is answered, the limit has room again: the refused one,
  // asked again on its connection, is served.
  if (a_refused) {
    ASSERT_TRUE(send(ca.get(), a, da.get()).ok());
    EXPECT_TRUE(answer(ca.get()).ok());
  } else {
    ASSERT_TRUE(send(cb.get(), b, db.get()).ok());
    EXPECT_TRUE(answer(cb.get()).ok());
  }
  EXPECT_EQ(pushes_.load(), 2u);
}

TEST_F(ShmDataServerTest, ACudaPushIsReadWholeAndAnsweredWhyNotWithoutAGpu) {
  GpuInventory none;
  none.unavailable = "no CUDA driver here";
  DataServer::Options options;
  options.push_writers = {std::make_shared<CudaPushWriter>(&none)};
  Start(std::move(options));
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{{0, 0, 16}, {0, 16, 16}});
  LeaseGrant grant = leases_.Grant(LeaseContents{.buffers = {}, .tensors = tensors});
  UniqueFd c = Connect(server_->path());
  auto cuda_push = [&](std::vector<int> fds, std::vector<uint64_t> offsets, uint32_t kind) {
    PushRequest req{};
    std::memcpy(req.magic, kCudaPushMagic, 4);
    req.num_offsets = static_cast<uint32_t>(offsets.size());
    req.lease_id = grant.id;
    std::memcpy(req.token, grant.token.data(), sizeof(req.token));
    CudaPushTarget target{};
    std::memset(target.gpu_uuid, 0x42, sizeof(target.gpu_uuid));
    target.size = 1 << 20;
    target.handle_kind = kind;
    std::string bytes(reinterpret_cast<const char*>(&req), sizeof(req));
    bytes.append(reinterpret_cast<const char*>(&target), sizeof(target));
    bytes.append(reinterpret_cast<const char*>(offsets.data()), offsets.size() * 8);
    absl::Status sent = SendWithFds(c.get(), bytes, fds);
    AttachReply reply{};
    absl::Status got = RecvAll(c.get(), &reply, sizeof(reply));
    if (!got.ok()) return sent.ok() ? got : sent;
    std::string msg(reply.message_len, '\0');
    if (!msg.empty()) {
      EXPECT_TRUE(RecvAll(c.get(), msg.data(), msg.size()).ok());
    }
    return absl::Status(static_cast<absl::StatusCode>(reply.code), msg);
  };
  UniqueFd vmm(::memfd_create("stands-in-for-a-vmm-fd", MFD_CLOEXEC));
  // With its offsets: target and offsets are read whole, then the answer.
  absl::Status no_gpu = cuda_push({vmm.get()}, {0, 256}, kCudaVmmPosixFd);
#ifdef WEIGHTD_HAVE_CUDA
  EXPECT_EQ(no_gpu.code(), absl::StatusCode::kFailedPrecondition) << no_gpu;
  EXPECT_NE(no_gpu.message().find("no CUDA driver here"), std::string::npos) << no_gpu;
  EXPECT_NE(no_gpu.message().find("GPU-42424242-4242"), std::string::npos) << no_gpu;
#else
  EXPECT_EQ(no_gpu.code(), absl::StatusCode::kUnimplemented) << no_gpu;
#endif
  // The same connection serves on: a default layout, a legacy handle.
  absl::Status legacy = cuda_push({}, {}, kCudaLegacyIpc);
  EXPECT_TRUE(legacy.code() == absl::StatusCode::kFailedPrecondition ||
              legacy.code() == absl::StatusCode::kUnimplemented)
      << legacy;
  // Two fds: refused before anything else.
  absl::Status two = cuda_push({vmm.get(), vmm.get()}, {}, kCudaVmmPosixFd);
  EXPECT_EQ(two.code(), absl::StatusCode::kInvalidArgument) << two;
  EXPECT_EQ(Attach(c.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
}

TEST_F(ShmDataServerTest, AttachRequestsCarryNoFds) {
  Start({});
  UniqueFd c = Connect(server_->path());
  UniqueFd extra(::memfd_create("stray", MFD_CLOEXEC));
  AttachRequest req = RequestFor(kUnknownLease);
  ASSERT_TRUE(SendWithFds(c.get(),
                          absl::string_view(reinterpret_cast<const char*>(&req), sizeof(req)),
                          {extra.get()})
                  .ok());
  AttachReply reply{};
  ASSERT_TRUE(RecvAll(c.get(), &reply, sizeof(reply)).ok());
  EXPECT_EQ(reply.code, static_cast<int32_t>(absl::StatusCode::kNotFound));
}

size_t OpenFds() {
  size_t n = 0;
  for (int fd = 0; fd < 65536; ++fd) n += ::fcntl(fd, F_GETFD) >= 0 ? 1 : 0;
  return n;
}

TEST_F(ShmDataServerTest, FdsTrickledWithARequestsBytesAreNotKept) {
  Start({});
  UniqueFd c = Connect(server_->path());
  std::vector<UniqueFd> mine;
  std::vector<int> four;
  for (int i = 0; i < 4; ++i) {
    mine.emplace_back(::memfd_create("trickle", MFD_CLOEXEC));
    four.push_back(mine.back().get());
  }
  // One round trip first: the daemon has accepted the connection.
  ASSERT_EQ(Attach(c.get(), kUnknownLease).code(), absl::StatusCode::kNotFound);
  AttachRequest req = RequestFor(kUnknownLease);
  const char* bytes = reinterpret_cast<const char*>(&req);
  const size_t before = OpenFds();
  // Every byte but the last carries four fds: only the first byte's are
  // taken (and dropped once the request is read); the kernel discards the
  // rest.
  for (size_t i = 0; i + 1 < sizeof(req); ++i) {
    ASSERT_TRUE(SendWithFds(c.get(), absl::string_view(bytes + i, 1), four).ok());
  }
  absl::SleepFor(absl::Milliseconds(200));  // the daemon reads what came
  EXPECT_LE(OpenFds(), before + 4);
  ASSERT_TRUE(SendAll(c.get(), bytes + sizeof(req) - 1, 1).ok());
  AttachReply reply{};
  ASSERT_TRUE(RecvAll(c.get(), &reply, sizeof(reply)).ok());
  EXPECT_EQ(reply.code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (OpenFds() > before && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(OpenFds(), before);
}

TEST_F(ShmDataServerTest, DefaultCapsFollowTheFdLimit) {
  Start({});
  EXPECT_GT(server_->max_connections(), 0u);
  EXPECT_EQ(server_->max_connections_per_uid(), server_->max_connections() / 2);
}

}  // namespace
}  // namespace weightd
