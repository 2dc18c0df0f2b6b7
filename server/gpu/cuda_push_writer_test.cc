// CudaPushWriter (cuda_push_writer.h): which targets it serves, and the
// export plan it makes, without a GPU.
#include "server/gpu/cuda_push_writer.h"

#include <cstring>

#include <gtest/gtest.h>

namespace weightd {
namespace {

CudaPushTarget Target(uint8_t uuid_byte, uint32_t kind) {
  CudaPushTarget t{};
  std::memset(t.gpu_uuid, uuid_byte, sizeof(t.gpu_uuid));
  t.size = 4096;
  t.handle_kind = kind;
  return t;
}

GpuInventory OneGpu(uint64_t memory_bytes) {
  GpuInventory inv;
  inv.cuda_built = true;
  GpuDevice d;
  uint8_t uuid[16];
  std::memset(uuid, 0xab, sizeof(uuid));
  d.uuid = FormatGpuUuid(uuid);
  d.memory_bytes = memory_bytes;
  inv.devices.push_back(d);
  return inv;
}

PushLayout LayoutOf(uint64_t size) {
  PushLayout l;
  l.size = size;
  return l;
}

TEST(CudaPushWriterTest, HostPushesAndTheHostTwinAreNotItsOwn) {
  GpuInventory gpus = OneGpu(uint64_t{80} << 30);
  CudaPushWriter writer(&gpus);
  LeaseContents lease;
  EXPECT_FALSE(writer.Push(lease, LayoutOf(0), PushTarget{.fd = 3}, nullptr).has_value());
  // An export reaches it as an export, never as a push.
  EXPECT_FALSE(writer.Push(lease, LayoutOf(0), PushTarget{.cuda = Target(0xab, kCudaDaemonExport)},
                           nullptr)
                   .has_value());
  EXPECT_FALSE(writer.PlanExport(std::make_shared<LeaseContents>(), LayoutOf(0),
                                 Target(0, kCudaDaemonExport), nullptr)
                   .has_value());
}

TEST(CudaPushWriterTest, ACudaPushIsItsOwnAndCheckedAsPushToCudaChecksIt) {
  GpuInventory none;
  none.unavailable = "no CUDA driver here";
  CudaPushWriter writer(&none);
  LeaseContents lease;
  std::optional<absl::Status> s =
      writer.Push(lease, LayoutOf(0), PushTarget{.cuda = Target(0x42, kCudaVmmPosixFd), .fd = 5},
                  nullptr);
  ASSERT_TRUE(s.has_value());
#ifdef WEIGHTD_HAVE_CUDA
  EXPECT_EQ(s->code(), absl::StatusCode::kFailedPrecondition) << *s;
  EXPECT_NE(s->message().find("no CUDA driver here"), std::string::npos) << *s;
#else
  EXPECT_EQ(s->code(), absl::StatusCode::kUnimplemented) << *s;
#endif
  // Without an inventory: none at all.
  CudaPushWriter without(nullptr);
  auto plan = without.PlanExport(std::make_shared<LeaseContents>(), LayoutOf(1),
                                 Target(0x42, kCudaDaemonExport), nullptr);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan->status().message().find("no GPU inventory was given"), std::string::npos)
      << plan->status();
}

TEST(CudaPushWriterTest, AnExportIsBudgetedAsTheGpuAllocatesIt) {
  GpuInventory gpus = OneGpu(uint64_t{80} << 30);
  CudaPushWriter writer(&gpus);
  auto plan = writer.PlanExport(std::make_shared<LeaseContents>(), LayoutOf((3 << 20) + 1),
                                Target(0xab, kCudaDaemonExport), nullptr);
  ASSERT_TRUE(plan.has_value());
  ASSERT_TRUE(plan->ok()) << plan->status();
  EXPECT_EQ((*plan)->device, "GPU-abababab-abab-abab-abab-abababababab");
  EXPECT_EQ((*plan)->size, uint64_t{4} << 20);  // whole 2 MiB granules
  EXPECT_EQ((*plan)->default_budget, uint64_t{20} << 30);  // a quarter of the GPU
  // Another GPU's UUID: NOT_FOUND, naming the daemon's.
  auto other = writer.PlanExport(std::make_shared<LeaseContents>(), LayoutOf(1),
                                 Target(0x11, kCudaDaemonExport), nullptr);
  ASSERT_TRUE(other.has_value());
  EXPECT_EQ(other->status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace weightd
