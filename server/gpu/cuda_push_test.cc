#include "server/gpu/cuda_push_writer.h"

#include <cstring>

#include <gtest/gtest.h>

namespace weightd {
namespace {

CudaPushTarget Target(uint8_t uuid_byte, uint64_t size, uint32_t kind) {
  CudaPushTarget t{};
  std::memset(t.gpu_uuid, uuid_byte, sizeof(t.gpu_uuid));
  t.size = size;
  t.handle_kind = kind;
  return t;
}

GpuInventory OneGpu() {
  GpuInventory inv;
  inv.cuda_built = true;
  GpuDevice d;
  d.ordinal = 0;
  uint8_t uuid[16];
  std::memset(uuid, 0xab, sizeof(uuid));
  d.uuid = FormatGpuUuid(uuid);
  inv.devices.push_back(d);
  return inv;
}

PushLayout LayoutOf(uint64_t size) {
  PushLayout l;
  l.size = size;
  return l;
}

TEST(GpuUuidTest, FormatsAsNvidiaSmi) {
  uint8_t b[16] = {0x4b, 0x5f, 0x6d, 0x2e, 0x01, 0x02, 0x03, 0x04,
                   0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0xff};
  EXPECT_EQ(FormatGpuUuid(b), "GPU-4b5f6d2e-0102-0304-0506-0708090a0bff");
}

TEST(CheckCudaTargetTest, FindsTheGpuByUuid) {
  auto gpu = CheckCudaTarget(Target(0xab, 4096, kCudaVmmPosixFd), true, LayoutOf(4096), OneGpu());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->uuid, "GPU-abababab-abab-abab-abab-abababababab");
  EXPECT_TRUE(CheckCudaTarget(Target(0xab, 4096, kCudaLegacyIpc), false, LayoutOf(1), OneGpu()).ok());
}

TEST(CheckCudaTargetTest, SaysWhyNot) {
  GpuInventory none;
  none.unavailable = "no CUDA driver: libcuda.so.1 cannot be loaded";
  auto no_gpu = CheckCudaTarget(Target(0xab, 4096, kCudaVmmPosixFd), true, LayoutOf(1), none);
  EXPECT_EQ(no_gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(no_gpu.status().message().find("libcuda.so.1"), std::string::npos) << no_gpu.status();

  auto other = CheckCudaTarget(Target(0x11, 4096, kCudaVmmPosixFd), true, LayoutOf(1), OneGpu());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(other.status().message().find("GPU-11111111-1111"), std::string::npos);
  EXPECT_NE(other.status().message().find("GPU-abababab"), std::string::npos);

  auto small = CheckCudaTarget(Target(0xab, 4096, kCudaVmmPosixFd), true, LayoutOf(4097), OneGpu());
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("needs 4097"), std::string::npos);

  EXPECT_EQ(CheckCudaTarget(Target(0xab, 4096, kCudaVmmPosixFd), false, LayoutOf(1), OneGpu())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCudaTarget(Target(0xab, 4096, kCudaLegacyIpc), true, LayoutOf(1), OneGpu())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCudaTarget(Target(0xab, 0, kCudaVmmPosixFd), true, LayoutOf(0), OneGpu())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto kind = CheckCudaTarget(Target(0xab, 4096, 7), true, LayoutOf(1), OneGpu());
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(kind.status().message().find("unknown CUDA handle kind 7"), std::string::npos);
}

TEST(PushToCudaTest, WithoutAGpuItIsRefusedBeforeAnyCudaCall) {
  LeaseContents lease;
  GpuInventory none;
  none.unavailable = "CUDA found no device";
  absl::Status s = PushToCuda(lease, LayoutOf(0), Target(0xab, 4096, kCudaVmmPosixFd), 5, none,
                              nullptr);
#ifdef WEIGHTD_HAVE_CUDA
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("CUDA found no device"), std::string::npos) << s;
#else
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("without CUDA"), std::string::npos) << s;
#endif
}

}  // namespace
}  // namespace weightd
