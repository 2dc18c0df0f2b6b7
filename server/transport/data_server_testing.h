// The client's side of the data socket, for the data server's unit tests:
// a real DataServer on a socket in a temporary directory, and requests sent
// over real connections (common/data_protocol.h). Tests only.
#ifndef WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_TESTING_H_
#define WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_TESTING_H_

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/data_protocol.h"
#include "common/unix_socket.h"
#include "server/lease/lease_table.h"
#include "server/memory/segment.h"
#include "server/transport/data_server.h"

namespace weightd::testing {

// An answer as a client reads it: the status, the fds that came with it
// and (OK) the message bytes, an export's ExportInfo.
struct Reply {
  absl::Status status;
  std::vector<UniqueFd> fds;
  std::string payload;
};

// Reads one reply: its header and message, then its fds (the first batch
// rides on the header, each further batch on one byte of its own).
inline Reply ReadReply(int sock) {
  Reply out;
  AttachReply reply{};
  if (absl::Status s = RecvWithFds(sock, &reply, sizeof(reply), &out.fds); !s.ok()) {
    out.status = s;
    return out;
  }
  std::string msg(reply.message_len, '\0');
  if (!msg.empty()) {
    if (absl::Status s = RecvAll(sock, msg.data(), msg.size()); !s.ok()) {
      out.status = s;
      return out;
    }
  }
  while (out.fds.size() < reply.num_fds) {
    char byte;
    if (absl::Status s = RecvWithFds(sock, &byte, 1, &out.fds); !s.ok()) {
      out.status = s;
      break;
    }
  }
  if (!out.status.ok()) return out;
  const auto code = static_cast<absl::StatusCode>(reply.code);
  out.status = absl::Status(code, code == absl::StatusCode::kOk ? "" : msg);
  if (code == absl::StatusCode::kOk) out.payload = std::move(msg);
  return out;
}

// A 32-byte request of any magic (AttachRequest, PushRequest and
// StageRequest share the layout; `count` is a push's num_offsets).
inline std::string Header(const char* magic, uint64_t id, const LeaseToken& token,
                          uint32_t count = 0) {
  PushRequest req{};
  std::memcpy(req.magic, magic, 4);
  req.num_offsets = count;
  req.lease_id = id;
  std::memcpy(req.token, token.data(), sizeof(req.token));
  return std::string(reinterpret_cast<const char*>(&req), sizeof(req));
}

inline std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

// Sends `bytes` (fds riding on the first) and reads the answer.
inline Reply Exchange(int sock, const std::string& bytes, std::vector<int> fds = {}) {
  if (absl::Status s = SendWithFds(sock, bytes, fds); !s.ok()) {
    Reply r = ReadReply(sock);  // a refusal may be there still
    if (r.status.ok() || absl::IsUnavailable(r.status)) r.status = s;
    return r;
  }
  return ReadReply(sock);
}

// A sealed host segment of `size` bytes, byte k = k % 251.
inline BufferPtr HostBuffer(uint64_t size) {
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "test", size, false);
  EXPECT_TRUE(seg.ok()) << seg.status();
  for (uint64_t k = 0; k < size; ++k) (*seg)->mutable_data()[k] = static_cast<uint8_t>(k % 251);
  EXPECT_TRUE((*seg)->Seal().ok());
  return SegmentPtr(std::move(*seg));
}

// A push destination: a memfd of `size` bytes, allocated and sealed as the
// protocol wants.
inline UniqueFd Destination(uint64_t size) {
  UniqueFd fd(::memfd_create("dest", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  EXPECT_EQ(::posix_fallocate(fd.get(), 0, static_cast<off_t>(size)), 0);
  EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

// Waits up to 10 s for `done()`; returns its last answer.
template <typename F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Whether the peer closed `sock` (reads nothing more, within 10 s).
inline bool ClosedByPeer(int sock) {
  char byte;
  return ::recv(sock, &byte, 1, 0) <= 0;
}

// A DataServer per test, with its lease table.
class DataServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/data_server_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    server_.reset();
    ::rmdir(dir_.c_str());
  }

  void Start(DataServer::Options options = {}) {
    options.path = dir_ + "/data.sock";
    auto server = DataServer::Start(std::move(options), &leases_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  // A connection with a receive timeout: a server that never answers fails
  // the test instead of hanging it.
  UniqueFd Connect() {
    auto fd = ConnectUnix(server_->path());
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (!fd.ok()) return UniqueFd();
    timeval tv{10, 0};
    ::setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return std::move(*fd);
  }

  std::string dir_;
  LeaseTable leases_{absl::Seconds(60)};
  std::unique_ptr<DataServer> server_;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_SERVER_TRANSPORT_DATA_SERVER_TESTING_H_
