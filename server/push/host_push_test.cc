#include "server/push/host_push.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "server/kernels/cast.h"
#include "common/fd.h"
#include "server/memory/segment.h"
#include "server/memory/test_buffers.h"

namespace weightd {
namespace {

// A lease over one sealed host segment holding tensors of `lengths`, packed
// back to back, byte k of the segment = k * 7 + 3 (mod 256).
LeaseContents LeaseOf(const std::vector<uint64_t>& lengths) {
  uint64_t total = 0;
  for (uint64_t n : lengths) total += n;
  auto account = std::make_shared<MemoryAccount>(0);
  auto seg = Segment::Create(account, "push-src", std::max<uint64_t>(total, 1), false);
  EXPECT_TRUE(seg.ok()) << seg.status();
  for (uint64_t k = 0; k < total; ++k) (*seg)->mutable_data()[k] = static_cast<uint8_t>(k * 7 + 3);
  EXPECT_TRUE((*seg)->Seal().ok());
  LeaseContents lease;
  lease.buffers.push_back(SegmentPtr(std::move(*seg)));
  auto tensors = std::make_shared<std::vector<LeaseTensor>>();
  uint64_t at = 0;
  for (uint64_t n : lengths) {
    tensors->push_back(LeaseTensor{0, at, n});
    at += n;
  }
  lease.tensors = std::move(tensors);
  return lease;
}

// A memfd of `size` bytes, every byte 0xEE (so its pages are allocated),
// sealed against shrinking as a push wants (`seals`).
UniqueFd Destination(uint64_t size, int seals = F_SEAL_SHRINK | F_SEAL_GROW) {
  UniqueFd fd(::memfd_create("dest", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  std::string fill(size, '\xEE');
  EXPECT_EQ(::pwrite(fd.get(), fill.data(), fill.size(), 0), static_cast<ssize_t>(size));
  if (seals != 0) {
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

std::string ReadAll(int fd, uint64_t size) {
  std::string out(size, '\0');
  EXPECT_EQ(::pread(fd, out.data(), size, 0), static_cast<ssize_t>(size));
  return out;
}

absl::Status PushDefault(const LeaseContents& lease, int fd,
                         const std::atomic<bool>* cancel = nullptr) {
  auto layout = LayoutForPush(lease, {});
  if (!layout.ok()) return layout.status();
  return PushToHost(lease, *layout, fd, cancel);
}

TEST(HostPushTest, WritesEveryTensorAtItsOffsetAndNothingElse) {
  LeaseContents lease = LeaseOf({100, 0, 5000, 1});
  auto layout = LayoutForPush(lease, {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->offsets, (std::vector<uint64_t>{0, 256, 256, 5376}));
  UniqueFd dest = Destination(layout->size + 300);
  ASSERT_TRUE(PushToHost(lease, *layout, dest.get(), nullptr).ok());
  std::string got = ReadAll(dest.get(), layout->size + 300);
  const uint8_t* src = lease.buffers[0]->host_data();
  std::string want(got.size(), '\xEE');
  for (size_t i = 0; i < lease.tensors->size(); ++i) {
    const LeaseTensor& t = (*lease.tensors)[i];
    std::memcpy(want.data() + layout->offsets[i], src + t.offset, t.length);
  }
  EXPECT_EQ(got, want);  // the gaps and the tail keep the client's bytes
}

TEST(HostPushTest, CastsAsItWritesTheSameBytesAsCastBuffer) {
  // A plain tensor, then 1.5 Mi BF16 elements (every 16-bit pattern, and
  // more) pushed as F32 — several bounce pieces — then F64 -> F16.
  constexpr uint64_t kBf16 = 3 << 19;
  constexpr uint64_t kF64 = 1000;
  LeaseContents lease = LeaseOf({100, kBf16 * 2, kF64 * 8});
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(*lease.tensors);
  (*tensors)[1].cast = true;
  (*tensors)[1].src_dtype = DType::kBF16;
  (*tensors)[1].dst_dtype = DType::kF32;
  (*tensors)[2].cast = true;
  (*tensors)[2].src_dtype = DType::kF64;
  (*tensors)[2].dst_dtype = DType::kF16;
  lease.tensors = tensors;
  auto layout = LayoutForPush(lease, {});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->lengths, (std::vector<uint64_t>{100, kBf16 * 4, kF64 * 2}));
  UniqueFd dest = Destination(layout->size);
  ASSERT_TRUE(PushToHost(lease, *layout, dest.get(), nullptr).ok());
  std::string got = ReadAll(dest.get(), layout->size);
  const uint8_t* src = lease.buffers[0]->host_data();
  EXPECT_EQ(got.substr(0, 100), std::string(reinterpret_cast<const char*>(src), 100));
  std::string want(kBf16 * 4, '\0');
  ASSERT_TRUE(CastBufferScalar(DType::kBF16, src + (*tensors)[1].offset, DType::kF32,
                               want.data(), kBf16)
                  .ok());
  EXPECT_TRUE(got.substr(layout->offsets[1], kBf16 * 4) == want);
  want.assign(kF64 * 2, '\0');
  ASSERT_TRUE(CastBufferScalar(DType::kF64, src + (*tensors)[2].offset, DType::kF16,
                               want.data(), kF64)
                  .ok());
  EXPECT_TRUE(got.substr(layout->offsets[2], kF64 * 2) == want);
}

TEST(HostPushTest, ClientOffsetsInAnyOrder) {
  LeaseContents lease = LeaseOf({300, 20});
  std::vector<uint64_t> offsets = {512, 0};
  auto layout = LayoutForPush(lease, offsets);
  ASSERT_TRUE(layout.ok()) << layout.status();
  UniqueFd dest = Destination(1024);
  ASSERT_TRUE(PushToHost(lease, *layout, dest.get(), nullptr).ok());
  std::string got = ReadAll(dest.get(), 1024);
  const uint8_t* src = lease.buffers[0]->host_data();
  EXPECT_EQ(got.substr(512, 300), std::string(reinterpret_cast<const char*>(src), 300));
  EXPECT_EQ(got.substr(0, 20), std::string(reinterpret_cast<const char*>(src) + 300, 20));
  EXPECT_EQ(got.substr(20, 492), std::string(492, '\xEE'));
}

TEST(HostPushTest, RefusesWhatIsNotAWritableAllocatedMemfdLargeEnough) {
  LeaseContents lease = LeaseOf({4000, 4000});
  auto layout = LayoutForPush(lease, {});
  ASSERT_TRUE(layout.ok());
  auto code_of = [&](int fd) { return PushToHost(lease, *layout, fd, nullptr).code(); };

  EXPECT_EQ(code_of(-1), absl::StatusCode::kInvalidArgument);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  absl::Status pipe = PushToHost(lease, *layout, pipe_fds[1], nullptr);
  EXPECT_EQ(pipe.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pipe.message().find("a pipe, not a memfd"), std::string::npos) << pipe;
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);

  char path[] = "/tmp/host_push_test.XXXXXX";
  UniqueFd file(::mkstemp(path));
  ASSERT_TRUE(file.valid());
  ::unlink(path);
  ASSERT_EQ(::ftruncate(file.get(), 1 << 20), 0);
  absl::Status regular = PushToHost(lease, *layout, file.get(), nullptr);
  EXPECT_EQ(regular.code(), absl::StatusCode::kInvalidArgument) << regular;
  EXPECT_NE(regular.message().find("not a memfd"), std::string::npos) << regular;

  UniqueFd small = Destination(layout->size - 1);
  absl::Status too_small = PushToHost(lease, *layout, small.get(), nullptr);
  EXPECT_EQ(too_small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_small.message().find("needs " + std::to_string(layout->size)),
            std::string::npos)
      << too_small;

  UniqueFd rw = Destination(layout->size);
  UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(rw.get())).c_str(), O_RDONLY));
  ASSERT_TRUE(ro.valid());
  absl::Status read_only = PushToHost(lease, *layout, ro.get(), nullptr);
  EXPECT_EQ(read_only.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(read_only.message().find("read-only"), std::string::npos) << read_only;

  UniqueFd sealed = Destination(layout->size, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
  absl::Status write_sealed = PushToHost(lease, *layout, sealed.get(), nullptr);
  EXPECT_EQ(write_sealed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(write_sealed.message().find("sealed against writes"), std::string::npos);

  // Free to shrink or grow mid-push: refused (the daemon's writes would
  // allocate pages).
  UniqueFd shrinkable = Destination(layout->size, 0);
  absl::Status may_shrink = PushToHost(lease, *layout, shrinkable.get(), nullptr);
  EXPECT_EQ(may_shrink.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(may_shrink.message().find("F_SEAL_SHRINK | F_SEAL_GROW"), std::string::npos)
      << may_shrink;
  UniqueFd growable = Destination(layout->size, F_SEAL_SHRINK);
  EXPECT_EQ(PushToHost(lease, *layout, growable.get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  UniqueFd unsealable(::memfd_create("no-sealing", MFD_CLOEXEC));  // F_SEAL_SEAL only
  ASSERT_EQ(::fallocate(unsealable.get(), 0, 0, static_cast<off_t>(layout->size)), 0);
  EXPECT_EQ(PushToHost(lease, *layout, unsealable.get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadAll(shrinkable.get(), 16), std::string(16, '\xEE'));

  // Allocated, but elsewhere than where the push writes: refused too.
  UniqueFd half(::memfd_create("half", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(half.get(), static_cast<off_t>(2 * layout->size)), 0);
  ASSERT_EQ(::fallocate(half.get(), 0, static_cast<off_t>(layout->size),
                        static_cast<off_t>(layout->size)), 0);
  ASSERT_EQ(::fcntl(half.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_EQ(PushToHost(lease, *layout, half.get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);

  // Sized but never allocated: the daemon's writes would allocate its pages.
  UniqueFd sparse(::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(sparse.get(), static_cast<off_t>(layout->size)), 0);
  absl::Status hole = PushToHost(lease, *layout, sparse.get(), nullptr);
  EXPECT_EQ(hole.code(), absl::StatusCode::kFailedPrecondition) << hole;
  EXPECT_NE(hole.message().find("fallocate"), std::string::npos) << hole;
  EXPECT_EQ(ReadAll(sparse.get(), 16), std::string(16, '\0'));
  // fallocate()d pages are the client's: taken.
  ASSERT_EQ(::posix_fallocate(sparse.get(), 0, static_cast<off_t>(layout->size)), 0);
  ASSERT_EQ(::fcntl(sparse.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_TRUE(PushToHost(lease, *layout, sparse.get(), nullptr).ok());

  // O_APPEND on the client's side of the file description cannot move the
  // writes past the end: the size is sealed (EPERM), the push ends ABORTED.
  UniqueFd append = Destination(layout->size);
  ASSERT_EQ(::fcntl(append.get(), F_SETFL, O_APPEND), 0);
  absl::Status appended = PushToHost(lease, *layout, append.get(), nullptr);
  EXPECT_EQ(appended.code(), absl::StatusCode::kAborted) << appended;
  struct stat st {};
  ASSERT_EQ(::fstat(append.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), layout->size);
}

TEST(HostPushTest, CancelEndsItUnavailableAndAnEmptyPushNeedsNoBytes) {
  LeaseContents lease = LeaseOf({1000});
  UniqueFd dest = Destination(1000);
  std::atomic<bool> cancel{true};
  EXPECT_EQ(PushDefault(lease, dest.get(), &cancel).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ReadAll(dest.get(), 1000), std::string(1000, '\xEE'));

  LeaseContents none;
  UniqueFd empty = Destination(0);
  EXPECT_TRUE(PushDefault(none, empty.get()).ok());
  LeaseContents zeros = LeaseOf({0, 0});
  EXPECT_TRUE(PushDefault(zeros, empty.get()).ok());
}


TEST(HostPushTest, RefusesDeviceBuffersWithoutTouchingTheDestination) {
  LeaseContents lease;
  lease.buffers.push_back(std::make_shared<FakeDeviceBuffer>(false));
  lease.tensors = std::make_shared<std::vector<LeaseTensor>>(
      std::vector<LeaseTensor>{LeaseTensor{0, 0, 64}});
  UniqueFd dest = Destination(256);
  absl::Status s = PushDefault(lease, dest.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("cuda_device"), std::string::npos) << s;
  EXPECT_EQ(ReadAll(dest.get(), 256), std::string(256, '\xEE'));
}

}  // namespace
}  // namespace weightd

namespace weightd {
namespace {

// The host twin of an export is filled in the daemon's own memory: the
// same bytes as a push of the same lease and layout, casts included.
TEST(HostPushTest, CopyLeaseToHostWritesWhatThePushWrites) {
  LeaseContents lease = LeaseOf({100, 0, 2000, 1});
  auto tensors = std::make_shared<std::vector<LeaseTensor>>(*lease.tensors);
  (*tensors)[2].cast = true;
  (*tensors)[2].src_dtype = DType::kBF16;
  (*tensors)[2].dst_dtype = DType::kF32;
  lease.tensors = tensors;
  auto layout = LayoutForPush(lease, {});
  ASSERT_TRUE(layout.ok());
  UniqueFd dest = Destination(layout->size);
  ASSERT_TRUE(PushToHost(lease, *layout, dest.get(), nullptr).ok());
  std::string mine(layout->size, '\xEE');
  ASSERT_TRUE(CopyLeaseToHost(lease, *layout, reinterpret_cast<uint8_t*>(mine.data()),
                              mine.size(), nullptr)
                  .ok());
  EXPECT_TRUE(mine == ReadAll(dest.get(), layout->size));
  // Too small a destination is refused before a byte is written.
  std::string small(layout->size - 1, '\xEE');
  EXPECT_EQ(CopyLeaseToHost(lease, *layout, reinterpret_cast<uint8_t*>(small.data()),
                            small.size(), nullptr)
                .code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(small, std::string(layout->size - 1, '\xEE'));
  std::atomic<bool> cancel{true};
  EXPECT_EQ(CopyLeaseToHost(lease, *layout, reinterpret_cast<uint8_t*>(mine.data()), mine.size(),
                            &cancel)
                .code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace weightd
